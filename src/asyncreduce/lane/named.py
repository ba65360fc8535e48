"""The lane's named operations: named small allreduces and barriers, matched by key in the
ranks' named slots (samehost/named.py), from any thread, in any order.

Theory of operation. A named operation has no sequence number that every rank agrees on, so it
takes any free slot of this rank, headed by its key, and completes once every peer's slots hold
the same key with the same header: then every rank folds the same contributions in rank order
and ends bitwise equal, as for an unnamed one. Nothing waits for a slot: where this rank has
none free, the operation goes to the engine at once (slots held by operations that wait on
each other, in different orders on different ranks, could otherwise deadlock).

Where ranks take different paths for one key, the engine decides, as for an unnamed one:
- a peer's header differs (another descriptor): every rank sees it, takes its slot back and
  hands the operation to the engine, whose matching fails it on every rank (MismatchError);
- a rank runs the key on the engine (no free slot, or a descriptor the lane does not take):
  an operation the lane would have taken tells every peer so (a ``PostNotice``), as does its
  first frame to a peer and a stall inspector's question, and a peer whose lane holds the key
  hands it over (``claim``); a word that comes before the peer posts the key is remembered.
Failures (deadline, silent peer, departed, broken) follow the lane's rules
(protocol/outside.py), with ``missing`` read from the named slots.

Every method runs under the lane's lock (core.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from ..algorithms import Array, DType
from ..flight import FlightRecorder, Record, settle
from ..keys import Key
from ..request import Request
from ..samehost.mailbox import AGREED, DIFFERENT, WAITING, SlotHeader
from ..samehost.named import Found, KeyWords, NamedSlots, found_for, key_words
from ..transport.frame import Descriptor

if TYPE_CHECKING:
    from .op import LaneOp, Shell

__all__ = ["NamedOps"]

_REMEMBERED = 4096  # keys heard of as run on the engine elsewhere, before posted here
_CLAIMED = -1  # (``_running``: a peer runs it on the engine)
_SPIN_BEFORE_NAPS = 200e-6  # a waiter yields the core this long, then sleeps between looks, as
_NAP = 20e-6  # the C mailbox's wait does: a peer that is not running gets the core


class NamedOps:
    """This rank's named operations in the lane (see the module docstring)."""

    closed_with: Callable[[LaneOp], BaseException] | None = None  # set by ``close``

    def __init__(
        self, slots: NamedSlots, lock: threading.Lock, convert: Callable[[LaneOp], None],
        mover: Shell, flight: FlightRecorder | None = None,
    ) -> None:  # fmt: skip
        """``lock``: the lane's; ``convert``: hand an operation to the engine (it tells the
        peers so); ``mover``: the lane, which moves a request of its own (``Request.mover``)."""
        self.slots = slots
        self._lock, self._convert, self._mover = lock, convert, mover
        self._flight = flight  # where each one that ends here is recorded (``_settled``)
        self.pending: dict[Key, LaneOp] = {}
        self._running: dict[Key, int] = {}  # on a waiting thread (``run_waiting``): slot, _CLAIMED
        self._elsewhere: dict[Key, None] = {}  # keys a peer runs on the engine, not posted here
        self.completed = 0
        self.converted = 0

    # ---- called under the lane's lock --------------------------------------------------------

    def post(self, op: LaneOp) -> bool:
        """Publish ``op`` and complete it if every peer's slot is there; False (nothing done)
        where it must run on the engine: no slot is free, or a peer runs it there."""
        slot = self._publish(op.key, op.words, op.header, op.buf.flat)
        if slot < 0:
            return False
        op.slot, op.found = slot, found_for(self.slots.world_size)
        self.pending[op.key] = op
        self._complete(op)
        return True

    def advance(self) -> bool:
        """Complete what can be; True where something completed (or left for the engine)."""
        moved = False
        for op in list(self.pending.values()):
            moved = self._complete(op) or moved
        return moved

    def claim(self, key: Key, remember: bool) -> None:
        """A peer runs ``key`` on the engine: hand it over if it is here, else (``remember``)
        remember it for when it is posted."""
        if key in self._running:
            self._running[key] = _CLAIMED
            return
        op = self.pending.pop(key, None)
        if op is None:
            if remember and key not in self._elsewhere:
                if len(self._elsewhere) >= _REMEMBERED:
                    del self._elsewhere[next(iter(self._elsewhere))]
                self._elsewhere[key] = None
            return
        self.slots.withdraw(op.slot)
        self._hand_over(op)

    def fail(self, op: LaneOp, error: BaseException) -> None:
        """End ``op`` with ``error`` here (its slot taken back)."""
        if self.pending.pop(op.key, None) is None:
            return
        self.slots.withdraw(op.slot)
        if not op.request.done():
            self._settled(op.label, op.key, op.desc, op.started, error, op.record)
            op.request.set_exception(error)

    def missing(self, op: LaneOp) -> set[int]:
        """The peers whose slots do not hold ``op`` now."""
        return self.slots.missing(op.words)

    def close(self, error: Callable[[LaneOp], BaseException]) -> None:
        """Fail every pending operation with ``error(op)``; let go of the slots."""
        self.closed_with = error
        for op in list(self.pending.values()):
            self.fail(op, error(op))
        self.slots.release()

    # ---- a waiting thread ----------------------------------------------------------------------

    def run_waiting(
        self, key: Key, label: str, desc: Descriptor, head: SlotHeader, flat: Array,
        dtype: DType, op: str, spin: float, adopt: Callable[[], LaneOp],
    ) -> Request[Any] | None | Literal[False]:  # fmt: skip
        """Run named operation ``key`` on the calling thread, which waits for it (a blocking
        allreduce), with no request: publish, wait for the peers (spinning for up to
        ``spin``) and fold; None once done. Anything else makes it an ordinary operation,
        ``adopt()``, whose request is returned: a peer not there within the spin (the lane
        moves it from then on), a peer that runs it elsewhere or disagrees (the engine
        decides), the lane closed. False: the lane cannot take it (run it on the engine)."""
        words, found = key_words(*key), found_for(self.slots.world_size)
        posted = time.monotonic()
        with self._lock:
            if self.closed_with is not None:
                return False
            slot = self._publish(key, words, head, flat)
            if slot < 0:
                return False
            if self._fold(words, slot, found, head, flat, dtype, op) == AGREED:
                self._settled(label, key, desc, posted)
                return None
            self._running[key] = slot
        now = time.monotonic()
        end, naps_from = now + spin, now + _SPIN_BEFORE_NAPS
        try:
            while True:
                if not self.slots.wait(found, end - now):  # (the native one spins in C)
                    if now < naps_from:
                        os.sched_yield()
                    else:
                        time.sleep(_NAP)
                with self._lock:
                    state = self._fold_running(key, words, slot, found, head, flat, dtype, op)
                    if state == AGREED:
                        del self._running[key]
                        self._settled(label, key, desc, posted)
                        return None
                    now = time.monotonic()
                    if state != WAITING or now >= end:
                        return self._adopted(key, adopt, slot, found, state)
        except BaseException:
            with self._lock:  # the operation stays the lane's: the peers need its slot
                if key in self._running:
                    self._adopted(key, adopt, slot, found, WAITING)
            raise

    def _fold_running(
        self, key: Key, words: KeyWords, slot: int, found: Found, head: SlotHeader,
        flat: Array, dtype: DType, op: str,
    ) -> int:  # fmt: skip
        if self.closed_with is not None or self._running[key] == _CLAIMED:
            return DIFFERENT
        return self._fold(words, slot, found, head, flat, dtype, op)

    def _adopted(
        self, key: Key, adopt: Callable[[], LaneOp], slot: int, found: Found, state: int
    ) -> Request[Any]:
        """A running operation made an ordinary one (``state``: WAITING, it stays in the lane;
        else it left: the lane closed, a peer claimed it, or disagrees)."""
        claimed = self._running.pop(key) == _CLAIMED
        made = adopt()
        made.slot, made.found = slot, found
        if self.closed_with is not None:
            made.request.set_exception(self.closed_with(made))
        elif state == WAITING:
            made.request.mover = self._mover
            self.pending[key] = made
        else:
            if claimed:
                self.slots.withdraw(slot)
            self._hand_over(made)
        return made.request

    # ---- the steps -------------------------------------------------------------------------

    def _publish(self, key: Key, words: KeyWords, head: SlotHeader, flat: Array) -> int:
        if key in self._elsewhere:  # (kept: a second try, by any path, is refused as well)
            return -1
        return self.slots.publish(words, head, flat)

    def _complete(self, op: LaneOp) -> bool:
        buf = op.buf
        state = self._fold(op.words, op.slot, op.found, op.header, buf.flat, buf.dtype, op.op)
        if state == WAITING:
            return False
        del self.pending[op.key]
        if state == AGREED:
            self._settled(op.label, op.key, op.desc, op.started, None, op.record)
            op.request.set_result(op.result())
        else:
            self._hand_over(op)
        return True

    def _fold(
        self, words: KeyWords, slot: int, found: Found, head: SlotHeader, out: Array,
        dtype: DType, op: str,
    ) -> int:  # fmt: skip
        """``NamedSlots.fold``; then this rank's slot drains (AGREED) or is taken back
        (DIFFERENT)."""
        state = self.slots.fold(words, slot, found, head, out, dtype, op)
        if state == AGREED:
            self.slots.done(slot)
            self.completed += 1
        elif state == DIFFERENT:
            self.slots.withdraw(slot)
        return state

    def _settled(
        self, label: str, key: Key, desc: Descriptor, posted: float,
        error: BaseException | None = None, record: Record | None = None,
    ) -> None:  # fmt: skip
        """Operation ``key`` ended here: recorded as any other (``flight.settle``), before its
        request completes."""
        settle(self._flight, self._mover.rank, label, key, desc, 0, posted, time.monotonic(),
               error, record)  # fmt: skip

    def _hand_over(self, op: LaneOp) -> None:
        self.converted += 1
        self._convert(op)
