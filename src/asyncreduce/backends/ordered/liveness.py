"""Liveness in the ordered engine: heartbeats, silent peers, per-operation deadlines, stalls.

Theory of operation. Every ``beat_every`` seconds (1/40 of ASYNCREDUCE_PEER_TIMEOUT, between
20 ms and 1 s) the engine sends every peer a BEAT on the control channel; any message counts
as hearing from its sender. While something is pending here, a peer not heard from for the
timeout plus one beat is silent (dead, or stopped): what waits fails with BrokenError, and
the communicator breaks. An operation posted with a ``timeout`` fails everywhere once its
deadline passes. One still not agreed after ASYNCREDUCE_STALL_WARNING seconds gives a
warning (once per that many seconds), naming the ranks that have not posted it; the last 100
are kept in ``stall_reports``. This module keeps the clocks and says what is due; the engine
acts on it (engine.py), and its failure path ends what must end (failure.py).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Collection

from ...errors import ranks_phrase
from ...keys import Key
from .posted import Posted

__all__ = ["Liveness"]

log = logging.getLogger("asyncreduce.ordered")
_REPORTS = 100  # stall warnings kept


class Liveness:
    """The clocks of one ordered engine (module docstring); only its thread calls these."""

    def __init__(self, rank: int, peer_timeout: float, stall_warning: float) -> None:
        self.rank = rank
        self.peer_timeout = peer_timeout
        self.beat_every = min(1.0, max(0.02, peer_timeout / 40))
        self.heard: dict[int, float] = {}  # every peer: when it was last heard from
        self.stall_reports: list[str] = []
        self._last_beat = 0.0
        self._away = False  # this beat comes after a long absence of this rank's own thread
        self._deadlines: list[tuple[float, int, Posted]] = []
        self._order = itertools.count()
        self._stall_warning = stall_warning
        self._warned: dict[Key, float] = {}

    def start(self, world_size: int, now: float) -> None:
        """Every peer counts as heard from ``now``."""
        self.heard = {p: now for p in range(world_size) if p != self.rank}
        self._last_beat = now

    def watch(self, op: Posted, pending: int) -> None:
        """Keep ``op``'s deadline, if it has a timeout (``pending``: how many operations are
        pending here besides it). The deadlines of operations that ended are forgotten once
        they outnumber the pending ones, as in the native engine (protocol/liveness.py), so an
        ended operation and its buffer do not live until its deadline; that costs one pass
        over the entries for every as many pushes: constant time per operation."""
        if op.timeout is None:
            return
        heapq.heappush(self._deadlines, (op.started + op.timeout, next(self._order), op))
        if len(self._deadlines) > 64 and len(self._deadlines) > 2 * (pending + 1):
            self._deadlines = [e for e in self._deadlines if not e[2].request.done()]
            heapq.heapify(self._deadlines)

    def next_expired(self, now: float) -> Posted | None:
        """An operation whose deadline passed by ``now`` (pending or not), or None."""
        if self._deadlines and self._deadlines[0][0] <= now:
            return heapq.heappop(self._deadlines)[2]
        return None

    def until_due(self, now: float) -> float:
        """Seconds from ``now`` until the next beat or deadline (what may sleep that long)."""
        until = self._last_beat + self.beat_every - now
        if self._deadlines:
            until = min(until, self._deadlines[0][0] - now)
        return max(0.0, until)

    def beat_due(self, now: float) -> bool:
        """Whether it is time for the next BEAT (and the checks that go with it)."""
        if now - self._last_beat < self.beat_every:
            return False
        # Beats are due every beat_every, and the thread looks at least that often. A beat
        # later than three means the thread itself was away (a long call, no GIL): what the
        # peers sent meanwhile may not be read yet, so ``silence`` waits for the next beat
        # (never two in a row, so a thread that is always late still names a silent peer).
        self._away = now - self._last_beat > 3 * self.beat_every and not self._away
        self._last_beat = now
        return True

    def silence(self, now: float, departed: Collection[int]) -> str | None:
        """Why the peers not heard from for too long (and still here) are silent, or None
        (None as well right after this rank's own absence: see ``beat_due``)."""
        if self._away:
            return None
        silent = [
            p
            for p, t in self.heard.items()
            if p not in departed and now - t > self.peer_timeout + self.beat_every
        ]
        if not silent:
            return None
        return (
            f"rank {self.rank} heard nothing from {ranks_phrase(silent)} for "
            f"{self.peer_timeout} s (ASYNCREDUCE_PEER_TIMEOUT): dead or stopped?"
        )

    def inspect_stalls(
        self, now: float, posted: dict[Key, Posted], waiting_for: Callable[[Posted], str]
    ) -> None:
        """Warn of the ``posted`` operations pending for too long (``waiting_for``: why)."""
        after = self._stall_warning
        if after <= 0:
            return
        for key, op in posted.items():
            due = now - op.started >= after and now - self._warned.get(key, -1e18) >= after
            if due and not op.request.done():
                self._warned[key] = now
                message = (f"stall: {op.label} posted on rank {self.rank} "
                           f"{now - op.started:.0f} s ago; {waiting_for(op)}")  # fmt: skip
                self.stall_reports.append(message)
                del self.stall_reports[:-_REPORTS]
                log.warning("%s", message)

    def agreed(self, key: Key) -> None:
        """``key`` was agreed: it stalls no more."""
        self._warned.pop(key, None)
