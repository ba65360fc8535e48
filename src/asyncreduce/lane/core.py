"""The same-host lane: unnamed small allreduces (and barriers) through shared-memory
mailboxes, moved by the thread that waits for them.

Theory of operation. Where every rank is on one host, an unnamed allreduce of at most
``SLOT_BYTES`` (64 KiB) skips the engine, and so does an unnamed barrier (an allreduce of
nothing: done once every rank published its slot): the posting call copies the contribution
into this rank's mailbox slot for its sequence number (mailbox.py), and whoever looks next
(the thread that waits on the request, spinning for a while, or the progress thread) reads
every peer's slot for that number and, once all are there, combines them in rank order, so
every rank ends bitwise equal. No frame, no socket, no thread hand-off: an operation costs
about what its Python does. Every other unnamed operation of the communicator leaves a note in
its slot instead (``ON_ENGINE``), so the slots keep one numbering.

Every semantic of the engine stays, because the engine keeps all of them:
- the choice of path is a function of the descriptor, so ranks that agree take the same one;
  where a peer's slot holds a note, or another descriptor, this rank hands the operation to
  the engine as it is (``convert``), whose matching completes it or fails it on every rank
  with its MismatchError;
- deadlines, broken peers and silent peers are watched by the progress thread (``watch``,
  by protocol/outside.py's rules), which fails an operation through the session, so peers
  hear of it as of any other failure, and a later post fails at once; an operation that still
  needs a rank that said goodbye (its slot lacks it) fails on every rank by itself, alike, as
  each reads the same final slot;
- whatever a call of the lane raises (a signal handler's exception, most often), the
  operation it brought stays the lane's, and the sequence stays whole (``_rescue``);
- posting never blocks: a contribution whose slot is not free yet (a peer is ``SLOTS``
  operations behind) waits in ``_unpublished`` and goes out in order as slots free up;
- a request nobody waits on still completes: ``test()`` looks once (as MPI_Test progresses),
  a done-callback, ``exception()`` or ``wait_any`` wake the progress thread, and that thread
  never sleeps more than 10 ms while a lane exists (a post itself wakes nobody: that cost a
  third of the latency at N=4).

The lane is not used for named operations (posted in any order: a slot per name could
deadlock), for groups, for the ordered engines, or where ``ASYNCREDUCE_LANE=0`` or
``ASYNCREDUCE_SPIN_US=0`` on any rank (its point is spinning), or off x86-64 (mailbox.py).
Its operations have no flight record and are not asked about as stalls.
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
from ..buffers import Buffer
from ..envvars import env_number
from ..errors import ClosedError, UsageError
from ..keys import Key
from ..protocol.operation import Settings
from ..protocol.outside import judge
from ..protocol.session import Session
from ..request import Request
from ..samehost.mailbox import (
    AGREED,
    HERE,
    ON_ENGINE,
    SLOT_BYTES,
    WAITING,
    Mailbox,
    SlotHeader,
    header,
    supported,
)
from ..samehost.named import Found, NamedSlots, found_for, key_words
from ..spin import SpinWindow
from ..transport.frame import Descriptor
from .named import NamedOps

__all__ = ["Lane", "LaneOp", "lane_wanted"]

_NOT_LOOKED: Found = found_for(0)

_WAITER_SPIN = 2e-3  # how long a waiting thread moves the lane itself before it sleeps


def lane_wanted(settings: Settings) -> bool:
    """Whether this rank would use the lane: an x86-64 CPU, ASYNCREDUCE_LANE not 0, and
    spinning allowed (ASYNCREDUCE_SPIN_US not 0). Every rank must want it, or none uses it."""
    return supported() and settings.spin > 0 and env_number("ASYNCREDUCE_LANE", 1, int, 0) > 0


class LaneOp:
    """One unnamed small allreduce (or barrier) in the lane (``header``: what its slot says, as the
    mailbox's words; ``deadline``: monotonic, 0 for none)."""

    __slots__ = ("key", "seq", "label", "desc", "header", "buf", "op", "result", "request",
                 "timeout", "deadline", "words", "slot", "found")  # fmt: skip

    request: Request[Any]  # set by ``Lane.post``, or where ``Lane.run_waiting`` needs one

    def __init__(
        self, key: Key, label: str, desc: Descriptor, buf: Buffer, op: str,
        result: Callable[[], Any], timeout: float | None, posted: float = 0.0,
    ) -> None:  # fmt: skip
        """``posted``: when it was posted (monotonic), where that was before now."""
        self.key, self.seq, self.label, self.desc = key, key[1], label, desc
        self.header = header(HERE, desc)
        self.buf, self.op, self.result = buf, op, result
        self.timeout = timeout
        self.deadline = 0.0 if timeout is None else (posted or time.monotonic()) + timeout
        if key[0]:  # a named one: found by key (named.py)
            self.words = key_words(*key)
            self.slot = -1
            self.found: Found = _NOT_LOOKED  # (``NamedOps.post`` gives it its own)


class Lane:
    """Rank ``rank``'s side of the lane (see the module docstring). ``convert`` hands an
    operation to the engine; every method but ``watch`` may be called from any thread."""

    _closed_with: Callable[[LaneOp], BaseException]  # what ``close`` failed operations with

    def __init__(
        self, mailbox: Mailbox, rank: int, world_size: int,
        convert: Callable[[LaneOp], None], wake: Callable[[], None] = lambda: None,
        named: NamedSlots | None = None,
    ) -> None:  # fmt: skip
        """``named``: the named slots, where named operations take the lane too."""
        self.mailbox = mailbox
        self.rank, self.world_size = rank, world_size
        self._convert = convert
        self._wake = wake  # wakes the progress thread if it dozes (Engine.nudge)
        self._lock = threading.Lock()
        self.named = None if named is None else NamedOps(named, self._lock, convert, self)
        self._unpublished: dict[int, tuple[SlotHeader, LaneOp | None]] = {}
        self._next = 0  # the next sequence number to publish
        self._pending: dict[int, LaneOp] = {}  # published or not, not yet complete
        self._finished: dict[int, None] = {}  # done with, above ``_through`` (``_done_with``)
        self._through = 0
        self._closed = False
        self.completed = 0  # operations this lane completed itself (diagnostics, tests)
        self.converted = 0  # and those it handed to the engine
        self.ran = 0  # of the completed, those ``run_waiting`` did on the caller's thread
        self.drivers = 0  # threads spinning in ``drive``: the progress thread need not
        self.moved_at = 0.0  # when the lane last published or completed something
        self._generation = forks.generation()  # a forked child must not move it (``_forked``)

    def takes(self, kind: str, buf: Buffer, key: Key) -> bool:
        """Whether an operation goes through the lane: small allreduces, and barriers (an
        allreduce of nothing: done once every rank published its slot); named ones where the
        lane has named slots. The one place that says "small" for the lane."""
        small = kind == "allreduce" and buf.flat.nbytes <= SLOT_BYTES
        return (small or kind == "barrier") and (not key[0] or self.named is not None)

    @property
    def busy(self) -> bool:
        return bool(self._pending or self._unpublished or (self.named and self.named.pending))

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
                self._post(op)
        except BaseException:
            self._rescue(op.seq, lambda: op)
            raise
        return True

    def _post_named(self, op: LaneOp) -> bool:
        with self._lock:
            if self._closed:
                raise ClosedError(f"{op.label}: the communicator is closed")
            assert self.named is not None  # (``takes``)
            op.request.mover = self
            if not self.named.post(op):
                op.request.mover = None
                return False
            self.moved_at = time.monotonic()
        return True

    def run_named(
        self, key: Key, head: SlotHeader, flat: Array, dtype: DType, op: str,
        adopt: Callable[[], LaneOp],
    ) -> Request[Any] | None | Literal[False]:  # fmt: skip
        """``run_waiting`` for a named operation (``NamedOps.run``); False: the lane cannot
        take it now, for the engine to run."""
        named = self.named
        if named is None:
            return False
        made = named.run(key, head, flat, dtype, op, _WAITER_SPIN, adopt)
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

    def run_waiting(
        self, seq: int, head: SlotHeader, flat: Array, dtype: DType, op: str,
        timeout: float | None, adopt: Callable[[], LaneOp],
    ) -> Request[Any] | None:  # fmt: skip
        """Run operation ``seq`` (``head``: its header; ``flat``: its buffer, of ``dtype``) on
        the calling thread, which waits for it (a blocking allreduce), with no request, if
        nothing else is in the lane: publish, wait for the peers (spinning for up to
        ``_WAITER_SPIN``) and fold; None once done.
        Anything else makes it an ordinary operation, ``adopt()`` (with its request), whose
        request is returned for the caller to wait on: others in the lane (it is posted
        behind them), a peer that runs it elsewhere or disagrees (the engine decides), a peer
        not there within the spin (the progress thread watches it from then on: deadlines
        and failures), the lane closed.
        Whatever it raises (a signal handler's exception lands in the spin most often), the
        operation stays the lane's (``_rescue``)."""
        mailbox = self.mailbox
        try:
            with self._lock:
                if (self._closed or self._pending or self._unpublished or seq != self._next
                        or not mailbox.free(seq)):  # fmt: skip
                    made = adopt()
                    self._post(made)
                    return made.request
                self._publish(seq, head, flat)
            spin = _WAITER_SPIN if timeout is None else min(_WAITER_SPIN, timeout)
            end = 0.0  # (set after the first look: most operations need no clock)
            while True:
                if not mailbox.wait(seq, spin):
                    os.sched_yield()
                with self._lock:
                    if self._closed:
                        made = adopt()
                        made.request.set_exception(self._closed_with(made))
                        return made.request
                    state = mailbox.collect(seq, head, flat, dtype, op)
                    if state == AGREED:
                        self._done_with(seq)
                        self.completed += 1
                        self.ran += 1
                        self.moved_at = time.monotonic()
                        return None
                    now = time.monotonic()
                    end = end or now + spin
                    if state != WAITING or now >= end:
                        made = adopt()
                        made.request.mover = self
                        self._pending[seq] = made
                        self._advance()  # (completes it if a peer runs it elsewhere or disagrees)
                        break
                    spin = end - now
        except BaseException:
            self._rescue(seq, adopt)
            raise
        self._wake()  # the progress thread watches it now: it must not doze
        return made.request

    def note(self, seq: int, desc: Descriptor) -> None:
        """Unnamed operation ``seq`` runs on the engine: say so in its slot (whatever is
        raised meanwhile: see ``_rescue``)."""
        with self._lock:
            if self._closed:
                return  # (the engine refuses the operation itself)
            try:
                self._unpublished[seq] = (header(ON_ENGINE, desc), None)
                self._done_with(seq)
                self._advance()
            except BaseException:
                if seq >= self._next and seq not in self._unpublished:
                    self._unpublished[seq] = (header(ON_ENGINE, desc), None)
                if not (seq < self._through or seq in self._finished):
                    self._done_with(seq)
                raise

    def drive(self, request: Request[Any], timeout: float | None) -> None:
        """Move the lane from the waiting thread until ``request`` is done, yielding the core
        between looks (a native mailbox waits for the peers' stamps itself, without the GIL),
        for as long as the lane moves: ``_WAITER_SPIN`` (at most ``timeout``) from the start,
        or from the last operation it saw complete. Ranks that lost their core for a while
        (four ranks on two cores, a hypervisor that took a core) come back to a waiter that
        still drives, not to a progress thread that looks once a nap."""
        self._refuse_fork(request.label)
        awaited = self._look()  # the peers may be there already: then no spin to set up
        if request.done():
            return
        spin = _WAITER_SPIN if timeout is None else min(_WAITER_SPIN, timeout)
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
            return self._awaited()

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

    def watch(self, session: Session, now: float, silent: set[int]) -> None:
        """Fail what must fail (protocol/outside.py's rules), through ``session`` where the
        peers must hear of it (its commands are the caller's to apply)."""
        with self._lock:
            if not self.busy:
                return
            departed, failed = session.liveness.departed, session.matching.failed
            wait = session.settings.peer_timeout
            for op, missing in self._judged():
                verdict = judge(op, self.rank, now, broken=session.broken,
                                earlier=failed.get(op.key), departed=departed,
                                missing=functools.partial(missing, op),
                                silent=silent, peer_timeout=wait)  # fmt: skip
                if verdict is not None:
                    self._fail(op, verdict.error)
                    if verdict.everywhere:
                        session.fail_all(verdict.error, (op.key, op.desc))

    def _judged(self) -> list[tuple[LaneOp, Callable[[LaneOp], set[int]]]]:
        """Every pending operation, with how to ask which peers it still misses."""
        unnamed = self.mailbox.missing
        judged = [(op, lambda o: unnamed(o.seq)) for op in self._ordered()]
        named = self.named
        if named is not None:
            judged += [(op, named.missing) for op in named.pending.values()]
        return judged

    def close(self, error: Callable[[LaneOp], BaseException]) -> None:
        """Fail what is pending with ``error(op)`` (and what ``run`` moves); later posts raise
        ClosedError."""
        with self._lock:
            if self._closed:
                return
            self._closed, self._closed_with = True, error
            for op in self._ordered():
                self._fail(op, error(op))
            self._unpublished.clear()  # nobody will read them: the peers hear of the close
            if self.named is not None:
                self.named.close(error)
            self.mailbox.release()

    def _rescue(self, seq: int, made: Callable[[], LaneOp]) -> None:
        """``post`` or ``run`` of ``seq`` raised, wherever in it (an exception a signal
        handler raises, e.g. Ctrl-C caught by a loop, ``sys.exit`` from a preemption handler,
        an alarm, lands mostly in ``run``'s spin): unless the lane is closed, done with
        ``seq`` or has it pending already, the operation (``made()``) becomes an ordinary
        pending one, published now or in its turn, which the progress thread completes or
        fails as any other, on every rank alike. Lost, it would hold ``through`` back for
        good, and with it every rank's slots SLOTS operations later, with no error."""
        with self._lock:
            if self._closed or seq < self._through or seq in self._finished:
                return
            op = self._pending.get(seq)
            if op is None:
                op = made()
                op.request.mover = self
                self._pending[seq] = op
            if seq >= self._next and seq not in self._unpublished:
                self._unpublished[seq] = (op.header, op)
            self._advance()
        self._wake()

    # ---- under the lock --------------------------------------------------------------------
    # Ordered for exceptions raised at any point (a signal handler's, on the caller's thread,
    # lands at a call or a loop's jump back, never between two plain stores): a publish drops
    # its ``_unpublished`` entry only in the step that moves ``_next`` (an interrupted one is
    # made again, the same bytes), and an operation leaves ``_pending`` in the step that
    # counts it done with (``_done_with``).

    def _post(self, op: LaneOp) -> None:
        if self._closed:
            raise ClosedError(f"{op.label}: the communicator is closed")
        op.request.mover = self
        self._pending[op.seq] = op
        self._unpublished[op.seq] = (op.header, op)
        self._advance()

    def _advance(self) -> None:
        if self._closed:
            return  # (a waiter may still drive: its request failed already)
        named = self.named
        if named is not None and named.pending and named.advance():
            self.moved_at = time.monotonic()
        unpublished = self._unpublished
        while self._next in unpublished and self.mailbox.free(self._next):
            seq = self._next
            head, posted = unpublished[seq]
            self._publish(seq, head, None if posted is None else posted.buf.flat)
            del unpublished[seq]
        pending = self._pending
        if len(pending) == 1:  # the usual case: no list, no sort
            op = next(iter(pending.values()))
            if op.seq < self._next:
                self._complete(op)
            return
        for op in self._ordered():
            if op.seq >= self._next or not self._complete(op):
                break  # peers publish in order: nothing later is ready either

    def _awaited(self) -> int:
        """The oldest operation published and not complete, whose peers' stamps the lane needs
        next (``Mailbox.wait``), or -1 for none."""
        pending = self._pending
        if not pending:
            return -1
        seq = next(iter(pending)) if len(pending) == 1 else min(pending)
        return seq if seq < self._next else -1

    def _publish(self, seq: int, head: SlotHeader, data: Array | None) -> None:
        self.moved_at = time.monotonic()
        self.mailbox.publish(seq, head, data)
        self._next = seq + 1  # (then nothing but the caller's plain steps: see above)

    def _ordered(self) -> list[LaneOp]:
        pending = self._pending
        return list(pending.values()) if len(pending) < 2 else [pending[s] for s in sorted(pending)]

    def _complete(self, op: LaneOp) -> bool:
        """Finish ``op`` if every peer's slot holds it; False while one does not yet."""
        seq = op.seq
        buf = op.buf
        state = self.mailbox.collect(seq, op.header, buf.flat, buf.dtype, op.op)
        if state == WAITING:
            return False
        self._done_with(seq)  # (no longer pending)
        self.moved_at = time.monotonic()
        if state != AGREED:
            self.converted += 1
            self._convert(op)  # a peer runs it elsewhere, or disagrees: the engine decides
            return True
        self.completed += 1
        op.request.set_result(op.result())
        return True

    def _done_with(self, seq: int) -> None:
        """Count ``seq`` done with (no longer pending) and tell the peers how far this rank
        is through. It leaves ``_pending`` in the step that counts it (no call between); an
        exception later in here leaves ``_through`` behind ``_finished``, caught up with at
        the next call, and the peers' counter lags at most until then."""
        pending, finished = self._pending, self._finished
        if seq in pending:
            del pending[seq]
        through = self._through
        if seq == through and not finished:  # the usual case: in order
            self._through = through = seq + 1
        else:
            finished[seq] = None
            while through in finished:
                through += 1
            if through == self._through:
                return  # an earlier one is not done with yet
            self._through = through
            for done in [s for s in finished if s < through]:
                del finished[done]
        self.mailbox.done_through(through)

    def _fail(self, op: LaneOp, error: BaseException) -> None:
        if op.key[0]:
            if self.named is not None:
                self.named.fail(op, error)
            return
        if op.seq not in self._pending:
            return
        if op.seq in self._unpublished:  # peers still wait for its slot: it says "elsewhere"
            self._unpublished[op.seq] = (header(ON_ENGINE, op.desc), None)
        self._done_with(op.seq)
        if not op.request.done():
            op.request.set_exception(error)
