"""The engine's front door, for any thread: the entry queue a post goes into (a deque append,
and a one-byte wake-up where the engine thread sleeps), the refusal of a post that cannot run,
the wake-ups (a post, a lane post, a request nobody waits on), and the close handshake's start.

No lost wake-up: a submit appends and reads ``_sleeping`` under the lock the engine thread sets
it under (turns.py, ``_poll``), so either the thread sees the operation before it sleeps or the
submit sees it asleep and writes the wake-up byte; a close appends its None under the same lock,
so a submit that checked before the close is taken and failed by it, never lost.

A mixin of ``Engine`` (core.py), which holds the state declared in parts.py.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import ClosedError
from ..protocol.operation import Operation
from ..protocol.route import small
from ..protocol.wire import Key, payload_bytes
from ..request import Request
from .parts import EngineParts

__all__ = ["Entry"]

_TURN_WAIT = 0.1  # a close waits this long for the lock this thread stands aside under


class Entry(EngineParts):
    """Posts, refusals, wake-ups and the start of a close (see the module docstring)."""

    if TYPE_CHECKING:  # a waiter drives the loop (core.py): the Engine is its requests' mover

        def drive(self, request: Request[Any], timeout: float | None) -> None: ...

    def submit(self, op: Operation) -> None:
        """Hand an operation to the engine; raises ClosedError or BrokenError if it cannot run."""
        op.posted_at = time.time()
        request = op.request
        if small(payload_bytes(op.desc)) and request.mover is None and self.settings.spin:
            request.mover = self  # its waiter drives the loop (core.py: progress in the call)
        with self._lock:  # (a submit that checked before close() is taken: see _shut)
            refusal = self.refusal(op.label, False, op.key)  # the session judges a goodbye
            if refusal is not None:
                raise refusal
            self._submitted.append(op)
            sleeping = self._sleeping  # read after the append, under the lock: see _poll
        if sleeping:
            self.transport.wakeup()
        else:
            self.wake()  # (read after the append: see Ownership.in_grace)

    def refusal(
        self, label: str, goodbyes: bool = True, key: Key | None = None
    ) -> BaseException | None:
        """Why a new post must fail at once (closed, broken, or, with ``goodbyes``, a rank
        said goodbye), if it must; where ``key`` failed already, with its error (the
        session's ``refusal``). ``submit`` and the lane ask without ``goodbyes``: the
        session judges an engine operation on the frames the departed rank sent first, and
        the lane one on whether the departed rank's slot holds it (``Session.watch_outside``)."""
        if self._closing.is_set():
            return ClosedError(f"{label}: the communicator is closed")
        session = self.session
        if session.broken is None and not session.liveness.departed:
            return None  # the usual case, asked for every post: nothing built
        return session.refusal(label, goodbyes, key)

    def post(self, op: Operation) -> Request[Any]:
        """Submit ``op``; its request (a direct run's, left to the loop)."""
        self.submit(op)
        return op.request

    def nudge(self) -> None:
        """The lane has work this thread must look at: wake it if it sleeps for longer than
        the lane's nap (it read the lane idle). No lost wake-up: ``_poll`` reads the lane and
        sets ``_dozing`` under the lock this reads it under."""
        with self._lock:
            dozing = self._dozing
        if dozing:
            self.transport.wakeup()
        else:
            self.wake()  # (aside in its grace after a waiter)

    def poke(self) -> None:
        """``Request.test``: as ``wake`` (this thread moves the operation)."""
        self.wake()

    def wake(self) -> None:
        """Nobody may wait on the request (a callback, ``test``, ``wait_any``): if this thread
        stands aside with no driver (in its grace after one), have it look now. A submit, a
        lane post and a close do the same; while a waiter holds the loop, nothing does: it
        moves what there is, and its give-back wakes this thread if work is left (a wake-up
        per operation cost as much as the operation's Python)."""
        self._loop.wake()

    def _asleep(self) -> bool:
        """Whether this thread blocks in poll (read under the lock ``_poll`` sets it under:
        it sleeps only where it saw no driver)."""
        with self._lock:
            return self._sleeping

    def close(self) -> None:
        """Fail what is pending with ClosedError, close every socket, join the thread."""
        self._shut(None)

    def abort(self, reason: str = "") -> None:
        """Break the communicator on every rank now and close it, within about 1 s: pending
        requests fail with BrokenError, peers are told with an ABORT frame."""
        self._shut(reason or "abort() was called")

    def _shut(self, abort_reason: str | None) -> None:
        with self._lock:
            if not self._closing.is_set():
                self._closing.set()  # (under the lock: a submit that checked before is taken)
                self._aborting = abort_reason
                self._submitted.append(None)
        self.transport.wakeup()
        turn = self._loop.turn
        if not turn.acquire(timeout=_TURN_WAIT):  # held by the thread a signal handler
            return  # interrupted to close: joining would wait for it (the thread sees the
            # close within its grace and ends)
        try:
            turn.notify()  # (aside: it stops waiting)
        finally:
            turn.release()
        if self._thread is not threading.current_thread() and not self._loop.holds():
            self._thread.join()  # (not from a signal handler on a thread that holds the loop: the
            # thread waits for it; the interrupted turn stops at the close, and the thread ends)
