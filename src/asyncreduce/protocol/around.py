"""The Session's side door: what it says to an operation that runs around it, on the caller's
thread (``Engine.run_direct``: its frames straight through the sockets), and how such an
operation is recorded once it ran; and how it watches the operations of an executor outside
the engine (the same-host lane: ``outside``), by protocol/outside.py's rules, as it watches its
own: recorded, asked about once stalled, failed where a rule says so. The lane asks
``refusal`` too.

A mixin of ``Session`` (session.py), which holds the state named below; kept apart so that
the rules for running around the protocol are read in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..errors import BrokenError, MismatchError
from ..flight import Record, settle
from ..transport.frame import Descriptor
from .failure import same_error
from .outside import Watched, judge
from .parts import SessionParts
from .wire import PENDING, Key

__all__ = ["SideDoor"]


class SideDoor(SessionParts):
    """The queries and records of operations that run around the Session (see above)."""

    if TYPE_CHECKING:  # the Session's (session.py) and its control traffic's (controls.py)

        def fail_all(
            self, error: BaseException, about: tuple[Key, Descriptor] | None = None
        ) -> None: ...
        def _ask_about(self, op: Watched, now: float) -> None: ...

    def refusal(
        self, label: str, goodbyes: bool = True, key: Key | None = None
    ) -> BaseException | None:
        """Why a new post must fail at once, if it must (any thread may ask): the session is
        broken (a mismatch of its ``key`` that a peer reported reaches a rank that posts it
        late as the same MismatchError; any other failure as BrokenError chained to what broke
        it: a TimeoutError means only that one's own wait ran out), or (``goodbyes``) a rank
        said goodbye. The engine and the lane ask without
        ``goodbyes``: an engine operation posted after a goodbye is judged by ``post``, on the
        frames the departed rank sent first; a lane operation by the departed rank's slot."""
        if self.broken is not None:
            earlier = None if key is None else self.matching.failed.get(key)
            if isinstance(earlier, MismatchError):
                return same_error(earlier, str(earlier))
            error = BrokenError(f"{label}: the communicator is broken: {self.broken}")
            error.__cause__ = self.broken
            return error
        gone = list(self.liveness.departed.values()) if goodbyes else []  # one call: safe
        return BrokenError(f"{label}: {gone[0]}") if gone else None

    def quiet(self, key: Key, now: float) -> bool:
        """Whether operation ``key`` may run around the session, on the caller's thread, its
        frames straight through the sockets (``Engine.run_direct``): nothing is in flight here, no
        frame waits for an operation, no rank holds back or is held back, none said goodbye,
        nothing is broken, and no beat is due (a turn of the loop sends it)."""
        matching, liveness, flow = self.matching, self.liveness, self.flow
        return not (
            matching.ops or matching.unexpected or self.working or self._landing
            or self.commands or self.broken is not None or self.stopping or liveness.departed
            or flow.told or flow.holding_back or key in matching.failed
            or now - liveness.last_beat >= liveness.beat_every
        )  # fmt: skip

    def heard_from(self, peers: Iterable[int], now: float) -> None:
        """A frame of each of ``peers`` was taken around the session (``Engine.run_direct``): they
        are alive, as if it had come through ``on_view``."""
        heard = self.liveness.heard
        for peer in peers:
            heard[peer] = now

    def ran(
        self, key: Key, label: str, desc: Descriptor, priority: int, posted: float, now: float
    ) -> None:
        """Operation ``key`` ran around the session to the end (``Engine.run_direct``), posted at
        ``posted``: it is remembered as done, so a frame that still came for it would be
        judged as for any other operation that ended, and so does the flight recorder."""
        self.matching.remember_done(key, desc)
        settle(self.flight, self.rank, label, key, desc, priority, posted, now)

    def watch_outside(self, now: float, wall: float) -> None:
        """Watch the outside executor's pending operations (``outside``, if any) at ``now``
        (monotonic; ``wall``: the same moment by the wall clock, for their flight records):
        each goes into the flight record, is asked about once stalled as an operation of the
        session is (``stall.py``), and ends by outside.py's rules, failing the communicator
        where the peers must hear of it."""
        outside = self.outside
        if outside is None:
            return
        self._now = now
        silent = self.liveness.silent(now)

        def decide(op: Watched, missing: Callable[[], set[int]]) -> BaseException | None:
            if op.record is None:
                op.record = self.flight.add(Record(*op.key, op.desc, 0, wall - (now - op.started)))
            if self.stall.due(op.key, op.started, now):
                self._ask_about(op, now)
            verdict = judge(op, self.rank, now, broken=self.broken,
                            earlier=self.matching.failed.get(op.key),
                            departed=self.liveness.departed, missing=missing, silent=silent,
                            peer_timeout=self.settings.peer_timeout)  # fmt: skip
            if verdict is None:
                return None
            if verdict.everywhere:
                self.fail_all(verdict.error, (op.key, op.desc))
            return verdict.error

        outside.judge_each(decide)

    def answer(self, key: Key) -> int:
        """What this rank knows of operation ``key``, for a peer's stall question (wire.py's
        answers): pending in the engine or outside it, done, failed, or never posted."""
        outside = self.outside
        if outside is not None and outside.holds(key):
            return PENDING
        return self.matching.answer(key)

    @property
    def goodbye_reason(self) -> str:
        return f"it was broken: {self.broken}" if self.broken is not None else ""
