"""A torch.distributed store seen as ours: torchrun's agent store, or the one torch hands a
backend when it creates a process group.

torchrun's agent already serves a torch ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` (and says
so with ``TORCHELASTIC_USE_AGENT_STORE=True``); every rank joins it as a client instead of
serving a second store on that port. torch is imported only here, and only then (it is always
there under torchrun). ``get`` with a deadline is ``wait`` then ``get``; torch's timeout becomes
the builtin ``TimeoutError`` our rendezvous expects.

torch's store authenticates nobody: whoever reaches its port reads and writes it. With a
secret, ``bootstrap.connect`` therefore signs every value it writes here and checks every value
it reads (rendezvous/signed.py); what the values say is not hidden (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from .errors import BrokenError
from .rendezvous import Store

__all__ = ["C10dStore", "torchrun_store"]


class C10dStore(Store):
    """Our ``Store`` interface over a ``torch.distributed.Store`` (keys are str, values bytes)."""

    def __init__(self, store: Any, timeout: float, host: str | None = None) -> None:
        self._store = store
        self._timeout = timeout
        self.host = host  # where it serves, for choosing the address our mesh listens on

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        wait = self._timeout if timeout is None else timeout
        try:
            self._store.wait([key], timedelta(seconds=max(wait, 0.001)))
        except RuntimeError as exc:
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                raise TimeoutError(f"store get {key!r}: key not set within {wait:g} s") from None
            raise BrokenError(f"the torch store failed on get {key!r}: {exc}") from exc
        return bytes(self._store.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def check(self, keys: Sequence[str]) -> list[bool]:
        return [bool(self._store.check([key])) for key in keys]

    def delete(self, key: str) -> None:
        self._store.delete_key(key)

    def close(self) -> None:
        """torch closes its store when the last reference goes."""


def torchrun_store(host: str, port: int, timeout: float) -> C10dStore:
    """A client of torchrun's agent store."""
    import torch.distributed

    store = torch.distributed.TCPStore(  # type: ignore[attr-defined]
        host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
    )
    return C10dStore(store, timeout, host)
