"""Liveness: heartbeats, the silence that means a peer is lost, per-operation deadlines, and the
peers that closed in good order.

Every beat (1/40 of the peer timeout, at most 1 s, at least 20 ms) this rank sends every open
peer a ``Beat``. A peer counts as silent only once it missed a beat past the timeout (no frame
of any kind for ``peer_timeout`` plus a beat), so a lost peer is named within about two beats
after the timeout. A peer that said GOODBYE is ``departed``: it is never silent and never sent
to, and new posts are refused, because an operation could never complete without it. Times are
passed in (monotonic seconds); nothing here reads a clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from .operation import Operation

__all__ = ["Liveness"]


class Liveness:
    """When each peer was last heard from, when to beat, and which deadline comes next."""

    def __init__(self, rank: int, world_size: int, peer_timeout: float, now: float) -> None:
        self.peer_timeout = peer_timeout
        self.beat_every = min(1.0, max(0.02, peer_timeout / 40))
        self.last_beat = now
        self.heard = {p: now for p in range(world_size) if p != rank}
        self.departed: dict[int, str] = {}  # peers that closed in good order: why, worded
        self._deadlines: list[tuple[float, int, Operation]] = []
        self._order = itertools.count()

    def open_peers(self) -> list[int]:
        """The peers still to be told things (not departed)."""
        return [p for p in self.heard if p not in self.departed]

    def beat_due(self, now: float) -> bool:
        """Whether a beat is due; if so, it counts as given now."""
        if now - self.last_beat < self.beat_every:
            return False
        self.last_beat = now
        return True

    def silent(self, now: float) -> set[int]:
        """The peers not heard from for longer than the timeout (a departed one is not silent)."""
        limit = self.peer_timeout + self.beat_every
        return {
            p for p, heard in self.heard.items()
            if now - heard > limit and p not in self.departed
        }  # fmt: skip

    def add_deadline(self, op: Operation) -> None:
        heapq.heappush(self._deadlines, (op.deadline, next(self._order), op))

    def expired(self, now: float) -> list[Operation]:
        """The operations whose deadline passed (some may have ended already)."""
        due = []
        while self._deadlines and self._deadlines[0][0] <= now:
            due.append(heapq.heappop(self._deadlines)[2])
        return due

    def prune(self, live: int, is_live: Callable[[Operation], bool]) -> None:
        """Forget the deadlines of ended operations once they outnumber the live ones, so a
        completed operation is not kept alive until its deadline."""
        if len(self._deadlines) > 64 and len(self._deadlines) > 2 * live:
            alive = [e for e in self._deadlines if is_live(e[2])]
            heapq.heapify(alive)
            self._deadlines = alive

    def timeout(self, now: float) -> float:
        """How long the engine may block before the next beat or deadline (at most 1 s)."""
        until_beat = self.last_beat + self.beat_every - now
        until_deadline = self._deadlines[0][0] - now if self._deadlines else 1.0
        return max(0.0, min(1.0, until_beat, until_deadline))
