"""Dissemination barrier (a butterfly where the ranks are a power of two).

Theory of operation: in round i (i = 0 .. ceil(log2 n)-1) rank r sends an empty message to
r + 2^i and waits for one from r - 2^i (mod n). Round i+1 is sent only once round i's message
arrived, so after the last round every rank has heard, directly or not, from every other one.
ceil(log2 n) rounds of empty messages; a message of a later round that comes early waits.

Where n is a power of two, round i's partner is r xor 2^i both ways instead (after round i,
r has heard from its whole block of 2^(i+1) ranks): the same rounds and messages, and each
round a swap with one partner, which a direct run makes in one call (``swaps``).
"""

from __future__ import annotations

import functools

import numpy as np

from ..kernels.fold import Combining, Swap
from .base import Array, Collective, ProtocolError, Send

__all__ = ["Barrier"]

_EMPTY = np.empty(0, dtype=np.uint8)


class Barrier(Collective):
    """Complete only once every rank has entered the barrier. A caller may run it message by
    message itself (``RunsDirectly``: ``Engine.run_direct``)."""

    message_bytes = 0

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._rounds = self._expected = (world_size - 1).bit_length()
        self._arrived: set[int] = set()
        self._next = 0  # the round whose message this rank waits for
        self.sources, self.partners, swaps = _partners(rank, world_size)  # (a power of two
        # ranks: the butterfly, r xor 2^i)
        if swaps:  # (RunsDirectly: every round a swap)
            self.swaps = swaps

    @property
    def awaited(self) -> tuple[int, int] | None:
        """(the rank, the round) of the message this rank needs next; None once done."""
        if self._received == self._expected:
            return None
        return self._source(self._next), self._next

    def _source(self, step: int) -> int:
        return _source(self.rank, self.world_size, step)

    def _target(self, step: int) -> int:
        return _target(self.rank, self.world_size, step)

    @property
    def combining(self) -> Combining | None:
        """(``RunsDirectly``) Nothing to combine: a barrier's messages are empty."""
        return None

    def swapped(self, done: int) -> list[Send]:
        """(``RunsDirectly``) The caller ran the first ``done`` of ``swaps`` (their messages
        arrived) and the next one's message left: go on from there."""
        if self.swaps is None or not 0 <= done <= self._rounds or self._received:
            raise ProtocolError(f"barrier: {done} swaps cannot have run here")
        self._arrived.update(range(done))
        self._received = self._next = done
        return []

    @property
    def pending_sources(self) -> set[int]:
        return {self._source(s) for s in range(self._rounds) if s not in self._arrived}

    def _send(self, step: int) -> list[Send]:
        if step >= self._rounds:
            return []
        return [Send(self._target(step), step, 0, _EMPTY)]

    def start(self) -> list[Send]:
        return self._send(0)

    def recv_buffer(self, src: int, step: int, seg: int, nbytes: int) -> Array:
        valid = 0 <= step < self._rounds and src == self._source(step) and seg == 0
        if not valid or step in self._arrived:
            raise ProtocolError(f"barrier: unexpected round {step} from rank {src}")
        return self._check_size("barrier", _EMPTY, nbytes)

    def on_message(self, src: int, step: int, seg: int, payload: Array) -> list[Send]:
        self._arrived.add(step)
        self._received += 1
        sends: list[Send] = []
        while self._next in self._arrived:
            self._next += 1
            sends += self._send(self._next)
        return sends


def _butterfly(world_size: int) -> bool:
    """A power of two ranks: round i's partner is r xor 2^i both ways."""
    return world_size & (world_size - 1) == 0


def _source(rank: int, world_size: int, step: int) -> int:
    """Whom ``rank`` hears from in round ``step``."""
    if _butterfly(world_size):
        return rank ^ (1 << step)
    return (rank - (1 << step)) % world_size


def _target(rank: int, world_size: int, step: int) -> int:
    """Whom ``rank`` tells in round ``step``."""
    if _butterfly(world_size):
        return rank ^ (1 << step)
    return (rank + (1 << step)) % world_size


@functools.cache
def _partners(
    rank: int, world_size: int
) -> tuple[frozenset[int], frozenset[int], tuple[Swap, ...]]:
    """A rank's sources, partners and swaps (none where the ranks are not a power of two):
    the same for every barrier of a communicator, so worked out once (read-only)."""
    rounds = range((world_size - 1).bit_length())
    sources = frozenset(_source(rank, world_size, s) for s in rounds)
    partners = sources | {_target(rank, world_size, s) for s in rounds}
    swaps = (
        ()
        if not _butterfly(world_size)
        else tuple(Swap(_target(rank, world_size, s), s, False) for s in rounds)
    )
    return sources, partners, swaps
