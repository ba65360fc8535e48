"""The store: a small key-value store every rank of a job shares, and the checks on its use.

Theory of operation. Before any connection between ranks exists, each rank must learn where
the others listen; a :class:`Store` is where they leave that. Every implementation (the TCP
store rank 0 serves, the file store, torchrun's store behind c10d_store.py) offers the same
five calls with the same bounds: keys are str of at most MAX_KEY_BYTES in UTF-8, values bytes
of at most MAX_VALUE_BYTES, counters 64-bit signed. The argument checks below are shared by
every store, so a wrong call fails the same way (UsageError) whichever store is behind it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from types import TracebackType
from typing import TypeVar

from ..errors import UsageError

__all__ = ["MAX_KEY_BYTES", "MAX_VALUE_BYTES", "PrefixStore", "Store"]

MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 << 20

_S = TypeVar("_S", bound="Store")


class Store(abc.ABC):
    """A small key-value store shared by all ranks of a job. Keys are str, values bytes."""

    #: Whether this store lets nobody in who does not prove the job's secret, when there is
    #: one (our TCP store); the rendezvous signs the values of every other (signed.py).
    checks_secret = False

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (replacing any old value) and wake its waiters."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Wait until ``key`` exists and return its value; ``TimeoutError`` after ``timeout``."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (missing = 0); return the new value."""

    @abc.abstractmethod
    def check(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists, without waiting."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release this store's resources; idempotent."""

    def _diagnosis(self) -> str:
        """What the store saw that may explain a rank missing a rendezvous ("" if nothing)."""
        return ""

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class PrefixStore(Store):
    """``store`` with every key under ``prefix``: several rendezvous in one shared store."""

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix = prefix
        self.store = store
        self.host = getattr(store, "host", None)  # where the store serves, for routing

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self.prefix + key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.store.get(self.prefix + key, timeout)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self.prefix + key, amount)

    def check(self, keys: Sequence[str]) -> list[bool]:
        return self.store.check([self.prefix + key for key in keys])

    def delete(self, key: str) -> None:
        self.store.delete(self.prefix + key)

    def close(self) -> None:
        """The shared store stays open: its owner closes it."""

    def _diagnosis(self) -> str:
        return self.store._diagnosis()


# ---------------------------------------------------------------- argument checks


def _key_bytes(key: str) -> bytes:
    if not isinstance(key, str):
        raise UsageError(f"store keys are str, got {type(key).__name__}")
    raw = key.encode("utf-8")
    if len(raw) > MAX_KEY_BYTES:
        raise UsageError(f"store key is {len(raw)} bytes long; the limit is {MAX_KEY_BYTES}")
    return raw


def _value_bytes(value: bytes) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise UsageError(f"store values are bytes, got {type(value).__name__}")
    raw = bytes(value)
    if len(raw) > MAX_VALUE_BYTES:
        raise UsageError(f"store value is {len(raw)} bytes long; the limit is {MAX_VALUE_BYTES}")
    return raw


def _check_amount(amount: int) -> None:
    if not isinstance(amount, int) or isinstance(amount, bool):
        raise UsageError(f"add() takes an int amount, got {type(amount).__name__}")
    if not -(2**63) <= amount < 2**63:
        raise UsageError(f"add() amount {amount} does not fit in 64 signed bits")


def _check_timeout(timeout: float) -> None:
    if not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
        raise UsageError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")


def _check_port(port: int, *, allow_zero: bool) -> None:
    low = 0 if allow_zero else 1
    if not isinstance(port, int) or isinstance(port, bool) or not low <= port <= 65535:
        raise UsageError(f"port must be an int in {low}..65535, got {port!r}")


def _check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise UsageError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise UsageError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")


def _counter_plus(label: str, current: bytes, amount: int) -> int:
    """The counter stored as ``current`` (decimal ASCII) plus ``amount``."""
    try:
        return int(current) + amount
    except ValueError:
        raise UsageError(f"store key {label} holds {current[:40]!r}, not a counter") from None
