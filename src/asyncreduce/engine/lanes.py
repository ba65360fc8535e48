"""The engine thread's part in the same-host lane (lane/): moving the lane's operations that
nobody waits on, having the session watch them now and then (their records, stalls,
deadlines, silent peers, a broken communicator: ``Session.watch_outside``), failing what is
left at a close, and how long the thread may
sleep while the lane has work. A lane post wakes nobody, so the thread never sleeps longer
than ``LANE_DOZE`` while a lane exists, and ``LANE_NAP`` while it has work."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..lane import Lane, LaneOp
from ..protocol.failure import broken_by, closed_under
from ..protocol.session import Session

__all__ = ["LANE_NAP", "LaneMover"]

LANE_SPIN = 250e-6  # how long the thread polls the lane after it last moved, if nobody waits
LANE_NAP = 1e-3  # its longest sleep while the lane has work
LANE_DOZE = 10e-3  # and while it has none: a lane post does not wake the thread (a waiter,
# test() or a callback does, see Request), so an operation nobody looks at waits this long
LANE_WATCH = 5e-3  # how often the session watches the lane's operations


class LaneMover:
    """What the engine thread does for the lane (see the module docstring)."""

    def __init__(self, session: Session, apply: Callable[[], None]) -> None:
        """``apply``: carry out the commands the watch left in ``session``."""
        self._session, self._apply = session, apply
        self._watched = 0.0

    def move(self, lane: Lane) -> None:
        """Publish and complete what the lane can; now and then have the session watch it."""
        lane.progress()
        now = time.monotonic()
        session = self._session
        if now - self._watched >= LANE_WATCH or session.broken is not None:
            self._watched = now
            session.watch_outside(now, time.time())
            self._apply()

    def close(self, lane: Lane | None) -> None:
        """Fail the lane's pending operations as the session failed its own."""
        if lane is None:
            return
        broken = self._session.broken

        def error(op: LaneOp) -> BaseException:
            return closed_under(op) if broken is None else broken_by(op, broken)

        lane.close(error)

    @staticmethod
    def spins(lane: Lane | None, now: float) -> bool:
        """Whether the thread should keep polling: the lane moved lately and nobody waits."""
        return lane is not None and lane.busy and not lane.drivers and (
            now - lane.moved_at < LANE_SPIN
        )  # fmt: skip

    @staticmethod
    def nap(lane: Lane) -> float:
        """The longest the thread may sleep while ``lane`` exists."""
        return LANE_NAP if lane.busy else LANE_DOZE
