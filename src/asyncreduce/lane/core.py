"""The same-host lane: small allreduces and barriers through shared-memory mailboxes, moved
by the thread that waits for them. No frame, no socket, no thread hand-off: an operation costs
about what its Python (or C) does. This module is the lane's shell: the one lock, the threads
that move it, its failures and its close; what an operation kind does is its own module's
(unnamed.py: a slot per sequence number; named.py: any slot, found by key).

Every semantic of the engine stays, because the engine keeps all of them:
- the choice of path is a function of the descriptor (``takes``, the one place that says
  "small" for the lane), so ranks that agree take the same one; where ranks disagree, or one
  runs the operation on the engine, every rank hands it to the engine as it is (``convert``),
  whose matching completes it or fails it on every rank with its MismatchError;
- the Session watches the lane's pending operations as it watches its own (the lane is its
  ``outside``: ``Session.watch_outside``, by protocol/outside.py's rules, asked now and then by
  the progress thread): each goes into the flight record, is asked about once stalled (a
  peer's lane answers for what it holds: ``holds``), and a deadline, a broken or a silent peer
  fails it through the session, so peers hear of it as of any other failure, and a later post
  fails at once; an operation that still needs a rank that said goodbye (its slot lacks it)
  fails on every rank by itself, alike, as each reads the same final slot;
- a request nobody waits on still completes: ``test()`` looks once (as MPI_Test progresses),
  a done-callback, ``exception()`` or ``wait_any`` wake the progress thread, and that thread
  never sleeps more than 10 ms while a lane exists (a post itself wakes nobody: that cost a
  third of the latency at N=4).

The lane is not used for groups, for the ordered engines, or where ``ASYNCREDUCE_LANE=0`` or
``ASYNCREDUCE_SPIN_US=0`` on any rank (its point is spinning), or off x86-64 (mailbox.py);
named operations take it unless ``ASYNCREDUCE_LANE_NAMED=0`` on any rank. A blocking unnamed
allreduce done within its caller's spin is recorded as it ends (unnamed.py).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from .. import forks
from ..algorithms import Array, DType
from ..envvars import env_number
from ..errors import ClosedError, UsageError
from ..flight import FlightRecorder
from ..keys import Key
from ..protocol.operation import Settings
from ..protocol.outside import Decide
from ..request import Request
from ..samehost.mailbox import (
    Mailbox,
    SlotHeader,
    supported,
)
from ..samehost.named import NamedSlots
from ..spin import SpinWindow
from ..transport.frame import Descriptor
from .named import NamedOps
from .op import LaneOp
from .unnamed import WAITER_SPIN, UnnamedOps

__all__ = ["Lane", "LaneOp", "lane_wanted"]


def lane_wanted(settings: Settings) -> bool:
    """Whether this rank would use the lane: an x86-64 CPU, ASYNCREDUCE_LANE not 0, and
    spinning allowed (ASYNCREDUCE_SPIN_US not 0). Every rank must want it, or none uses it."""
    return supported() and settings.spin > 0 and env_number("ASYNCREDUCE_LANE", 1, int, 0) > 0


class Lane:
    """Rank ``rank``'s side of the lane (see the module docstring). ``convert`` hands an
    operation to the engine; every method but ``judge_each`` may be called from any thread."""

    def __init__(
        self, mailbox: Mailbox, rank: int, world_size: int,
        convert: Callable[[LaneOp], None], wake: Callable[[], None] = lambda: None,
        named: NamedSlots | None = None, flight: FlightRecorder | None = None,
    ) -> None:  # fmt: skip
        """``named``: the named slots, where named operations take the lane too; ``flight``:
        where the named ones are recorded."""
        self.mailbox = mailbox
        self.rank, self.world_size = rank, world_size
        self._convert = convert
        self._wake = wake  # wakes the progress thread if it dozes (Engine.nudge)
        self._lock = threading.Lock()
        self.unnamed = UnnamedOps(mailbox, self._lock, convert, self, wake, flight)
        self.named = None if named is None else NamedOps(named, self._lock, convert, self, flight)
        self._closed = False
        self.drivers = 0  # threads spinning in ``drive``: the progress thread need not
        self.moved_at = 0.0  # when the lane last published or completed something
        self._generation = forks.generation()  # a forked child must not move it (``_forked``)

    @property
    def busy(self) -> bool:
        return self.unnamed.busy or bool(self.named and self.named.pending)

    @property
    def completed(self) -> int:
        """Unnamed operations this lane completed itself (diagnostics, tests)."""
        return self.unnamed.completed

    @property
    def converted(self) -> int:
        """Unnamed operations it handed to the engine."""
        return self.unnamed.converted

    @property
    def ran(self) -> int:
        """Of the completed, those ``run_waiting`` did on the caller's thread."""
        return self.unnamed.ran

    # ---- any thread ----------------------------------------------------------------------

    def post(self, op: LaneOp, request: Request[Any]) -> bool:
        """Start ``op`` with ``request``: publish its contribution (now, if its slot is free)
        and complete it if every peer's is there already. False: a named one the lane cannot
        take now (no free slot, or a peer runs it on the engine), for the engine to run."""
        op.request = request
        if op.key[0]:
            return self._post_named(op)
        try:
            with self._lock:
                self.unnamed.post(op)
        except BaseException:
            self.unnamed.rescue(op.seq, lambda: op)
            raise
        return True

    def run_waiting(
        self, key: Key, desc: Descriptor, head: SlotHeader, flat: Array, dtype: DType, op: str,
        timeout: float | None, adopt: Callable[[], LaneOp],
    ) -> Request[Any] | None:  # fmt: skip
        """Unnamed operation ``key`` on the calling thread, which waits for it, with no
        request while nothing else is in the lane (``UnnamedOps.run_waiting``): None once done."""
        return self.unnamed.run_waiting(key, desc, head, flat, dtype, op, timeout, adopt)

    def note(self, seq: int, desc: Descriptor) -> None:
        """Unnamed operation ``seq`` runs on the engine: say so in its slot."""
        self.unnamed.note(seq, desc)

    def _post_named(self, op: LaneOp) -> bool:
        with self._lock:
            if self._closed:
                raise ClosedError(f"{op.label}: the communicator is closed")
            assert self.named is not None  # (``takes``)
            if not self.named.post(op):
                return False
            op.request.mover = self  # (set under the lock: nobody moves it before)
            self.moved_at = time.monotonic()
        return True

    def run_named(
        self, key: Key, label: str, desc: Descriptor, head: SlotHeader, flat: Array,
        dtype: DType, op: str, adopt: Callable[[], LaneOp],
    ) -> Request[Any] | None | Literal[False]:  # fmt: skip
        """``run_waiting`` for a named operation (``NamedOps.run_waiting``); False: the lane cannot
        take it now, for the engine to run."""
        named = self.named
        if named is None:
            return False
        made = named.run_waiting(key, label, desc, head, flat, dtype, op, WAITER_SPIN, adopt)
        if made is None:
            self.moved_at = time.monotonic()
        elif made is not False and not made.done():
            self._wake()  # the progress thread moves it now: it must not doze
        return made

    def claim(self, key: Key, remember: bool) -> None:
        """A peer runs ``key`` on the engine (the engine thread heard so): a named operation
        the lane holds goes there too (``remember``: or will, once posted)."""
        if self.named is None:
            return
        with self._lock:
            if not self._closed:
                self.named.claim(key, remember)

    def drive(self, request: Request[Any], timeout: float | None) -> None:
        """Move the lane from the waiting thread until ``request`` is done, yielding the core
        between looks (a native mailbox waits for the peers' stamps itself, without the GIL),
        for as long as the lane moves: ``WAITER_SPIN`` (at most ``timeout``) from the start,
        or from the last operation it saw complete. Ranks that lost their core for a while
        (four ranks on two cores, a hypervisor that took a core) come back to a waiter that
        still drives, not to a progress thread that looks once a nap."""
        self._refuse_fork(request.label)
        awaited = self._look()  # the peers may be there already: then no spin to set up
        if request.done():
            return
        spin = WAITER_SPIN if timeout is None else min(WAITER_SPIN, timeout)
        window = SpinWindow(spin, timeout, time.monotonic())
        seen = awaited  # the operation the lane waited for at the last look that got the lock
        counted = False  # (set with the count: an exception cannot land between them)
        try:
            with self._lock:
                self.drivers += 1
                counted = True
            while True:
                if awaited < 0 or not self.mailbox.wait(awaited, window.end - time.monotonic()):
                    os.sched_yield()
                moved = self._look()  # (-1 where another thread held the lane: no news)
                if request.done():
                    break
                now = time.monotonic()
                if moved >= 0:
                    if seen >= 0 and moved != seen:  # an earlier one completed: drive on
                        window.moved(now)
                    seen = moved
                awaited = moved
                if window.over(now):
                    break
        finally:
            if counted:
                with self._lock:
                    self.drivers -= 1
        if not request.done():
            self._wake()  # it waits on the progress thread now: that must not doze

    def poke(self) -> None:
        """One look (``Request.test``), unless another thread is moving the lane."""
        self._refuse_fork("an operation of the same-host lane")
        self._look()

    def _look(self) -> int:
        """Publish and complete what can be, unless another thread is moving the lane; then
        the operation whose peers the lane waits for (``_awaited``), or -1. (``with``, not a
        try after a non-blocking acquire: an exception a signal handler raises as that call
        returns would leave the lock held for good; another thread that takes it between the
        look and the ``with`` holds it for a few microseconds.)"""
        lock = self._lock
        if lock.locked():
            return -1
        with lock:
            self._advance()
            return self.unnamed.awaited()

    def wake(self) -> None:
        """Have the progress thread look soon (a request nobody may wait on)."""
        self._refuse_fork("an operation of the same-host lane")
        self._wake()

    def _refuse_fork(self, label: str) -> None:
        """In a forked child (a DataLoader worker: fork by default), raise UsageError: the
        lane's mailbox is shared with the parent (MAP_SHARED), so a look from the child
        would publish and fold into the parent's slots and move its ``through``, and peers
        would reuse slots the parent has not read; nothing completes the request there
        either (``Request.wait`` refuses it too)."""
        if forks.generation() != self._generation:
            raise UsageError(
                f"{label} was posted before this process was forked; only the parent can "
                "complete it (the lane's shared mailbox is the parent's, and its progress "
                "thread does not run in a child)"
            )

    # ---- the progress thread ---------------------------------------------------------------

    def progress(self) -> None:
        """Publish and complete what can be (the progress thread's turn)."""
        with self._lock:
            self._advance()

    def holds(self, key: Key) -> bool:
        """Whether operation ``key`` is pending in the lane (any thread may ask: one look in
        a dict)."""
        if key[0]:
            return self.named is not None and key in self.named.pending
        return self.unnamed.holds(key[1])

    def judge_each(self, decide: Decide) -> None:
        """Under the lock, hand each pending operation to ``decide`` (the Session's rules,
        ``Session.watch_outside``), with how to ask which peers it still misses, and fail each
        one it returns an error for."""
        with self._lock:
            if not self.busy:
                return
            for op, missing in self._judged():
                error = decide(op, functools.partial(missing, op))
                if error is not None:
                    self._fail(op, error)

    def _judged(self) -> list[tuple[LaneOp, Callable[[LaneOp], set[int]]]]:
        """Every pending operation, with how to ask which peers it still misses."""
        unnamed = self.mailbox.missing
        judged = [(op, lambda o: unnamed(o.seq)) for op in self.unnamed.ordered()]
        named = self.named
        if named is not None:
            judged += [(op, named.missing) for op in named.pending.values()]
        return judged

    def close(self, error: Callable[[LaneOp], BaseException]) -> None:
        """Fail what is pending with ``error(op)`` (and what ``run_waiting`` moves); later
        posts raise ClosedError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.unnamed.close(error)
            if self.named is not None:
                self.named.close(error)
            self.mailbox.release()

    # ---- under the lock --------------------------------------------------------------------

    def _advance(self) -> None:
        if self._closed:
            return  # (a waiter may still drive: its request failed already)
        named = self.named
        if named is not None and named.pending and named.advance():
            self.moved_at = time.monotonic()
        self.unnamed.advance()

    def _fail(self, op: LaneOp, error: BaseException) -> None:
        if not op.key[0]:
            self.unnamed.fail(op, error)
        elif self.named is not None:
            self.named.fail(op, error)
