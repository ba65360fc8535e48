"""Liveness: heartbeats, the silence that means a peer is lost, per-operation deadlines, and the
peers that closed in good order. One implementation for both engines: the native Session
(session.py, controls.py) and the ordered engine (backends/ordered/), each with its own kind of
operation record, which needs only a ``deadline``.

Every beat (1/40 of the peer timeout, at most 1 s, at least 20 ms) this rank sends every open
peer a beat. A peer counts as silent only once it missed a beat past the timeout (no frame
of any kind for ``peer_timeout`` plus a beat), so a lost peer is named within about two beats
after the timeout. A peer that said GOODBYE is ``departed``: it is never silent and never sent
to, and new posts are refused, because an operation could never complete without it.

A beat later than three beats means this rank's own thread was away (a long call, no GIL):
``away`` says so, for that beat only and never for two in a row. What the peers sent meanwhile
may not be read yet, so the ordered engine waits one beat before judging silence then (its
failure.py); the native engine judges at once. Times are passed in (monotonic seconds);
nothing here reads a clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["Liveness", "Timed"]

_PRUNE_AFTER = 64  # deadlines kept before those of ended operations are looked for


class Timed(Protocol):
    """What liveness needs of an operation: when it fails with ``TimeoutError``."""

    @property
    def deadline(self) -> float: ...


Op = TypeVar("Op", bound=Timed)


class Liveness(Generic[Op]):
    """When each peer was last heard from, when to beat, and which deadline comes next."""

    def __init__(self, rank: int, world_size: int, peer_timeout: float, now: float) -> None:
        self.peer_timeout = peer_timeout
        self.beat_every = min(1.0, max(0.02, peer_timeout / 40))
        self.last_beat = now
        self.away = False  # this beat came after a long absence of this rank's own thread
        self.heard = {p: now for p in range(world_size) if p != rank}
        self.departed: dict[int, str] = {}  # peers that closed in good order: why, worded
        self._deadlines: list[tuple[float, int, Op]] = []
        self._order = itertools.count()

    def start(self, now: float) -> None:
        """Every peer counts as heard from ``now``, and beats are timed from it (for an engine
        whose thread starts well after it was made)."""
        for peer in self.heard:
            self.heard[peer] = now
        self.last_beat = now

    def open_peers(self) -> list[int]:
        """The peers still to be told things (not departed)."""
        return [p for p in self.heard if p not in self.departed]

    def beat_due(self, now: float) -> bool:
        """Whether a beat is due; if so, it counts as given now (and ``away`` is set)."""
        if now - self.last_beat < self.beat_every:
            return False
        self.away = now - self.last_beat > 3 * self.beat_every and not self.away
        self.last_beat = now
        return True

    def silent(self, now: float) -> set[int]:
        """The peers not heard from for longer than the timeout (a departed one is not silent)."""
        limit = self.peer_timeout + self.beat_every
        return {
            p for p, heard in self.heard.items()
            if now - heard > limit and p not in self.departed
        }  # fmt: skip

    def add_deadline(self, op: Op) -> None:
        heapq.heappush(self._deadlines, (op.deadline, next(self._order), op))

    def expired(self, now: float) -> list[Op]:
        """The operations whose deadline passed, soonest first (some may have ended already)."""
        due = []
        while self._deadlines and self._deadlines[0][0] <= now:
            due.append(heapq.heappop(self._deadlines)[2])
        return due

    def prune(self, live: int, is_live: Callable[[Op], bool]) -> None:
        """Forget the deadlines of ended operations once they outnumber the ``live`` ones, so a
        completed operation (and its buffer) is not kept until its deadline; that costs one
        pass over the entries for every as many pushes: constant time per operation."""
        if len(self._deadlines) > _PRUNE_AFTER and len(self._deadlines) > 2 * live:
            alive = [e for e in self._deadlines if is_live(e[2])]
            heapq.heapify(alive)
            self._deadlines = alive

    def timeout(self, now: float) -> float:
        """How long the engine may block before the next beat or deadline (at most 1 s)."""
        until_beat = self.last_beat + self.beat_every - now
        until_deadline = self._deadlines[0][0] - now if self._deadlines else 1.0
        return max(0.0, min(1.0, until_beat, until_deadline))
