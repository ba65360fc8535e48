"""The lane's unnamed operations: small allreduces and barriers numbered alike on every rank,
each in its mailbox slot for that number (samehost/mailbox.py).

Theory of operation. Where every rank is on one host, an unnamed allreduce of at most
``SLOT_BYTES`` (64 KiB) skips the engine, and so does an unnamed barrier (an allreduce of
nothing: done once every rank published its slot): the posting call copies the contribution
into this rank's mailbox slot for its sequence number, and whoever looks next (the thread that
waits on the request, spinning for a while, or the progress thread) reads every peer's slot
for that number and, once all are there, combines them in rank order, so every rank ends
bitwise equal. Every other unnamed operation of the communicator leaves a note in its slot
instead (``ON_ENGINE``), so the slots keep one numbering; where a peer's slot holds a note, or
another descriptor, this rank hands the operation to the engine as it is (``convert``), whose
matching completes it or fails it on every rank with its MismatchError.

- whatever a call raises (a signal handler's exception, most often), the operation it brought
  stays the lane's, and the sequence stays whole (``rescue``);
- posting never blocks: a contribution whose slot is not free yet (a peer is ``SLOTS``
  operations behind) waits in ``_unpublished`` and goes out in order as slots free up.

Every method but ``run_waiting``, ``note`` and ``rescue`` runs under the lane's lock (core.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..algorithms import Array, DType
from ..errors import ClosedError
from ..flight import FlightRecorder, settle
from ..keys import Key
from ..request import Request
from ..samehost.mailbox import AGREED, ON_ENGINE, WAITING, Mailbox, SlotHeader, header
from ..transport.frame import Descriptor

if TYPE_CHECKING:
    from .op import LaneOp, Shell

__all__ = ["WAITER_SPIN", "UnnamedOps"]

WAITER_SPIN = 2e-3  # how long a waiting thread moves the lane itself before it sleeps


class UnnamedOps:
    """This rank's unnamed operations in the lane (see the module docstring)."""

    closed_with: Callable[[LaneOp], BaseException] | None = None  # set by ``close``

    def __init__(
        self, mailbox: Mailbox, lock: threading.Lock, convert: Callable[[LaneOp], None],
        lane: Shell, wake: Callable[[], None], flight: FlightRecorder | None = None,
    ) -> None:  # fmt: skip
        """``lock``: the lane's; ``convert``: hand an operation to the engine; ``lane``: the
        lane (its requests' mover, and when it last moved); ``wake``: wake the progress
        thread; ``flight``: where each operation that ends here is recorded."""
        self.mailbox = mailbox
        self._lock, self._convert, self._lane, self._wake = lock, convert, lane, wake
        self._flight = flight
        self._unpublished: dict[int, tuple[SlotHeader, LaneOp | None]] = {}
        self._next = 0  # the next sequence number to publish
        self._pending: dict[int, LaneOp] = {}  # published or not, not yet complete
        self._finished: dict[int, None] = {}  # done with, above ``_through`` (``_done_with``)
        self._through = 0
        self.completed = 0  # operations this lane completed itself (diagnostics, tests)
        self.converted = 0  # and those it handed to the engine
        self.ran = 0  # of the completed, those ``run_waiting`` did on the caller's thread

    @property
    def busy(self) -> bool:
        return bool(self._pending or self._unpublished)

    def holds(self, seq: int) -> bool:
        """Whether operation ``seq`` is pending here (any thread: one look in a dict)."""
        return seq in self._pending

    def run_waiting(
        self, key: Key, desc: Descriptor, head: SlotHeader, flat: Array, dtype: DType, op: str,
        timeout: float | None, adopt: Callable[[], LaneOp],
    ) -> Request[Any] | None:  # fmt: skip
        """Run operation ``key`` (``head``: its header; ``flat``: its buffer, of ``dtype``) on
        the calling thread, which waits for it (a blocking allreduce), with no request, if
        nothing else is in the lane: publish, wait for the peers (spinning for up to
        ``WAITER_SPIN``) and fold; None once done.
        Anything else makes it an ordinary operation, ``adopt()`` (with its request), whose
        request is returned for the caller to wait on: others in the lane (it is posted
        behind them), a peer that runs it elsewhere or disagrees (the engine decides), a peer
        not there within the spin (the progress thread watches it from then on: deadlines
        and failures), the lane closed.
        Whatever it raises (a signal handler's exception lands in the spin most often), the
        operation stays the lane's (``rescue``).
        One done here goes into the flight record as ``flight.settle`` would put it, with the
        time it ended as its post's (it ran within the spin), and without the DEBUG line:
        the call and the clock it would cost were a tenth of this, the library's most
        frequent call (docs/performance.md, issue 36)."""
        mailbox, seq = self.mailbox, key[1]
        try:
            with self._lock:
                closed = self.closed_with is not None
                if (closed or self._pending or self._unpublished or seq != self._next
                        or not mailbox.free(seq)):  # fmt: skip
                    made = adopt()
                    self.post(made)
                    return made.request
                self._publish(seq, head, flat)
            spin = WAITER_SPIN if timeout is None else min(WAITER_SPIN, timeout)
            end = 0.0  # (set after the first look: most operations need no clock)
            while True:
                if not mailbox.wait(seq, spin):
                    os.sched_yield()
                with self._lock:
                    if self.closed_with is not None:
                        made = adopt()
                        made.request.set_exception(self.closed_with(made))
                        return made.request
                    state = mailbox.collect(seq, head, flat, dtype, op)
                    if state == AGREED:
                        self._done_with(seq)
                        self.completed += 1
                        self.ran += 1
                        self._lane.moved_at = now = time.monotonic()
                        if self._flight is not None:  # (``settle``'s record, no more: see above)
                            self._flight.ran((key[0], seq, desc, 0, now, now))
                        return None
                    now = time.monotonic()
                    end = end or now + spin
                    if state != WAITING or now >= end:
                        made = adopt()
                        made.request.mover = self._lane
                        self._pending[seq] = made
                        self.advance()  # (completes it if a peer runs it elsewhere or disagrees)
                        break
                    spin = end - now
        except BaseException:
            self.rescue(seq, adopt)
            raise
        self._wake()  # the progress thread watches it now: it must not doze
        return made.request

    def note(self, seq: int, desc: Descriptor) -> None:
        """Unnamed operation ``seq`` runs on the engine: say so in its slot (whatever is
        raised meanwhile: see ``rescue``)."""
        with self._lock:
            if self.closed_with is not None:
                return  # (the engine refuses the operation itself)
            try:
                self._unpublished[seq] = (header(ON_ENGINE, desc), None)
                self._done_with(seq)
                self.advance()
            except BaseException:
                if seq >= self._next and seq not in self._unpublished:
                    self._unpublished[seq] = (header(ON_ENGINE, desc), None)
                if not (seq < self._through or seq in self._finished):
                    self._done_with(seq)
                raise

    def rescue(self, seq: int, made: Callable[[], LaneOp]) -> None:
        """``post`` or ``run_waiting`` of ``seq`` raised, wherever in it (an exception a signal
        handler raises, e.g. Ctrl-C caught by a loop, ``sys.exit`` from a preemption handler,
        an alarm, lands mostly in ``run_waiting``'s spin): unless the lane is closed, done with
        ``seq`` or has it pending already, the operation (``made()``) becomes an ordinary
        pending one, published now or in its turn, which the progress thread completes or
        fails as any other, on every rank alike. Lost, it would hold ``through`` back for
        good, and with it every rank's slots SLOTS operations later, with no error."""
        with self._lock:
            if self.closed_with is not None or seq < self._through or seq in self._finished:
                return
            op = self._pending.get(seq)
            if op is None:
                op = made()
                op.request.mover = self._lane
                self._pending[seq] = op
            if seq >= self._next and seq not in self._unpublished:
                self._unpublished[seq] = (op.header, op)
            self.advance()
        self._wake()

    # ---- under the lock --------------------------------------------------------------------
    # Ordered for exceptions raised at any point (a signal handler's, on the caller's thread,
    # lands at a call or a loop's jump back, never between two plain stores): a publish drops
    # its ``_unpublished`` entry only in the step that moves ``_next`` (an interrupted one is
    # made again, the same bytes), and an operation leaves ``_pending`` in the step that
    # counts it done with (``_done_with``).

    def post(self, op: LaneOp) -> None:
        if self.closed_with is not None:
            raise ClosedError(f"{op.label}: the communicator is closed")
        op.request.mover = self._lane
        self._pending[op.seq] = op
        self._unpublished[op.seq] = (op.header, op)
        self.advance()

    def advance(self) -> None:
        if self.closed_with is not None:
            return  # (a waiter may still drive: its request failed already)
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
        for op in self.ordered():
            if op.seq >= self._next or not self._complete(op):
                break  # peers publish in order: nothing later is ready either

    def awaited(self) -> int:
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

    def ordered(self) -> list[LaneOp]:
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
        self._lane.moved_at = now = time.monotonic()
        if state != AGREED:
            self.converted += 1
            self._convert(op)  # a peer runs it elsewhere, or disagrees: the engine decides
            return True
        self.completed += 1
        settle(self._flight, self._lane.rank, op.label, op.key, op.desc, 0, op.started, now,
               None, op.record)  # fmt: skip
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

    def fail(self, op: LaneOp, error: BaseException) -> None:
        """End ``op`` with ``error`` here; a slot the peers still wait for says "elsewhere"."""
        if op.seq not in self._pending:
            return
        if op.seq in self._unpublished:  # peers still wait for its slot: it says "elsewhere"
            self._unpublished[op.seq] = (header(ON_ENGINE, op.desc), None)
        self._done_with(op.seq)
        if not op.request.done():
            settle(self._flight, self._lane.rank, op.label, op.key, op.desc, 0, op.started,
                   time.monotonic(), error, op.record)  # fmt: skip
            op.request.set_exception(error)

    def close(self, error: Callable[[LaneOp], BaseException]) -> None:
        """Fail what is pending with ``error(op)`` (and what ``run_waiting`` moves)."""
        self.closed_with = error
        for op in self.ordered():
            self.fail(op, error(op))
        self._unpublished.clear()  # nobody will read them: the peers hear of the close
