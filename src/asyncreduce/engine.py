"""The progress engine: one thread that owns the wire and every operation's state.

Theory of operation. User threads build an ``Operation`` (its key, descriptor and algorithm
state machine) and ``submit`` it: a deque append, plus a one-byte wake-up if the thread
sleeps. Only the engine thread touches transports and algorithm state, so none of that needs
a lock. The thread loops:
take submitted operations, let the transport move bytes (it calls back ``frame_buffer``,
``on_frame``, ``on_sent``, ``on_peer_lost``), do one unit of the most urgent operation's own
work (an algorithm's ``work``: a shared-memory reduction goes one segment at a time, so
what arrives meanwhile is not kept waiting), expire deadlines.

Matching is by key, never by order. A frame names its operation ``(name, instance)``; if that
operation is posted here its payload lands straight in the algorithm's buffer, otherwise it
waits in the unexpected queue until the operation is posted. Every frame carries the
operation's descriptor, and a frame whose descriptor differs from the local one fails the
operation here and, through an ERROR frame, on every other rank, naming both sides.

An operation completes when its algorithm is done and every frame it sent has left (so the
caller may reuse the buffer at once). Completing a request wakes its waiters; done-callbacks
run elsewhere (see request.py).

Failure is sticky. The first failure (a lost or silent peer, a mismatch, a timeout, ``abort``)
breaks the engine: every pending request fails with ``BrokenError`` chained to that cause, and
so does every later post; an ABORT frame tells every other rank, whose engines break at once
instead of waiting out a timeout. Heartbeats bound how long a frozen peer can go unnoticed.

Frames for operations not posted here are held, up to ``held_bytes``. Past that, this rank
sends the peer a FLOW "hold" frame and then a POSTED inquiry for each operation it has posted
(and for each one it posts later): from then on the peer keeps the frames of other operations
in its own memory (the caller's buffers, no copy) until this rank posts them, a rendezvous
protocol that costs a round trip only where this rank is late anyway. The connection itself is
never paused, so what this rank waits for is never stuck behind what it cannot take:
back-pressure slows a fast rank down, it cannot deadlock.
The stall inspector (stall.py) and the flight recorder (flight.py) explain what stalls or fails.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .algorithms import (
    CROSS_MEMORY,
    DTYPE_BY_CODE,
    KINDS,
    REDUCTION_CODES,
    SMALL_ALLREDUCE_BYTES,
    Array,
    Collective,
    ProtocolError,
    Send,
)
from .cma import PeerMemoryError
from .errors import BrokenError, ClosedError, MismatchError, UsageError, ranks_phrase
from .flight import FlightRecorder, Record
from .request import Request
from .stall import ASK, DONE, FAILED, NOT_POSTED, PENDING, POSTED, StallInspector
from .transport.base import FrameSink, Transport
from .transport.frame import (
    ABORT,
    DATA,
    ERROR,
    FLOW,
    GOODBYE,
    HEARTBEAT,
    INQUIRY,
    MAX_ERROR_BYTES,
    Descriptor,
    Header,
    pack_header,
)

__all__ = ["Engine", "Operation", "Settings", "describe", "ON_DEVICE", "broken_by"]

log = logging.getLogger("asyncreduce.engine")
log_ops = logging.getLogger("asyncreduce.ops")  # see comm.py: off unless set to DEBUG

Key = tuple[bytes, int]
_FORGET_AFTER = 4096  # how many failed keys are remembered, to drop their late frames
_LINGER = 2.0  # seconds close() waits for peers to acknowledge its goodbye
_ABORT_LINGER = 0.5  # the same for abort(), which must return within 2 s
_SPARE_BYTES = 64 << 20  # recycled buffers kept for frames that arrive before their operation
_NO_DESC = Descriptor(0, 0, 0, 0, 0)
_BEAT = pack_header(HEARTBEAT, b"", 0, 0, 0, 0, _NO_DESC)
_HOLD = pack_header(FLOW, b"", 1, 0, 0, 0, _NO_DESC)
_ERROR_KINDS: dict[int, type[Exception]] = {1: MismatchError, 2: TimeoutError, 3: BrokenError}
_ERROR_CODES = {cls: code for code, cls in _ERROR_KINDS.items()}
_KIND_NAMES = {code: name for name, code in KINDS.items()}
_DTYPE_NAMES = {code: dtype.name for code, dtype in DTYPE_BY_CODE.items()}
_REDUCE_NAMES = {0: "", **{code: name for name, code in REDUCTION_CODES.items()}}


#: Added to a descriptor's dtype code for memory on a device (ordered backends: a CUDA tensor on
#: one rank against host memory on another is a mismatch, not two different engine calls).
ON_DEVICE = 64


def describe(desc: Descriptor) -> str:
    """``allreduce float32[1000] sum`` (what a rank posted, for error messages)."""
    parts = [_KIND_NAMES.get(desc.kind, f"kind {desc.kind}")]
    dtype = _DTYPE_NAMES.get(desc.dtype) or _DTYPE_NAMES.get(desc.dtype - ON_DEVICE)
    where = " on a GPU" if desc.dtype not in _DTYPE_NAMES and dtype else ""
    parts.append(f"{dtype or f'dtype {desc.dtype}'}[{desc.count}]{where}")
    if _REDUCE_NAMES.get(desc.reduce):
        parts.append(_REDUCE_NAMES[desc.reduce])
    if desc.kind == KINDS["broadcast"]:
        parts.append(f"root={desc.root}")
    elif desc.kind == KINDS["allreduce"] and desc.root == CROSS_MEMORY:
        parts.append("read by cross-memory attach")
    elif desc.kind == KINDS["allreduce"] and desc.root:
        parts.append(f"in shared window {desc.root}")
    return " ".join(parts)


@dataclass(frozen=True)
class Settings:
    """How an engine watches over its peers; ``from_env`` reads the ASYNCREDUCE_* variables."""

    peer_timeout: float = 30.0  # a rank silent this long (no frame, no heartbeat) is dead
    stall_warning: float = 60.0  # warn about an operation pending this long (0: never)
    held_bytes: int = 1 << 30  # frames held for operations not posted here, before pausing
    flight_records: int = 1000  # operations the flight recorder keeps
    flight_dir: str | None = None  # where the flight record is written when the engine breaks
    spin: float = 250e-6  # busy-poll this long after a small operation's last event (0: never)

    @classmethod
    def from_env(cls) -> Settings:
        """Read ASYNCREDUCE_PEER_TIMEOUT, _STALL_WARNING, _HELD_BYTES, _FLIGHT_RECORDS,
        _FLIGHT_DIR and _SPIN_US; a value that is not a number is an error naming the variable."""
        return cls(
            peer_timeout=_env_number("ASYNCREDUCE_PEER_TIMEOUT", cls.peer_timeout, float, 0.05),
            stall_warning=_env_number("ASYNCREDUCE_STALL_WARNING", cls.stall_warning, float, 0),
            held_bytes=_env_number("ASYNCREDUCE_HELD_BYTES", cls.held_bytes, int, 0),
            flight_records=_env_number("ASYNCREDUCE_FLIGHT_RECORDS", cls.flight_records, int, 1),
            flight_dir=os.environ.get("ASYNCREDUCE_FLIGHT_DIR") or None,
            spin=_env_number("ASYNCREDUCE_SPIN_US", cls.spin * 1e6, float, 0) / 1e6,
        )


def _env_number(name: str, default: Any, kind: type, least: float) -> Any:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not least <= value < math.inf:
        raise UsageError(f"{name}={text!r}: expected a {kind.__name__} >= {least}")
    return value


@dataclass(eq=False)
class Operation:
    """One posted operation, as the engine drives it."""

    key: Key
    label: str
    desc: Descriptor
    algo: Collective
    request: Request[Any]
    result: Callable[[], Any]
    priority: int = 0
    timeout: float | None = None
    unsent: int = 0
    deadline: float = field(default=0.0, init=False)
    age: int = field(default=0, init=False)  # start order here: older operations' frames first
    posted_at: float = field(default_factory=time.time, init=False)  # wall clock, for the record
    started: float = field(default=0.0, init=False)  # monotonic, for the stall inspector
    small: bool = field(default=False, init=False)  # latency-bound (see Engine._poll)
    record: Record | None = field(default=None, init=False)


class _Spares:
    """Recycled payload buffers for frames that arrive before their operation is posted.

    Such frames are common when ranks run back-to-back operations; a fresh buffer per frame
    would cost a memset and page faults each time.
    """

    def __init__(self, limit: int) -> None:
        self._free: dict[int, list[memoryview]] = {}
        self._bytes = 0
        self._limit = limit

    def take(self, size: int) -> memoryview:
        free = self._free.get(size)
        if free:
            self._bytes -= size
            return free.pop()
        return _bytes_of(np.empty(size, np.uint8))

    def give(self, buffer: memoryview) -> None:
        size = buffer.nbytes
        if size and self._bytes + size <= self._limit and not buffer.readonly:
            self._free.setdefault(size, []).append(buffer)
            self._bytes += size


class Engine(FrameSink):
    """Drives every operation of one communicator on its own thread (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        make_transport: Callable[[FrameSink], Transport],
        settings: Settings | None = None,
    ) -> None:
        """See ``Settings`` for what can be tuned."""
        settings = settings or Settings()
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self._lock = threading.Lock()
        self._submitted: deque[Operation | None] = deque()
        self._closed = False
        self._broken: BaseException | None = None
        self._aborting: str | None = None  # abort(reason) was asked for
        self._closing = threading.Event()  # close() or abort() was called
        self._departed: dict[int, str] = {}  # peers that closed in good order
        self._stopping = False
        self._sleeping = False  # the thread blocks in poll(): a submit must wake it
        self._spin_until = 0.0  # busy-poll until then (see _poll)
        self._working: set[Operation] = set()  # operations with work of their own to do
        self._ops: dict[Key, Operation] = {}
        self._unexpected: dict[Key, list[tuple[int, Header, memoryview]]] = {}
        self._failed: OrderedDict[Key, BaseException] = OrderedDict()
        self._done: OrderedDict[Key, Descriptor] = OrderedDict()
        self._landing: dict[int, tuple[Operation, Array]] = {}
        self._deadlines: list[tuple[float, int, Operation]] = []
        self._order = itertools.count()
        self._spares = _Spares(_SPARE_BYTES)
        self._held = 0  # bytes of payload in self._unexpected
        self._holding: set[int] = set()  # peers told to hold back frames we did not post
        self._held_off: dict[int, set[Key]] = {}  # peers that told us so: keys they posted since
        self._deferred: dict[int, list[tuple[Operation, bytes, memoryview]]] = {}  # kept back
        self.held_peak = 0  # the most bytes ever held at once (tests and diagnostics)
        self._peer_timeout = settings.peer_timeout
        # A beat every 1/40 of the timeout (at most 1 s), and a peer counts as silent only once
        # it missed a beat past the timeout: detection lands within ~2 beats after the timeout.
        self._beat_every = min(1.0, max(0.02, settings.peer_timeout / 40))
        self._last_beat = time.monotonic()
        self._heard = {p: self._last_beat for p in range(world_size) if p != rank}
        self._stall = StallInspector(rank, world_size, settings.stall_warning)
        self.flight = FlightRecorder(rank, world_size, settings.flight_records, describe)
        self.transport = make_transport(self)
        self._thread = threading.Thread(
            target=self._run, name=f"asyncreduce-engine-{rank}", daemon=True
        )
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------------

    def submit(self, op: Operation) -> None:
        """Hand an operation to the engine; raises ClosedError or BrokenError if it cannot run."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"{op.label}: the communicator is closed")
            if self._broken is not None:
                raise BrokenError(
                    f"{op.label}: the communicator is broken: {self._broken}"
                ) from self._broken
            if self._departed:
                raise BrokenError(f"{op.label}: {next(iter(self._departed.values()))}")
            self._submitted.append(op)
            sleeping = self._sleeping  # read after the append, under the lock: see _poll
        if sleeping:
            self.transport.wakeup()

    def close(self) -> None:
        """Fail what is pending with ClosedError, close every socket, join the thread."""
        self._shut(None)

    def abort(self, reason: str = "") -> None:
        """Break the communicator on every rank now and close it, within about 1 s: pending
        requests fail with BrokenError, peers are told with an ABORT frame."""
        self._shut(reason or "abort() was called")

    def _shut(self, abort_reason: str | None) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._aborting = abort_reason
                self._submitted.append(None)
        self._closing.set()
        self.transport.wakeup()
        if self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def broken(self) -> BaseException | None:
        return self._broken

    @property
    def stall_reports(self) -> list[str]:
        """The stall warnings this rank gave, newest last."""
        return list(self._stall.reports)

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        np.seterr(all="ignore")  # this thread only: overflow is the caller's data, not our warning
        try:
            while self._take_submitted():
                self._poll()
                if self._working:
                    self._work()
                self._expire()
                self._beat()
            self._say_goodbye(_ABORT_LINGER if self._aborting is not None else _LINGER)
        except BaseException as exc:  # a bug: fail loudly, never hang the callers
            log.exception("asyncreduce progress thread crashed")
            self._break(BrokenError(f"rank {self.rank}: progress thread crashed: {exc!r}"))
            self._take_submitted()  # fails what was submitted meanwhile (the engine is broken)
            self._drain_until_close()
        finally:
            self.transport.close()

    def _say_goodbye(self, linger: float) -> None:
        """Closing handshake: GOODBYE to all, then read until every peer has closed too."""
        self._stopping = True
        reason = f"it was broken: {self._broken}" if self._broken is not None else ""
        self.transport.send_goodbye(reason.encode()[:MAX_ERROR_BYTES])
        deadline = time.monotonic() + linger
        while self.transport.open_peers() and time.monotonic() < deadline:
            self.transport.poll(max(0.0, deadline - time.monotonic()))

    def _drain_until_close(self) -> None:
        """After a crash: new posts fail at once (the engine is broken); wait for close()."""
        self._closing.wait()
        self._take_submitted()

    def _take_submitted(self) -> bool:
        """Start what was submitted; False once close() was asked for."""
        while self._submitted:  # read without the lock: only this thread takes from it
            with self._lock:
                op = self._submitted.popleft()
            if op is None:
                if self._aborting is not None:
                    self._break(BrokenError(f"rank {self.rank} aborted: {self._aborting}"))
                self._close_all()
                return False
            if self._broken is not None:
                self._fail(op, broken_by(op, self._broken))
            else:
                self._start(op)
        return True

    def _close_all(self) -> None:
        with self._lock:
            late = [op for op in self._submitted if op is not None]
            self._submitted.clear()
        for op in list(self._ops.values()) + late:
            self._fail(
                op, ClosedError(f"{op.label}: the communicator was closed while it was pending")
            )

    def _poll(self) -> None:
        """Move bytes. For ``settings.spin`` after a small operation started, received a
        frame or ended, busy-poll (yielding the core to any thread that wants it): a thread
        woken by the kernel for every frame and every post adds tens of microseconds to an
        operation that lasts about as long, and small operations tend to come in runs.
        Otherwise block until the next beat or deadline, or until ``submit`` wakes us.

        No lost wake-up: ``_sleeping`` is set, and the queue looked at once more, under the
        lock that ``submit`` holds to append and then read ``_sleeping``."""
        if self._working:  # work waits: only look at what came in
            self.transport.poll(0.0)
            return
        if time.monotonic() < self._spin_until:
            self.transport.poll(0.0)
            os.sched_yield()
            return
        with self._lock:
            self._sleeping = True
            empty = not self._submitted
        self.transport.poll(self._poll_timeout() if empty else 0.0)
        self._sleeping = False

    def _spin_after(self, op: Operation) -> None:
        """A small operation started, heard from a peer or ended: busy-poll a while (_poll)."""
        if op.small:
            self._spin_until = time.monotonic() + self.settings.spin

    def _poll_timeout(self) -> float:
        until_beat = self._last_beat + self._beat_every - time.monotonic()
        until_deadline = self._deadlines[0][0] - time.monotonic() if self._deadlines else 1.0
        return max(0.0, min(1.0, until_beat, until_deadline))

    def _beat(self) -> None:
        """Every beat: tell every peer we are alive; fail what waits on a silent one; ask about
        stalled operations."""
        now = time.monotonic()
        if now - self._last_beat < self._beat_every:
            return
        self._last_beat = now
        for peer in self._heard:
            if peer not in self._departed:
                self._send_control(peer, _BEAT, b"")
        limit = self._peer_timeout + self._beat_every
        silent = {p for p, heard in self._heard.items() if now - heard > limit}
        for op in list(self._ops.values()):
            # waiting for a silent rank's data, or for room to send (a silent rank reads nothing)
            stuck = silent if op.unsent else silent & op.algo.pending_sources
            if stuck:
                why = f"{ranks_phrase(stuck)} sent nothing for {self._peer_timeout:g} s"
                self._fail_everywhere(op, TimeoutError(
                    f"{op.label} failed on rank {self.rank}: {why}, not even a heartbeat "
                    "(stopped, or cut off?)"))  # fmt: skip
        self._inspect_stalls(now)

    def _inspect_stalls(self, now: float) -> None:
        self._stall.overdue(now)
        for op in list(self._ops.values()):
            if self._stall.due(op.key, op.started, now):
                self._stall.asked(op.key, op.label, op.started, now)
                head = pack_header(INQUIRY, op.key[0], op.key[1], 0, ASK, 0, op.desc)
                for peer in range(self.world_size):
                    if peer != self.rank:
                        self._send_control(peer, head, b"")

    def _on_inquiry(self, peer: int, header: Header) -> None:
        if header.seg == POSTED:
            released = self._held_off.get(peer)
            if released is not None:
                released.add(header.key)
                self._release(peer, header.key)
            return
        if header.seg != ASK:
            self._stall.answered(header.key, peer, header.seg)
            return
        key = header.key
        answer = (
            PENDING if key in self._ops
            else DONE if key in self._done
            else FAILED if key in self._failed
            else NOT_POSTED
        )  # fmt: skip
        head = pack_header(INQUIRY, key[0], key[1], 0, answer, 0, header.desc)
        self._send_control(peer, head, b"")

    def _start(self, op: Operation) -> None:
        if self._departed:
            self._fail(op, BrokenError(f"{op.label}: {next(iter(self._departed.values()))}"))
            return
        earlier = self._failed.get(op.key)
        if earlier is not None:
            self._fail(op, _same_error(earlier, str(earlier)))
            return
        self._ops[op.key] = op
        op.small = _payload_bytes(op.desc) <= SMALL_ALLREDUCE_BYTES
        self._spin_after(op)
        for peer in self._holding:
            self._send_control(peer, _posted(op), b"")
        op.age = next(self._order)
        op.started = time.monotonic()
        op.record = self.flight.add(Record(*op.key, op.desc, op.priority, op.posted_at))
        if op.timeout is not None:
            op.deadline = time.monotonic() + op.timeout
            heapq.heappush(self._deadlines, (op.deadline, next(self._order), op))
        if self._guarded(op, op.algo.start):
            for peer, header, payload in self._take_held(op.key):
                accepted = self._accept(op, peer, header, payload)
                self._spares.give(payload)
                if not accepted:
                    break
        self._maybe_complete(op)

    def _guarded(self, op: Operation, step: Callable[[], list[Send]]) -> bool:
        """Run one algorithm step and send what it returns; a failure fails the operation."""
        try:
            sends = step()
        except ProtocolError as exc:
            self._fail_everywhere(op, MismatchError(f"{op.label}: rank {self.rank}: {exc}"))
            return False
        except PeerMemoryError as exc:  # cma.py: the peer died, or announced bad memory
            self._fail_everywhere(op, BrokenError(f"{op.label}: rank {self.rank}: {exc}"))
            return False
        except Exception as exc:
            log.exception("%s failed in its algorithm", op.label)
            self._fail_everywhere(op, BrokenError(f"{op.label}: rank {self.rank}: {exc!r}"))
            return False
        # A frame may leave at once and report itself sent: hold completion until every frame
        # of this step is handed over, or an operation whose algorithm is already done (a
        # broadcast's root) would complete after its first frame, with the rest still to send
        # from the caller's buffer.
        op.unsent += 1
        try:
            for s in sends:
                self._send(op, s)
        finally:
            op.unsent -= 1
        live = self._ops.get(op.key) is op
        if live and op.algo.has_work:
            self._working.add(op)
        return live

    def _work(self) -> None:
        """One unit of the most urgent operation's own work (the highest priority, then the
        oldest): between units the loop reads what came in, so a small urgent operation is
        not stuck behind a large one's reductions for longer than one segment."""
        op = max(self._working, key=lambda o: (o.priority, -o.age))
        if self._guarded(op, op.algo.work):
            self._maybe_complete(op)
        if not op.algo.has_work:
            self._working.discard(op)

    def _send(self, op: Operation, s: Send) -> None:
        if s.dst in self._departed:
            return  # it closed in good order, so it needs nothing more from us
        payload = _bytes_of(s.payload)
        head = pack_header(DATA, op.key[0], op.key[1], s.step, s.seg, payload.nbytes, op.desc)
        op.unsent += 1
        released = self._held_off.get(s.dst)
        if released is not None and op.key not in released:
            self._deferred.setdefault(s.dst, []).append((op, head, payload))  # until posted there
            return
        self.transport.send(s.dst, head, payload, op.priority, op, op.age)

    def _maybe_complete(self, op: Operation) -> None:
        if op.unsent or not op.algo.done or self._ops.get(op.key) is not op:
            return
        del self._ops[op.key]
        self._remember_done(op)
        self._ended(op)
        try:
            value = op.result()
        except Exception as exc:
            self._finish_record(op, exc)
            op.request.set_exception(exc)
            return
        self._finish_record(op, None)
        op.request.set_result(value)
        if op.small and self.settings.spin:
            os.sched_yield()  # the waiter runs now, not after another round of the loop

    def _fail(self, op: Operation, error: BaseException) -> None:
        """Fail ``op`` at once; from here on nothing reads or writes the caller's buffer."""
        if self._ops.get(op.key) is op:
            del self._ops[op.key]
            self._remember_failed(op.key, error)
            self._ended(op)
            self._finish_record(op, error)
            self.transport.drop(op)
            for peer, (landing, _) in list(self._landing.items()):
                if landing is op:
                    self.transport.divert(peer)
                    del self._landing[peer]
        if not op.request.done():
            op.request.set_exception(error)

    def _ended(self, op: Operation) -> None:
        """Forget what the stall inspector and flow control kept about ``op``."""
        self._spin_after(op)
        self._working.discard(op)
        self._stall.forget(op.key)
        for released in self._held_off.values():
            released.discard(op.key)

    def _finish_record(self, op: Operation, error: BaseException | None) -> None:
        if op.record is not None:
            self.flight.finish(op.record, error)
        if log_ops.isEnabledFor(logging.DEBUG):
            log_ops.debug("rank %d ends %s: %s", self.rank, op.label, error or "done")

    def _remember_done(self, op: Operation) -> None:
        """Keep the descriptor of a completed operation (bounded), to judge late frames for it."""
        self._done[op.key] = op.desc
        while len(self._done) > _FORGET_AFTER:
            self._done.popitem(last=False)
        if len(self._deadlines) > 64 and len(self._deadlines) > 2 * len(self._ops):
            live = [e for e in self._deadlines if self._ops.get(e[2].key) is e[2]]
            heapq.heapify(live)
            self._deadlines = live  # completed operations are not kept alive until their deadline

    def _late_frame(self, peer: int, header: Header) -> None:
        """A frame for an operation completed here: ranks disagreed in a way the operation could
        not see (a broadcast's root). Drop it and say so; nothing can fail retroactively."""
        desc = self._done[header.key]
        if header.desc != desc:
            log.error(
                "rank %d completed %r#%d as %s but rank %d posted %s; its data was ignored",
                self.rank, header.name.decode(errors="replace"), header.key[1],
                describe(desc), peer, describe(header.desc),
            )  # fmt: skip

    def _remember_failed(self, key: Key, error: BaseException) -> None:
        self._failed[key] = error
        for _, _, payload in self._take_held(key):
            self._spares.give(payload)
        while len(self._failed) > _FORGET_AFTER:
            self._failed.popitem(last=False)

    def _fail_everywhere(self, op: Operation, error: BaseException) -> None:
        """Fail ``op`` here, tell every other rank to fail it the same way; break the engine."""
        if self._ops.get(op.key) is not op:
            return
        self._fail(op, error)
        self._break(error, (op.key, op.desc))

    def _send_control(self, peer: int, head: bytes, message: bytes) -> None:
        try:
            self.transport.send(peer, head, memoryview(message), 1 << 30, None)
        except KeyError:
            pass  # that peer is gone already

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, op = heapq.heappop(self._deadlines)
            if self._ops.get(op.key) is op:
                waiting = ranks_phrase(op.algo.pending_sources)
                self._fail_everywhere(op, TimeoutError(
                    f"{op.label} did not complete within its timeout of {op.timeout} s on "
                    f"rank {self.rank} (still waiting for {waiting})"))  # fmt: skip

    def _break(self, error: BaseException, about: tuple[Key, Descriptor] | None = None) -> None:
        """The first failure: fail everything pending (chained to ``error``), refuse new posts,
        tell every peer, and write the flight record if asked to. If an operation failed first
        (``about``), peers are told with an ERROR frame for it, so that it fails with the same
        class everywhere; otherwise with an ABORT frame."""
        with self._lock:
            if self._broken is not None:
                return
            self._broken = error
        for op in list(self._ops.values()):
            self._fail(op, broken_by(op, error))
        self._deferred.clear()
        reason = str(error).encode()[:MAX_ERROR_BYTES]
        if about is None:
            head = pack_header(ABORT, b"", 0, 0, 0, len(reason), _NO_DESC)
        else:
            code = _ERROR_CODES.get(type(error), 3)  # type: ignore[arg-type]
            (name, instance), desc = about
            head = pack_header(ERROR, name, instance, 0, code, len(reason), desc)
        for peer in self._heard:
            if peer not in self._departed:
                self._send_control(peer, head, reason)
        self.flight.broken = f"{type(error).__name__}: {error}"
        if self.settings.flight_dir:
            try:
                where = self.flight.dump(self.settings.flight_dir)
                log.warning("rank %d broke; its flight record is in %s", self.rank, where)
            except OSError as exc:
                log.warning("rank %d could not write its flight record: %s", self.rank, exc)

    # ---- back-pressure -------------------------------------------------------------------------

    def _hold(self, peer: int, header: Header, payload: memoryview) -> None:
        """Keep a frame for an operation not posted here; past the cap, tell its sender to hold
        back the frames of operations this rank has not posted (naming those it has)."""
        self._unexpected.setdefault(header.key, []).append((peer, header, payload))
        self._held += payload.nbytes
        self.held_peak = max(self.held_peak, self._held)
        if self._held > self.settings.held_bytes and peer not in self._holding:
            self._holding.add(peer)
            self._send_control(peer, _HOLD, b"")
            for op in self._ops.values():
                self._send_control(peer, _posted(op), b"")

    def _take_held(self, key: Key) -> list[tuple[int, Header, memoryview]]:
        held = self._unexpected.pop(key, None)
        if held is None:
            return []
        self._held -= sum(p.nbytes for _, _, p in held)
        return held

    def _on_flow(self, peer: int, hold: bool) -> None:
        """``peer`` holds too much of ours: from now on send it only what it has posted."""
        if hold and peer not in self._held_off:
            self._held_off[peer] = set()
            taken = self.transport.withdraw(peer)
            kept = [(t, h, p) for h, p, t in taken if isinstance(t, Operation)]
            self._deferred[peer] = kept + self._deferred.get(peer, [])

    def _release(self, peer: int, key: Key) -> None:
        """Send the frames kept back for ``peer`` of operation ``key``."""
        kept = []
        for op, head, payload in self._deferred.pop(peer, []):
            if self._ops.get(op.key) is not op:
                continue  # failed meanwhile: nothing to send
            if op.key == key:
                self.transport.send(peer, head, payload, op.priority, op, op.age)
            else:
                kept.append((op, head, payload))
        if kept:
            self._deferred[peer] = kept

    # ---- FrameSink: called by the transport on this thread ---------------------------------

    def frame_buffer(self, peer: int, header: Header) -> memoryview | None:
        op = self._ops.get(header.key)
        if header.type != DATA:
            return None
        if op is None:  # not posted here yet: it waits in a recycled buffer
            return self._spares.take(header.payload_len)
        if not self._matches(op, peer, header):
            return None
        try:
            target = op.algo.recv_buffer(peer, header.step, header.seg, header.payload_len)
        except ProtocolError as exc:
            self._fail_everywhere(op, MismatchError(f"{op.label}: rank {self.rank}: {exc}"))
            return None
        self._landing[peer] = (op, target)
        return _bytes_of(target)

    def frame_view(self, peer: int, header: Header, view: memoryview) -> bool:
        self._heard[peer] = time.monotonic()
        op = self._ops.get(header.key)
        if header.type != DATA or op is None:
            return False
        if not op.algo.takes_view(peer, header.step, header.seg):
            return False
        self._spin_after(op)
        if self._matches(op, peer, header) and self._guarded(
            op, lambda: op.algo.on_view(peer, header.step, header.seg, view)
        ):
            self._maybe_complete(op)
        return True

    def on_frame(self, peer: int, header: Header, payload: memoryview) -> None:
        self._heard[peer] = time.monotonic()
        if header.type == HEARTBEAT:
            return
        landed = self._landing.pop(peer, None)
        if header.type == GOODBYE:
            self._on_goodbye(peer, bytes(payload).decode(errors="replace"))
            return
        if self._stopping:
            return
        if header.type in (ERROR, ABORT, INQUIRY, FLOW):
            self._on_control(peer, header, payload)
            return
        op = self._ops.get(header.key)
        if op is None:
            if header.key in self._done:
                self._late_frame(peer, header)
            elif header.key not in self._failed and self._broken is None:
                self._hold(peer, header, payload)
            return
        self._spin_after(op)
        if landed is not None and landed[0] is op:
            target = landed[1]
            if self._guarded(op, lambda: op.algo.on_message(peer, header.step, header.seg, target)):
                self._maybe_complete(op)
        elif self._accept(op, peer, header, payload):
            self._spares.give(payload)
            self._maybe_complete(op)

    def _accept(self, op: Operation, peer: int, header: Header, payload: memoryview) -> bool:
        """Deliver a frame that was received before ``op`` was posted: the algorithm reads it
        from the held buffer (a reduction reads it in place; anything else copies it once)."""
        if not self._matches(op, peer, header):
            return False
        return self._guarded(op, lambda: op.algo.on_view(peer, header.step, header.seg, payload))

    def _matches(self, op: Operation, peer: int, header: Header) -> bool:
        if header.desc == op.desc:
            return True
        self._fail_everywhere(op, MismatchError(
            f"{op.label}: rank {self.rank} posted {describe(op.desc)} but rank {peer} posted "
            f"{describe(header.desc)}{_hint(op.desc, header.desc)}"))  # fmt: skip
        return False

    def _on_control(self, peer: int, header: Header, payload: memoryview) -> None:
        if header.type == FLOW:
            self._on_flow(peer, header.instance == 1)
            return
        if header.type == INQUIRY:
            self._on_inquiry(peer, header)
            return
        text = bytes(payload).decode(errors="replace")
        if header.type == ABORT:
            self._break(BrokenError(f"rank {peer} broke ({text}), so this rank broke too"))
            return
        cls = _ERROR_KINDS.get(header.seg, BrokenError)
        error = cls(f"{text} (reported by rank {peer})")
        op = self._ops.get(header.key)
        if op is not None:
            self._fail(op, error)
        else:
            self._remember_failed(header.key, error)
        self._break(error, (header.key, header.desc))  # passed on: everyone fails it alike

    def _on_goodbye(self, peer: int, reason: str) -> None:
        """``peer`` closed in good order: fail what still needs it (``pending_sources``: a
        frame to come, or its memory still to be read), on every rank (the others may need it
        through us); refuse new posts. Its frames came before its goodbye, so an operation that
        no longer waits on it can still complete."""
        gone = f"rank {peer} has closed its communicator" + (f" ({reason})" if reason else "")
        with self._lock:
            self._departed[peer] = gone
        for op in list(self._ops.values()):
            if peer in op.algo.pending_sources:
                self._fail_everywhere(
                    op, BrokenError(f"{op.label} still needed rank {peer}, but {gone}")
                )
        self.transport.release(peer)

    def on_sent(self, token: object) -> None:
        if isinstance(token, Operation):
            token.unsent -= 1
            self._maybe_complete(token)

    def on_peer_lost(self, peer: int, error: BaseException) -> None:
        with self._lock:
            closing = self._closed
        if not closing and peer not in self._departed:
            self._break(
                BrokenError(f"rank {self.rank} lost its connection to rank {peer} ({error})")
            )


