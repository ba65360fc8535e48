"""What every step of a rendezvous shares: the time left, and a gather that stops at once
when a rank found the job inconsistent (it sets ``ABORT``, naming why)."""

from __future__ import annotations

import time

from ..rendezvous import Store
from ..rendezvous import gather as gather_all

__all__ = ["ABORT", "gather", "remaining"]

ABORT = "abort"  # the key a rank sets when it finds the job inconsistent


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (monotonic), never quite zero: a timeout to pass on."""
    return max(0.001, deadline - time.monotonic())


def gather(
    store: Store, what: str, rank: int, world_size: int, value: bytes, timeout: float
) -> list[bytes]:
    """``rendezvous.gather`` that gives up at once, with its reason, when a rank set ``ABORT``."""
    return gather_all(store, what, rank, world_size, value, timeout, abort=ABORT)
