"""Values signed with the job's secret, for a store that does not check the secret itself.

Theory of operation. Our TCP store proves the secret on every connection before it reads a
request, so with a secret nobody else can read or write it. Other stores have no such guard:
torch's store (torchrun's agent store, a torch job's, the one torch hands the plugin) lets
anyone who reaches its port read and write, and a file store is guarded only by the
directory's permissions. Over such a store ``signed`` puts ``SignedStore`` under the
rendezvous's namespace: every value is stored as ``MARK | HMAC(secret, context, key, value) |
value``, the key being the full key (namespace included), and every value read is checked
before it is used. A value that someone without the secret wrote, or moved from another key,
makes the reader raise AuthenticationError; its text is never shown or used. A rank with no
secret reads through ``PlainStore``, which recognizes a signed value by its mark and raises
AuthenticationError too, so ranks that disagree about the secret fail saying so, as they do
over our TCP store.

What signing cannot do: hide the values (anyone who reaches such a store still reads the job
token, the addresses, the world size; see docs/security.md), stop a replay of a value signed
with the same secret under the same key by an earlier rendezvous, or guard counters (``add``)
and deletions. All of these can only make init fail, never let anyone in: the data
connections prove the secret themselves.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from ..auth import PROOF_BYTES, AuthenticationError, Secret
from .store import PrefixStore, Store

__all__ = ["MARK", "PlainStore", "SignedStore", "signed"]

MARK = b"ARSIGNED"  # what a signed value starts with
_CONTEXT = b"asyncreduce store value v1"  # what the tags of this use of the secret are bound to
_HOW_TO_SET = "set the same ASYNCREDUCE_SECRET (or ASYNCREDUCE_SECRET_FILE) on every rank"


class _Layer(Store):
    """A store over another that changes only how values are written and read."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.host = getattr(store, "host", None)  # where the store serves, for routing

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)  # a counter cannot carry a tag (see above)

    def check(self, keys: Sequence[str]) -> list[bool]:
        return self.store.check(keys)

    def delete(self, key: str) -> None:
        self.store.delete(key)

    def close(self) -> None:
        self.store.close()

    def _diagnosis(self) -> str:
        return self.store._diagnosis()


class SignedStore(_Layer):
    """``store`` whose values carry a tag of the secret, checked on every ``get``."""

    checks_secret = True

    def __init__(self, store: Store, secret: Secret) -> None:
        super().__init__(store)
        self._secret = secret

    def set(self, key: str, value: bytes) -> None:
        raw = bytes(value)
        self.store.set(key, MARK + self._tag(key, raw) + raw)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        stored = self.store.get(key, timeout)
        if not stored.startswith(MARK):
            raise AuthenticationError(
                f"the store's value of {key!r} is not signed (authentication failed): someone "
                "who does not hold the secret wrote it (this store does not check who writes), "
                f"or a rank has no secret while this one has; {_HOW_TO_SET}"
            )
        tag, value = stored[len(MARK) :][:PROOF_BYTES], stored[len(MARK) + PROOF_BYTES :]
        if not hmac.compare_digest(tag, self._tag(key, value)):
            raise AuthenticationError(
                f"the store's value of {key!r} was not signed with this rank's secret "
                "(authentication failed): someone who does not hold it wrote it (this store "
                f"does not check who writes), or a rank has another secret; {_HOW_TO_SET}"
            )
        return value

    def _tag(self, key: str, value: bytes) -> bytes:
        return self._secret.tag(_CONTEXT, key.encode("utf-8"), value)


class PlainStore(_Layer):
    """``store`` read by a rank with no secret: a signed value means the others have one."""

    checks_secret = True

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        value = self.store.get(key, timeout)
        if value.startswith(MARK):
            raise AuthenticationError(
                f"the store's value of {key!r} is signed with a secret, but this rank has no "
                f"secret (authentication failed); {_HOW_TO_SET}"
            )
        return value


def signed(store: Store, secret: Secret | None) -> Store:
    """``store`` with its values signed by ``secret`` (``PlainStore`` when None), below any
    PrefixStore so that the tags cover the namespace; as it is if the store checks the
    secret itself (our TCP store)."""
    if store.checks_secret:
        return store
    if isinstance(store, PrefixStore):
        inner = signed(store.store, secret)
        return store if inner is store.store else PrefixStore(store.prefix, inner)
    return PlainStore(store) if secret is None else SignedStore(store, secret)
