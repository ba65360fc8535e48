"""Who runs the loop: the engine thread, or a thread that waits on an operation and asked for
it (a driver), never two at once.

Safety argument. The transport and the Session have no lock of their own: whoever runs a turn
holds ``owner``, so they always have one thread at a time. The engine thread holds it for each
turn and, between turns, stands aside while any driver wants it (``stand_aside``); a driver
counts itself in ``drivers`` first (a set: an add or discard cannot be cut in half by an
interrupt), then wakes the engine thread if it sleeps in poll (it then stands aside after
that turn), then takes ``owner`` with a non-blocking acquire, yielding the core between tries,
until its deadline or its request completed (``ask``). ``give_back`` releases ``owner`` (also
after an interrupt: the RLock says whether this thread still holds it) and, where the last
driver leaves with work left, notifies the engine thread; with nothing left to move it stays
aside for a grace after a direct run (``ASIDE_GRACE``), so a thread that runs small operations
back to back finds it aside at its next one instead of waking it from poll each time. Every
wait here ends at a close.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import UsageError
from ..request import Request

__all__ = ["ASIDE_GRACE", "Ownership"]

ASIDE_GRACE = 10e-3  # how long the engine thread stays aside after a direct run gave the loop
# back with nothing left to move


class Ownership:
    """The loop's lock and who waits for it (see the module docstring)."""

    def __init__(
        self, closing: threading.Event, asleep: Callable[[], bool], wakeup: Callable[[], None],
        has_work: Callable[[], bool], clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        """``closing``: close() was asked for; ``asleep``: whether the engine thread blocks in
        poll (read under the lock a submit holds); ``wakeup``: wake it from there;
        ``has_work``: whether the loop has anything to move but what arrives unasked;
        ``clock``: monotonic seconds (a test's own clock, to hold the grace still)."""
        self._closing, self._asleep = closing, asleep
        self._wakeup, self._has_work, self._clock = wakeup, has_work, clock
        self.owner = threading.RLock()  # held by whoever runs the loop (an RLock to know,
        # after an interrupt, whether this thread still holds it)
        self.holder = 0  # the thread ident of the driver that holds it, or 0
        self.driving = False  # a driver holds it (its completions wake nobody)
        self.drivers: set[int] = set()  # the threads that want the loop or have it
        self.turn = threading.Condition(threading.Lock())  # where the engine thread stands aside
        self.aside = False  # it does (a submit then wakes it where no driver holds the loop)
        self.ran_at = -math.inf  # when a direct run last gave the loop back

    def holds(self) -> bool:
        """Whether this thread is the driver that holds the loop (a signal handler that
        interrupted its turn, if it asks)."""
        return self.holder == threading.get_ident()

    def refuse_reentry(self, label: str) -> None:
        """UsageError if this thread holds the loop: code that interrupted its turn (a signal
        handler) waits on an operation, which only the interrupted turn could move."""
        if self.holds():
            raise UsageError(
                f"{label}: waited on from code that interrupted this thread while it "
                "moved the communicator (a signal handler?): wait elsewhere, or set a flag there"
            )

    def ask(self, request: Request[Any] | None, end: float) -> bool:
        """Count this thread among the drivers, wake the engine thread if it sleeps, and take
        the loop; False if that did not happen by ``end`` or ``request`` completed first.
        ``give_back`` after, in any case."""
        me = threading.get_ident()
        self.drivers.add(me)
        if self._asleep():
            self._wakeup()
        if not self._take(request, end):
            return False
        self.holder, self.driving = me, True
        return True

    def _take(self, request: Request[Any] | None, end: float) -> bool:
        owner = self.owner
        while not owner.acquire(blocking=False):
            done = request is not None and request.done()
            if done or self._closing.is_set() or self._clock() >= end:
                return False
            os.sched_yield()  # (the engine thread finishes its turn the sooner)
        if self._closing.is_set():  # (taken between the thread's last turn and its goodbye)
            owner.release()
            return False
        return True

    def give_back(self, ran: bool = False) -> None:
        """Release the loop if this thread holds it (``ran``: after a direct run, which starts
        the engine thread's grace); the last driver wakes it where work is left."""
        if self.owner._is_owned():  # type: ignore[attr-defined]  # (also if interrupted)
            self.holder, self.driving = 0, False
            self.owner.release()
        if ran:  # (before the discard: the engine thread may look at once)
            self.ran_at = self._clock()
        self.drivers.discard(threading.get_ident())
        if not self.drivers and self._has_work():
            with self.turn:
                self.turn.notify()  # (else it looks again after its grace: stand_aside)

    def stand_aside(self) -> None:
        """(The engine thread, between turns.) Let the drivers have the loop until the last
        gives it back, and through the grace after a direct run, or until a close."""
        with self.turn:
            self.aside = True
            while not self._closing.is_set() and (self.drivers or self.in_grace()):
                self.turn.wait(ASIDE_GRACE)
            self.aside = False

    def in_grace(self) -> bool:
        """A direct run gave the loop back within ``ASIDE_GRACE`` with nothing left to move.
        Not after a driver that moved the loop: its next post is as likely an iallreduce,
        whose wake-up would then race its next post."""
        return self._clock() - self.ran_at < ASIDE_GRACE and not self._has_work()

    def wake(self) -> None:
        """Have the engine thread look now if it stands aside with no driver (in its grace);
        while a driver holds the loop, nothing: it moves what there is, and its give-back
        wakes the engine thread if work is left."""
        if self.aside and not self.drivers:
            with self.turn:
                self.turn.notify()
