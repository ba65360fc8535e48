"""The hand-over of the engine's loop between threads (engine/ownership.py), in one process,
without sockets: real threads whose steps a ``Sequencer`` puts in a fixed order, and a clock
of the test's own, so each interleaving the safety argument names runs the same way every
time (issue 36: it was tested only through processes, test_small_ops.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from asyncreduce.engine.ownership import ASIDE_GRACE, Ownership
from asyncreduce.request import CallbackRunner, Request

_BOUND = 10.0  # a step that has not happened by then is a failure, never a hang


class Sequencer:
    """Steps numbered 0, 1, 2, ...: ``step(n)`` waits until step n - 1 ended (trio's
    Sequencer, for threads)."""

    def __init__(self) -> None:
        self._done = -1
        self._cond = threading.Condition()

    @contextmanager
    def step(self, n: int) -> Iterator[None]:
        with self._cond:
            assert self._cond.wait_for(lambda: self._done == n - 1, _BOUND), f"step {n}"
        yield
        with self._cond:
            self._done = n
            self._cond.notify_all()


def _until(condition: Callable[[], bool]) -> None:
    """Wait for a state another thread reaches (a failure after ``_BOUND``)."""
    end = time.monotonic() + _BOUND
    while not condition():
        assert time.monotonic() < end, "the state was never reached"
        time.sleep(1e-4)


class _Loop:
    """What the ownership is given: a close, the engine thread's sleep, work, a clock."""

    def __init__(self) -> None:
        self.closing = threading.Event()
        self.sleeping = False
        self.wakeups = 0
        self.work = False
        self.now = 100.0
        self.own = Ownership(self.closing, lambda: self.sleeping, self._wakeup,
                             lambda: self.work, lambda: self.now)  # fmt: skip

    def _wakeup(self) -> None:
        self.wakeups += 1


def _in_thread(body: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(body()), daemon=True)
    thread.start()
    return thread, out


def test_a_driver_gets_the_loop_only_after_the_turn_and_the_engine_thread_waits_aside() -> None:
    loop, seq = _Loop(), Sequencer()
    own = loop.own
    inside: list[str] = []  # who is in the loop, appended on entry and exit

    def driver() -> bool:
        with seq.step(1):
            pass
        got = own.ask(None, loop.now + 1.0)  # spins: the engine thread is in its turn
        inside.append("driver in")
        _until(lambda: own.aside)  # the engine thread stands aside meanwhile
        with seq.step(3):
            inside.append("driver out")
            loop.work = True  # the driver left something: the engine thread must look
            own.give_back()
        return got

    with seq.step(0):
        own.owner.acquire()  # the engine thread's turn
        inside.append("engine in")
    thread, got = _in_thread(driver)
    _until(lambda: bool(own.drivers))  # the driver counted itself before it took the loop
    with seq.step(2):
        assert inside == ["engine in"]  # it could not take the loop in the turn
        inside.append("engine out")
        own.owner.release()
    own.stand_aside()  # returns once the driver gave the loop back with work left
    with seq.step(4):
        thread.join(_BOUND)
    assert got == [True]
    assert inside == ["engine in", "engine out", "driver in", "driver out"]
    assert not own.aside and not own.drivers and own.holder == 0 and not own.driving


def test_a_driver_wakes_the_engine_thread_only_if_it_sleeps() -> None:
    loop = _Loop()
    own = loop.own
    assert own.ask(None, loop.now + 1.0) and loop.wakeups == 0
    own.give_back()
    loop.sleeping = True
    assert own.ask(None, loop.now + 1.0) and loop.wakeups == 1
    assert own.holds() and own.driving
    own.give_back()
    assert not own.holds() and not own.driving


def test_after_a_direct_run_the_engine_thread_stays_aside_for_its_grace_unless_work_came() -> None:
    loop = _Loop()
    own = loop.own
    assert own.ask(None, loop.now + 1.0)
    own.give_back(ran=True)
    assert own.in_grace()  # nothing to move: it stays aside, so the next run finds it there
    loop.work = True
    assert not own.in_grace()  # a submit or a left-over operation ends the grace
    loop.work = False
    loop.now += ASIDE_GRACE
    assert not own.in_grace()  # and so does the grace's end
    loop.now -= ASIDE_GRACE
    aside, _ = _in_thread(own.stand_aside)  # aside in its grace ...
    _until(lambda: own.aside)
    loop.now += ASIDE_GRACE  # ... until the grace ends (it looks every ASIDE_GRACE)
    aside.join(_BOUND)
    assert not aside.is_alive() and not own.aside


def test_no_driver_takes_the_loop_once_its_request_completed_or_a_close_began() -> None:
    loop = _Loop()
    own = loop.own
    request: Request[None] = Request("x", CallbackRunner("asyncreduce-test-callbacks"))

    def asks(request: Request[None] | None) -> bool:
        try:
            return own.ask(request, loop.now + 1.0)
        finally:
            own.give_back()  # (always: it leaves the drivers)

    own.owner.acquire()  # the engine thread's turn, for good
    thread, got = _in_thread(lambda: asks(request))
    _until(lambda: bool(own.drivers))
    request.set_result(None)
    thread.join(_BOUND)
    assert got == [False] and not own.drivers
    thread, got = _in_thread(lambda: asks(None))
    _until(lambda: bool(own.drivers))
    loop.closing.set()
    thread.join(_BOUND)
    assert got == [False] and not own.drivers
    own.owner.release()
    assert own.ask(None, loop.now + 1.0) is False  # free, but closing: the goodbye is next
    assert not own.owner._is_owned()  # type: ignore[attr-defined]
    own.give_back()
    loop.closing.clear()
    own.owner.acquire()
    thread, got = _in_thread(lambda: own.ask(None, loop.now))  # its end has come: no spin
    thread.join(_BOUND)
    assert got == [False]
    own.owner.release()


def test_a_close_ends_the_engine_threads_wait_aside() -> None:
    loop = _Loop()
    own = loop.own
    own.drivers.add(-1)  # a driver that never gives the loop back
    aside, _ = _in_thread(own.stand_aside)
    _until(lambda: own.aside)
    loop.closing.set()
    with own.turn:
        own.turn.notify()  # (what close() does after it set closing)
    aside.join(_BOUND)
    assert not aside.is_alive()


@pytest.mark.parametrize("interrupted", [False, True])
def test_giving_back_releases_only_the_callers_own_hold(interrupted: bool) -> None:
    """A thread that never got the loop (its ask timed out) gives nothing back but its place
    among the drivers; one interrupted while it held the loop releases it (the RLock says)."""
    loop = _Loop()
    own = loop.own
    assert own.ask(None, loop.now + 1.0)
    if interrupted:
        own.holder = 0  # as if cut off before it wrote itself down
    other, _ = _in_thread(own.give_back)
    other.join(_BOUND)
    assert own.owner._is_owned()  # type: ignore[attr-defined]  # still this thread's
    own.give_back()
    assert not own.owner._is_owned() and not own.drivers  # type: ignore[attr-defined]


def test_a_waiters_spin_window_restarts_at_each_progress_within_its_timeout() -> None:
    """The window the engine's drive and the lane's drive share (spin.py)."""
    from asyncreduce.spin import SpinWindow

    window = SpinWindow(2e-3, None, 10.0)
    assert not window.over(10.0019) and window.over(10.002)
    window.moved(10.0015)  # an operation completed: another spin from here
    assert not window.over(10.0034) and window.over(10.0035)
    bounded = SpinWindow(2e-3, 3e-3, 10.0)
    bounded.moved(10.0025)
    assert bounded.end == 10.003 and bounded.over(10.003)  # never past the timeout
