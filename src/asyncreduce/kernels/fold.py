"""The two records a fold step is described by, shared by the algorithms that make them and
the transport that runs them (a direct run's swaps, transport/pairs.py): below both, so the
transport needs nothing of algorithms/."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Combining", "Swap"]


class Combining(NamedTuple):
    """How a message is combined into an algorithm's buffer (``reduction.combine``): into
    ``into``'s bytes, elements of dtype code ``dtype``, by reduction code ``op``."""

    into: memoryview
    dtype: int
    op: int


class Swap(NamedTuple):
    """One step of ``RunsDirectly.swaps``: the buffer goes to ``peer`` as message ``step``,
    the peer's comes back as the same, and is combined into it, the peer's operand first
    where ``incoming_first`` (the lower rank's first, on both)."""

    peer: int
    step: int
    incoming_first: bool
