"""The progress engine: the one thread that owns the wire, and feeds the protocol.

Theory of operation. User threads build an ``Operation`` (its key, descriptor and algorithm
state machine) and ``submit`` it: a deque append, plus a one-byte wake-up if the thread
sleeps. Only the engine thread touches the transport and the protocol's state, so neither needs
a lock. The protocol itself is sans-IO (protocol/session.py): this thread hands it every event
with the time (a post, a frame, a frame sent, a lost peer, a tick, a unit of work) and then
applies the commands it returned (protocol/commands.py), once the event's call has returned.
The loop: take submitted operations, let the transport move bytes (it calls back the
``FrameSink``: sink.py), do one unit of the most urgent operation's own work, tick
(deadlines, heartbeats, stall questions). Closing is a handshake: GOODBYE to every peer, then
read until each has closed too. Completing a request wakes its waiters; done-callbacks run
elsewhere (see request.py).

Progress in the call. A thread that waits on a small operation runs that same loop itself for a
while (``drive``, MPI's progress-in-the-call): it asks for the loop, this thread stands aside
between two turns (or is woken from its sleep to), and the waiter moves bytes until its
operation completes, or nothing happened for ``DRIVE_SPIN``. The completion then wakes nobody:
the waiter is the thread that finishes it. Whoever runs the loop holds its lock (ownership.py),
so the transport and the protocol still have one thread at a time, and need no lock of their
own. Only this thread closes: a driver stops at a close, and a bug in a driver's turn is raised
on this thread, which fails every request as for its own.

A blocking small allreduce or barrier goes further (``run_direct``): holding the loop while the
engine is quiet (nothing in flight or kept, no beat due, every connection read within
``DIRECT_LOOK`` (direct.py)), its caller runs the algorithm (recursive doubling, the barrier:
``RunsDirectly``) over the partners' connections itself, taking only the frames whose headers
are exactly the expected ones; anything else hands it to the session where it stands, and the
loop goes on from there as for any operation. Over a power of two ranks every step is a swap
with one partner, and the transport makes them all in one call (in C: send, look, combine, step
after step), the algorithm told only at the end how many ran (``RunsDirectly.swaps``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .. import forks
from ..algorithms import RunsDirectly
from ..flight import FlightRecorder
from ..kernels.reduction import quiet_numpy
from ..lane import Lane
from ..protocol.operation import Operation, Settings
from ..protocol.session import Session
from ..protocol.wire import Key, describe
from ..request import Request
from ..transport.base import FrameSink, Transport
from ..transport.frame import Descriptor
from .direct import DRIVE_SPIN, DirectRun
from .entry import Entry
from .lanes import LaneMover
from .ownership import Ownership
from .parts import ShrinkCall
from .shrinks import Shrinks
from .sink import Sink
from .turns import Turns

__all__ = ["THREAD_PREFIX", "Engine"]

log = logging.getLogger("asyncreduce.engine")

THREAD_PREFIX = "asyncreduce-engine-"  # + the rank: the progress thread's name


class Engine(Entry, Turns, Shrinks):
    """Drives every operation of one communicator on its own thread (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        make_transport: Callable[[FrameSink], Transport],
        settings: Settings | None = None,
    ) -> None:
        """See ``Settings`` for what can be tuned."""
        self.settings = settings = settings or Settings()
        self.rank = rank
        self.world_size = world_size
        self._lock = threading.Lock()
        self._submitted: deque[Operation | ShrinkCall | None] = deque()
        self._shrinks: list[ShrinkCall] = []
        self._decided: dict[int, frozenset[int] | None] = {}
        self._aborting: str | None = None  # abort(reason) was asked for
        self._closing = threading.Event()  # close() or abort() was called
        self._sleeping = False  # the thread blocks in poll(): a submit must wake it
        self._dozing = False  # and for longer than the lane's nap: a lane post must (nudge)
        self.crash: BaseException | None = None  # a bug in the loop: nobody drives it since
        self._generation = forks.generation()  # a forked child must not run the loop
        self.driven = 0  # operations a waiter completed driving the loop (diagnostics, tests)
        self.looked = 0.0  # when the loop last read every connection (a direct run's look
        # leaves out the streams the run reads: see direct.DIRECT_LOOK)
        self.flight = FlightRecorder(rank, world_size, settings.flight_records, describe)
        self.session = Session(rank, world_size, settings, self.flight, time.monotonic())
        self._loop = Ownership(self._closing, self._asleep, lambda: self.transport.wakeup(),
                               self._has_work)  # fmt: skip
        self._sink = Sink(rank, self.session, settings, self.flight, self._closing, self._loop)
        self._apply = self._sink.apply
        self._sink.agreed = self._agreed
        self.transport = self._sink.transport = make_transport(self._sink)
        self._direct = DirectRun(self, self._loop, self._submitted, settings)
        self._lanes = LaneMover(self.session, self._apply)
        self.lane: Lane | None = (
            None  # the same-host lane, once the communicator opened it (``take_lane``)
        )
        self._thread = threading.Thread(
            target=self._run, name=f"{THREAD_PREFIX}{rank}", daemon=True
        )
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------------

    def take_lane(self, lane: Lane) -> None:
        """Move ``lane``'s operations nobody waits on from now on, and hand it the named keys
        a peer runs here on the engine (``Lane.claim``); the session watches its operations
        (``Session.watch_outside``) and answers for them."""
        self.session.outside = lane
        self.lane = lane
        self._sink.claim = lane.claim

    def drive(self, request: Request[Any], timeout: float | None) -> None:
        """Run the loop on the waiting thread until ``request`` is done, for as long as
        something happens (``DRIVE_SPIN``, at most ``timeout``): ask for the loop, wake this
        thread if it sleeps (it stands aside after its turn), and take it. A waiter that
        cannot have it soon (another drives, a long unit of work) waits as before."""
        if not self.usable():
            return
        self._loop.refuse_reentry(request.label)
        spin = DRIVE_SPIN if timeout is None else min(DRIVE_SPIN, timeout)
        try:
            if self._loop.ask(request, time.monotonic() + spin):
                quiet_numpy(self._drive, request, spin, timeout)
        finally:
            self._loop.give_back()

    def run_direct(
        self, key: Key, label: str, desc: Descriptor, algo: RunsDirectly, priority: int,
        timeout: float | None, adopt: Callable[[], Operation],
    ) -> Request[Any] | None:  # fmt: skip
        """``DirectRun.run`` (direct.py): None once it ran to the end on this thread, else the
        request of the ordinary operation ``adopt()`` made of it."""
        return self._direct.run(key, label, desc, algo, priority, timeout, adopt)

    def take_over(self, op: Operation) -> Request[Any]:
        """A direct run the loop takes over where it stands (what it sent stays sent: snapshots
        of the buffer); its deadline counts from here, at most ``DRIVE_SPIN`` after its post."""
        op.posted_at = time.time()
        op.request.mover = self
        self.session.post(op, time.monotonic(), started=True)
        self._apply()
        return op.request

    def _has_work(self) -> bool:
        """Whether the loop has anything to move but what arrives unasked (heartbeats, a
        peer's early frames), which can wait for this thread's grace (``ownership.ASIDE_GRACE``)."""
        session, lane = self.session, self.lane
        return bool(
            self._submitted or session.matching.ops or session.working
            or (lane is not None and lane.busy) or self._closing.is_set()
        )  # fmt: skip

    def usable(self) -> bool:
        """Neither closing, nor crashed, nor a forked child's copy (a direct run's check)."""
        return not (self._closing.is_set() or self.crash is not None or self._forked())

    def _forked(self) -> bool:
        return forks.generation() != self._generation

    @property
    def direct(self) -> int:
        """Operations run to the end on their caller's thread (``run_direct``)."""
        return self._direct.count

    @property
    def broken(self) -> BaseException | None:
        return self.session.broken

    @property
    def stall_reports(self) -> list[str]:
        """The stall warnings this rank gave, newest last."""
        return list(self.session.stall.reports)

    @property
    def held_peak(self) -> int:
        """The most bytes of early frames ever held at once (tests and diagnostics)."""
        return self.session.flow.peak
