"""Requests: the handle every non-blocking call returns, a ``concurrent.futures.Future``.

A request is created running (it cannot be cancelled: a collective in flight on other ranks
cannot be taken back) and completed by the progress engine, or, for the same-host lane's
operations, by whichever thread moves the lane first (lane.py). ``wait``/``test`` are the MPI
spellings of ``result``/``done``; ``await request`` works from asyncio.

Done-callbacks never run on the progress thread: they are handed to a ``CallbackRunner``, one
small thread per communicator, so a callback may block or post new operations without
stalling communication. An exception in a callback is logged, never propagated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast

from . import forks
from .errors import UsageError

__all__ = ["Request", "CallbackRunner", "wait_all", "wait_any"]

log = logging.getLogger("asyncreduce")
T = TypeVar("T")
_STOP = object()
_FINISHED = concurrent.futures._base.FINISHED
_CONDITIONS = threading.Lock()  # held while a request makes its condition, or finds it has none
# The fields Future.__init__ sets, which Request sets itself (its condition made on first use).
# A Python whose Future has others gets Future's own __init__, and every completion its path.
_FIELDS = {"_condition", "_state", "_result", "_exception", "_waiters", "_done_callbacks"}
_LAZY = set(vars(concurrent.futures.Future())) == _FIELDS


class CallbackRunner:
    """Runs done-callbacks in order on one lazily started thread."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[[Any], object], arg: Any) -> None:
        with self._lock:
            inline = self._closed
            if not inline and self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            if not inline:
                self._queue.put((fn, arg))
        if inline:
            _call(fn, arg)

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            _call(*item)

    def close(self) -> None:
        """Run what is queued, then stop the thread (not waiting for it from inside itself)."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(_STOP)
            if thread is not threading.current_thread():
                thread.join()


def _call(fn: Callable[[Any], object], arg: Any) -> None:
    try:
        fn(arg)
    except Exception:
        log.exception("exception in a request's done-callback %r", fn)


class Mover(Protocol):
    """What moves an operation that no engine thread owns (the same-host lane, lane.py)."""

    def drive(self, request: Request[Any], timeout: float | None) -> None:
        """Move it from the waiting thread for a while (at most ``timeout``)."""

    def poke(self) -> None:
        """Move it once, if nobody else is moving it, without waiting."""

    def wake(self) -> None:
        """Have the progress thread look soon: nobody may wait on it."""


class Request(concurrent.futures.Future[T], Generic[T]):
    """The pending result of one operation (see the module docstring)."""

    def __init__(self, label: str, runner: CallbackRunner) -> None:
        # Not Future.__init__: its Condition costs more than the rest of a small operation's
        # post, and most requests never need one (the waiter finds the result there, or the
        # thread that completes it is the one waiting). ``_condition`` makes it on first use.
        self._made_condition: threading.Condition | None = None
        if _LAZY:
            self._result: Any = None
            self._exception: BaseException | None = None
            self._waiters: list[Any] = []
            self._done_callbacks: list[Callable[[concurrent.futures.Future[T]], object]] = []
        else:
            super().__init__()  # (its condition goes through the setter below)
        self._state = concurrent.futures._base.RUNNING  # (it cannot be cancelled)
        self.label = label
        self.posted_at = time.perf_counter()
        self.completed_at: float | None = None  # when the result came, for timelines and stats
        self._runner = runner
        self._generation = forks.generation()
        self.mover: Mover | None = None  # the same-host lane, for its operations (lane.py)
        self.on_wait: Callable[[], object] | None = None  # set by a device engine: orders
        # the waiting thread's GPU stream after the result (see ordered/torchdist.py)

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        """What Future's methods lock and wait on, made by whoever needs it first."""
        condition = self._made_condition
        if condition is None:
            with _CONDITIONS:
                condition = self._made_condition
                if condition is None:
                    condition = self._made_condition = threading.Condition()
        return condition

    @_condition.setter
    def _condition(self, condition: threading.Condition) -> None:
        self._made_condition = condition

    def done(self) -> bool:
        """True once the operation has completed (one read: a request is never cancelled)."""
        return self._state == _FINISHED

    def wait(self, timeout: float | None = None) -> T:
        """The result, once the operation completes; raises its error, or TimeoutError."""
        if self._generation != forks.generation() and not self.done():
            raise UsageError(
                f"{self.label} was posted before this process was forked; only the parent "
                "can complete it (its progress thread does not run in a child)"
            )
        try:
            return self.result(timeout)
        except concurrent.futures.TimeoutError:
            if self.done():
                raise  # the operation itself timed out
            raise TimeoutError(
                f"{self.label} not complete after {timeout} s; it goes on (wait again, or pass "
                "timeout= to the call to make the operation itself give up)"
            ) from None

    def result(self, timeout: float | None = None) -> T:
        """The result (``concurrent.futures.Future.result``); on a device engine, this thread's
        current stream is ordered after it, however the result is asked for."""
        if self.mover is not None and not self.done():
            started = time.monotonic()
            self.mover.drive(self, timeout)
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - started))
        if self._state == _FINISHED and self._exception is None:
            value = cast(T, self._result)  # done: no lock needed (set before the state, under it)
        else:
            value = super().result(timeout)
        if self.on_wait is not None:
            self.on_wait()
        return value

    def set_result(self, result: T) -> None:
        """Complete with ``result`` (the engine's call), stamping ``completed_at``."""
        self.completed_at = time.perf_counter()
        if not self._finish_quietly(result, None):
            super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        """Complete with ``exception`` (the engine's call)."""
        self.completed_at = time.perf_counter()
        if not self._finish_quietly(None, exception):
            super().set_exception(exception)

    def _finish_quietly(self, result: Any, exception: BaseException | None) -> bool:
        """Complete without a condition if nobody has made one: then nobody waits on it, has
        a callback on it, or watches it (each makes it first), so there is nobody to tell."""
        if self._made_condition is not None:  # (once made it stays: no lock needed to see it)
            return False
        with _CONDITIONS:
            if self._made_condition is not None:
                return False
            if self._state == _FINISHED:
                raise concurrent.futures.InvalidStateError(f"{self.label} is complete already")
            self._result, self._exception = result, exception
            self._state = _FINISHED
            return True

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The operation's error, or None (``concurrent.futures.Future.exception``)."""
        if self.mover is not None and not self.done():
            self.mover.wake()
        return super().exception(timeout)

    def test(self) -> bool:
        """True once the operation has completed (successfully or not); never blocks. Like
        MPI_Test it moves the operation if it can (the same-host lane's: one look)."""
        if self.mover is not None and not self.done():
            self.mover.poke()
        return self.done()

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future[T]], object]) -> None:
        """Call ``fn(request)`` once done, on the communicator's callback thread."""
        super().add_done_callback(lambda f: self._runner.submit(fn, f))
        if self.mover is not None and not self.done():
            self.mover.wake()  # nobody may wait: the progress thread must look soon

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self).__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Request {self.label} {state}>"


def wait_all(requests: Iterable[Request[Any]], timeout: float | None = None) -> list[Any]:
    """Wait for every request (within ``timeout`` seconds overall); return their results."""
    deadline = None if timeout is None else time.monotonic() + timeout
    results = []
    for req in requests:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        results.append(req.wait(remaining))
    return results


def wait_any(requests: Sequence[Request[Any]], timeout: float | None = None) -> tuple[int, Any]:
    """Wait until one request completes; return (its index, its result)."""
    if not requests:
        raise UsageError("wait_any needs at least one request")
    for request in requests:
        if isinstance(request, Request) and request.mover is not None and not request.done():
            request.mover.wake()
    done, _ = concurrent.futures.wait(requests, timeout, concurrent.futures.FIRST_COMPLETED)
    if not done:
        raise TimeoutError(f"none of {len(requests)} requests completed within {timeout} s")
    index = next(i for i, r in enumerate(requests) if r in done)
    return index, requests[index].wait()
