"""The turns of the progress loop, on whichever thread holds it (ownership.py): the engine
thread's own loop and its closing handshake (``_run``), a waiting thread's turns while it drives
(``_drive``, MPI's progress in the call), a direct run's turn that leaves its partners' streams
to it (``turn_here``), and what every turn does: take what was submitted, move bytes (block, or
busy-poll around small operations), a unit of work, a tick, the lane.

A mixin of ``Engine`` (core.py), which holds the state declared in parts.py; kept apart so
that the front door (entry.py) and the loop each read in one place.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BrokenError, ClosedError
from ..kernels.reduction import quiet_numpy
from ..protocol.operation import Operation
from ..request import Request
from ..spin import SpinWindow
from ..transport.frame import MAX_ERROR_BYTES
from .lanes import LANE_NAP, LaneMover
from .parts import EngineParts, ShrinkCall

__all__ = ["Turns"]

log = logging.getLogger("asyncreduce.engine")

_LINGER = 2.0  # seconds close() waits for peers to acknowledge its goodbye
_ABORT_LINGER = 0.5  # the same for abort(), which must return within 2 s


class Turns(EngineParts):
    """The loop's turns (see the module docstring)."""

    if TYPE_CHECKING:  # shrinks.py's

        def _begin_shrink(self, call: ShrinkCall) -> None: ...
        def _fail_shrinks(self, error: BaseException) -> None: ...

    # ---- a waiting thread, holding the loop ----------------------------------------------

    def _drive(self, request: Request[Any], spin: float, timeout: float | None) -> None:
        """Turns of the loop that never block, yielding the core between them, until
        ``request`` is done, a close or a bug, or ``spin`` after the last small operation's
        event (``session.spin_until`` moves at each), at most ``timeout`` in all."""
        session = self.session
        window = SpinWindow(spin, timeout, time.monotonic())
        seen = session.spin_until
        while not (self._closing.is_set() or self.crash is not None):
            try:
                self._take_submitted(driving=True)
                self._look()
                self._turn_rest()
            except BaseException as exc:  # a bug: the engine thread fails everything
                self.crashed(exc)
                return
            if request.done():
                self.driven += 1
                return
            now = time.monotonic()
            if session.spin_until != seen:
                seen = session.spin_until
                window.moved(now)
            if window.over(now):
                return
            os.sched_yield()

    def turn_here(self, sources: Collection[int]) -> bool:
        """A turn of the loop that never blocks, on a direct run's thread, that leaves the
        streams the run reads to it (``sources``: a look there would take what a faster
        partner sent for it, and the run would then go through the session; the run reads
        them with ``take_frame``, which hands anything else to the reader); False after a bug
        (``crash``: the engine thread fails everything)."""
        try:
            quiet_numpy(self._look_and_tick, sources)
        except BaseException as exc:
            self.crashed(exc)
            return False
        return True

    def crashed(self, exc: BaseException) -> None:
        """A bug in a turn on a waiting thread: the engine thread fails everything; a
        KeyboardInterrupt or the like goes on up."""
        self.crash = exc
        if not isinstance(exc, Exception):
            raise exc

    def _look_and_tick(self, sources: Collection[int]) -> None:
        self._look(sources)
        self._turn_rest()

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        np.seterr(all="ignore")  # this thread only: overflow is the caller's data, not our warning
        session = self.session
        try:
            while self._turn_owned():
                if self._loop.drivers:
                    self._loop.stand_aside()
            with self._loop.owner:
                self._say_goodbye(_ABORT_LINGER if self._aborting is not None else _LINGER)
        except BaseException as exc:  # a bug: fail loudly, never hang the callers
            self.crash = self.crash or exc  # (first: drivers stop)
            self._sink.applying = False  # (it may have been cut short)
            log.exception("asyncreduce progress thread crashed")
            with self._loop.owner:
                with self._lock:  # a submit that checked before this sees it, or is taken below
                    session.fail_all(
                        BrokenError(f"rank {self.rank}: progress thread crashed: {exc!r}")
                    )
                self._apply(each_alone=True)
                self._lanes.close(self.lane)
                self._take_submitted()  # fails what was submitted meanwhile (it is broken)
            self._closing.wait()  # new posts fail at once; wait for close()
            with self._loop.owner:
                self._take_submitted()
        finally:
            self.transport.close()

    def _turn_owned(self) -> bool:
        """One turn of the loop, holding it; False once close() was asked for."""
        with self._loop.owner:
            if self.crash is not None:  # a driver's bug: fail as for one of this thread
                crash = self.crash
                raise RuntimeError(f"a waiting thread's turn of the loop: {crash!r}") from crash
            if not self._take_submitted():
                return False
            self._poll()
            self._turn_rest()
        return True

    def _turn_rest(self) -> None:
        """The turn after taking posts and moving bytes: a unit of work, a tick, the lane."""
        session = self.session
        if session.working:
            session.work(time.monotonic())
            self._apply()
        session.tick(time.monotonic())
        self._apply()
        if self.lane is not None and self.lane.busy:
            self._lanes.move(self.lane)

    def _say_goodbye(self, linger: float) -> None:
        """Closing handshake: GOODBYE to all, then read until every peer has closed too."""
        self.session.stopping = True
        self.transport.send_goodbye(self.session.goodbye_reason.encode()[:MAX_ERROR_BYTES])
        deadline = time.monotonic() + linger
        while self.transport.open_peers() and time.monotonic() < deadline:
            self.transport.poll(max(0.0, deadline - time.monotonic()))

    def _take_submitted(self, driving: bool = False) -> bool:
        """Start what was submitted; False once close() was asked for (``driving``: a waiter
        holds the loop, and leaves a close to this thread)."""
        while self._submitted:  # read without the lock: only the loop's holder takes from it
            with self._lock:
                if driving and self._closing.is_set():
                    return False  # (set before the close's None is queued, under this lock)
                op = self._submitted.popleft()
            if op is None:
                with self._lock:
                    late = list(self._submitted)
                    self._submitted.clear()
                self.session.close(self._aborting, [o for o in late if isinstance(o, Operation)])
                self._lanes.close(self.lane)
                self._apply()
                self._fail_shrinks(ClosedError("shrink: the communicator is closed"))
                return False
            if isinstance(op, ShrinkCall):
                self._begin_shrink(op)
                continue
            self.session.post(op, time.monotonic())
            self._apply()
        return True

    def _poll(self) -> None:
        """Move bytes. For ``settings.spin`` after a small operation started, received a
        frame or ended, busy-poll (yielding the core to any thread that wants it): a thread
        woken by the kernel for every frame and every post adds tens of microseconds to an
        operation that lasts about as long, and small operations tend to come in runs.
        Otherwise block until the next beat or deadline, or until ``submit`` wakes us.

        No lost wake-up: ``_sleeping`` is set, and the queue looked at once more, under the
        lock that ``submit`` holds to append and then read ``_sleeping``."""
        if self.session.working:  # work waits: only look at what came in
            self._look()
            return
        now = time.monotonic()
        lane = self.lane
        if now < self.session.spin_until or LaneMover.spins(lane, now):
            self._look()
            os.sched_yield()
            return
        with self._lock:
            self._sleeping = True  # (a driver reads it after it counted itself: see drive)
            timeout = self.session.liveness.timeout(now) if not self._submitted else 0.0
            if self._loop.drivers:
                timeout = 0.0  # a waiter asks for the loop
            if lane is not None:  # read under the lock: see ``nudge``
                timeout = min(timeout, LaneMover.nap(lane))
            self._dozing = timeout > LANE_NAP
        self.transport.poll(timeout)
        self.looked = time.monotonic()
        self._sleeping = self._dozing = False

    def _look(self, unread: Collection[int] = ()) -> None:
        """Read what came in on every connection (but ``unread``'s), without waiting."""
        self.transport.poll(0.0, unread)
        self.looked = time.monotonic()