def _bytes_of(array: Array) -> memoryview:
    """The bytes of a contiguous array, writable where the array is."""
    return memoryview(array).cast("B")  # type: ignore[arg-type]


def _hint(mine: Descriptor, theirs: Descriptor) -> str:
    """What to do about a mismatch where the only difference is where the buffers live."""
    if mine.kind == theirs.kind == KINDS["allreduce"] and mine._replace(root=0) == theirs._replace(
        root=0
    ):
        return (
            ": allocate that buffer with comm.shared_empty on every rank, or on none (a "
            "window's number must match too: call shared_empty in the same order everywhere)"
        )
    return ""


def _payload_bytes(desc: Descriptor) -> int:
    dtype = DTYPE_BY_CODE.get(desc.dtype)
    return desc.count * (dtype.itemsize if dtype is not None else 1)


def _posted(op: Operation) -> bytes:
    """The flow-control frame that says ``op`` is posted here."""
    return pack_header(INQUIRY, op.key[0], op.key[1], 0, POSTED, 0, op.desc)


def broken_by(op: Any, cause: BaseException) -> BrokenError:
    """The error of an operation (anything with a ``label``) that fails because the
    communicator broke: ``cause`` chained. The ordered engine's failures are worded alike."""
    error = BrokenError(f"{op.label} failed: the communicator is broken: {cause}")
    error.__cause__ = cause
    return error


def _same_error(error: BaseException, message: str) -> BaseException:
    """A new exception of the same class as ``error`` with ``message``, chained to it."""
    new = type(error)(message)
    new.__cause__ = error
    return new
