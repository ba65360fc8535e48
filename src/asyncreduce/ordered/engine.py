"""The ordered engine: one thread that owns an engine needing one order (MPI, torch.distributed)
and runs our key-matched operations on it.

Theory of operation. Callers ``submit`` a ``Posted`` operation (a queue put). The thread:
takes what was submitted and offers each collective to the agreement (agreement.py), whose
contributions travel on the control channel (channel.py); runs what became agreed, in the
agreed order, as engine calls (fusing small allreduces of one dtype and reduction into one
call); tests every running call (which is what makes MPI progress while the caller computes);
completes requests. Point-to-point operations need no agreement: MPI and Gloo already match a
send and a receive by source and tag in the order posted, as we do.

It sleeps only when nothing is pending anywhere it knows of (blocking on its queue, waking
for heartbeats); while an operation is pending it polls, busily for ``spin`` seconds after
the last event and every ``_POLL`` seconds after that.

Failure is sticky as in the native engine: the first failure (a mismatch found in the
agreement, a per-call timeout, an engine error, a silent or departed peer, ``abort``) fails
every pending request here with ``BrokenError`` chained to it, and a BREAK message tells the
other ranks, which fail the same operation with the same class. Engine calls already issued
cannot be taken back (MPI has no cancel for collectives): after a break they are abandoned.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..algorithms import DType
from ..algorithms.reduction import finalize
from ..engine import Settings, broken_by, describe
from ..errors import BrokenError, ClosedError, MismatchError, ranks_phrase
from ..flight import FlightRecorder, Record
from ..request import Request
from ..transport.frame import Descriptor
from .agreement import Agreed, Agreement, Entry
from .channel import BEAT, BREAK, GOODBYE, ROUND, Channel, Endpoint

__all__ = ["OrderedEngine", "Posted", "Adapter", "Running", "FUSION_BYTES"]

log = logging.getLogger("asyncreduce.ordered")
Key = tuple[bytes, int]
_POLL, _POLL_MAX = 50e-6, 500e-6  # seconds between polls past the spin: doubling while
# nothing moves (a long transfer over TCP needs little attention; every test costs CPU the
# caller's computation could use: bench overlap --hosts), back to the least at each event
_LINGER = 2.0
#: Agreed allreduces up to this many bytes each, of one dtype and reduction, run as one engine
#: call of up to this many bytes (ASYNCREDUCE_FUSION_BYTES; 0: never). Chosen by measurement:
#: docs/engines.md.
FUSION_BYTES = 64 << 10
_ERROR_CLASSES: dict[int, type[Exception]] = {1: MismatchError, 2: TimeoutError, 3: BrokenError}
_ERROR_CODES = {cls: code for code, cls in _ERROR_CLASSES.items()}
_BREAK_HEAD = struct.Struct("<BHQ")  # error class code, key name length, key instance
_ABANDONED: list[Any] = []  # calls still in the engine when their thread ended: kept alive


@dataclass(eq=False)
class Posted:
    """One operation as the caller posted it: what the engine call needs, and the request."""

    key: Key
    label: str
    desc: Descriptor
    kind: str
    flat: Any  # the caller's memory: a flat numpy array, or a torch tensor on a device
    dtype: DType
    op: str | None
    root: int
    request: Request[Any]
    result: Callable[[], Any]
    priority: int = 0
    timeout: float | None = None
    sends: dict[int, Any] | None = None  # exchanges and point-to-point: {peer: flat array}
    recvs: dict[int, Any] | None = None
    tag: int | None = None  # point-to-point only
    ready: Any = None  # a CUDA event recorded on the producer's stream at post
    record: Record | None = field(default=None, init=False)
    started: float = field(default_factory=time.monotonic, init=False)


class Running(Protocol):
    """An engine call in flight: ``done`` tests it without blocking and raises its failure."""

    def done(self) -> bool: ...


class Adapter(Protocol):
    """What an engine offers the ordered engine (mpi.py, torchdist.py)."""

    name: str
    endpoint: Endpoint

    def start(self, op: Posted, flat: Any) -> Running:
        """Issue ``op``'s call over ``flat`` (its memory, or a fused scratch of several)."""
        ...

    def close(self, pending: bool) -> None:
        """Release the engine's resources (``pending``: calls are still in it)."""
        ...


@dataclass(eq=False)
class _Call:
    ops: list[Posted]
    running: Running
    scratch: Any = None  # fused: the packed buffer


class OrderedEngine:
    """Runs one communicator's operations on ``make_adapter()``'s engine (module docstring)."""

    ordered = True

    def __init__(
        self, rank: int, world_size: int, make_adapter: Callable[[], Adapter],
        settings: Settings | None = None, fusion_bytes: int | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings or Settings()
        self.rank, self.world_size = rank, world_size
        self.fusion_bytes = _fusion_bytes() if fusion_bytes is None else fusion_bytes
        self.flight = FlightRecorder(rank, world_size, self.settings.flight_records, describe)
        self.stall_reports: list[str] = []
        self.adapter: Adapter | None = None
        self.calls = 0  # engine calls issued (fusion makes this smaller than the operations)
        self._queue: queue.SimpleQueue[Posted | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._abort: str | None = None
        self._broken: BaseException | None = None
        self._departed: dict[int, str] = {}
        self._agreement = Agreement(rank, world_size)
        self._posted: dict[Key, Posted] = {}  # not yet agreed (collectives)
        self._calls: list[_Call] = []
        self._deadlines: list[tuple[float, int, Posted]] = []
        self._order = itertools.count()
        self._peer_timeout = self.settings.peer_timeout
        self._beat_every = min(1.0, max(0.02, self._peer_timeout / 40))
        self._last_beat = 0.0
        self._heard: dict[int, float] = {}
        self._warned: dict[Key, float] = {}
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(make_adapter,), name=f"asyncreduce-ordered-{rank}", daemon=True
        )
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    # ---- any thread --------------------------------------------------------------------------

    def submit(self, op: Posted) -> None:
        """Hand ``op`` to the thread; ClosedError or BrokenError if it cannot run."""
        with self._lock:
            if self._broken is not None:
                raise BrokenError(f"{op.label}: the communicator is broken: {self._broken}"
                                  ) from self._broken  # fmt: skip
            if self._closed:
                raise ClosedError(f"{op.label}: the communicator is closed")
            if self._departed:
                raise BrokenError(f"{op.label}: {next(iter(self._departed.values()))}")
            at_post = getattr(self.adapter, "at_post", None)
            if at_post is not None:
                at_post(op)
            self._queue.put(op)

    def close(self) -> None:
        """Finish what is running (up to 2 s), fail what is not agreed, say goodbye, join."""
        self._shut(None)

    def abort(self, reason: str = "") -> None:
        """Break every rank's communicator now; return without waiting for anybody."""
        self._shut(reason or "abort() was called")

    @property
    def broken(self) -> BaseException | None:
        return self._broken

    def _shut(self, abort: str | None) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed, self._abort = True, abort
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()

    # ---- the thread --------------------------------------------------------------------------

    def _run(self, make_adapter: Callable[[], Adapter]) -> None:
        np.seterr(all="ignore")
        try:
            self.adapter = make_adapter()
            self._channel = Channel(self.adapter.endpoint, self.rank, self.world_size)
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        now = time.monotonic()
        self._heard = {p: now for p in range(self.world_size) if p != self.rank}
        self._started.set()
        try:
            self._loop()
            self._goodbye()
        except BaseException as exc:  # a bug: fail loudly, never hang the callers
            log.exception("asyncreduce ordered engine thread crashed")
            self._break(BrokenError(f"rank {self.rank}: the ordered engine crashed: {exc!r}"))
        finally:
            with self._lock:
                self._closed = True
            self._fail_queued()
            self._fail_left()
            if self._calls:  # MPI may still read or write their memory: never free it
                _ABANDONED.extend(self._calls)
            self._close_adapter()

    def _loop(self) -> None:
        last_event, nap = time.monotonic(), _POLL
        while True:  # (once broken, failed ops left offered keep nobody spinning)
            busy = bool(self._calls) or (self._broken is None and bool(self._posted))
            idle = not busy and time.monotonic() - last_event > self.settings.spin
            stop, took = self._take(block=idle)  # (spin a while first: the next post is near)
            if stop:
                return
            moved = took | self._poll_channel() | self._poll_calls()
            now = time.monotonic()
            if moved:
                last_event, nap = now, _POLL
            self._housekeeping(now)
            if busy and not moved and now - last_event > self.settings.spin:
                time.sleep(nap)
                nap = min(2 * nap, _POLL_MAX)
            elif not moved:
                os.sched_yield()

    def _take(self, block: bool) -> tuple[bool, bool]:
        """Take submitted operations: (closing, took any)."""
        took = False
        if not block and self._queue.empty():  # (the common case, without an exception)
            return False, False
        try:
            item = self._queue.get(timeout=self._beat_every) if block else self._queue.get_nowait()
            while True:
                if item is None:
                    return True, took
                self._accept(item)
                took = True
                item = self._queue.get_nowait()
        except queue.Empty:
            return False, took

    def _accept(self, op: Posted) -> None:
        if self._broken is not None:
            op.request.set_exception(broken_by(op, self._broken))
            return
        if self._departed:  # (submitted before the goodbye was read): nobody can agree it
            why = next(iter(self._departed.values()))
            op.request.set_exception(BrokenError(f"{op.label}: {why}"))
            self._break(BrokenError(f"{why} while rank {self.rank} had {op.label} pending"))
            return
        op.record = self.flight.add(Record(*op.key, op.desc, op.priority, time.time()))
        if op.timeout is not None:
            heapq.heappush(self._deadlines, (op.started + op.timeout, next(self._order), op))
        if op.kind == "p2p":  # matched by the engine itself, by source and tag, in order
            self._issue([op])
            return
        self._posted[op.key] = op
        self._send_rounds(self._agreement.post(Entry(*op.key, op.desc, op.priority)))

    def _send_rounds(self, out: list[tuple[int, bytes]]) -> None:
        try:
            for peer, message in out:
                self._channel.send(peer, ROUND, message)
        finally:  # what was agreed runs, whatever happened to the messages
            self._run_agreed(self._agreement.take_agreed())

    def _poll_channel(self) -> bool:
        try:
            return self._read_channel()
        except Exception as exc:  # (a lost peer in the native endpoint, an MPI error, ...)
            self._break(BrokenError(f"rank {self.rank}: the control channel failed: {exc}"))
            return True

    def _read_channel(self) -> bool:
        moved = False
        for peer, kind, body in self._channel.poll():
            moved = True
            self._heard[peer] = time.monotonic()
            if kind == ROUND:
                self._send_rounds(self._agreement.receive(peer, body))
            elif kind == GOODBYE:
                self._on_goodbye(peer, body.decode(errors="replace"))
            elif kind == BREAK:
                self._on_break(peer, body)
        return moved

    # ---- running agreed operations -----------------------------------------------------------

    def _run_agreed(self, agreed: list[Agreed]) -> None:
        """Issue what every rank agreed, in order. A mismatch is seen by every rank in the same
        round: nobody runs that one, and every rank breaks; the rest of the round still runs
        everywhere (on scratch memory where the request failed), so no peer is left alone in
        an engine call."""
        ops = []
        for a in agreed:
            op = self._posted.pop(a.key, None)
            self._warned.pop(a.key, None)
            if op is None:  # cannot happen: every agreed key was posted here
                log.error("rank %d: agreed %r was never posted here", self.rank, a.key)
                continue
            if a.mismatch is not None:
                other, mine, theirs = a.mismatch
                self._fail_everywhere(op, MismatchError(
                    f"{op.label}: rank {self.rank} posted {describe(mine)} "
                    f"but rank {other} posted {describe(theirs)}"))  # fmt: skip
                continue
            ops.append(op)
        for group in _fuse(ops, self.fusion_bytes):
            self._issue(group)

    def _issue(self, group: list[Posted]) -> None:
        assert self.adapter is not None
        first = group[0]
        scratch = _pack(group) if len(group) > 1 else None
        try:
            running = self.adapter.start(first, first.flat if scratch is None else scratch)
        except Exception as exc:
            error = BrokenError(f"{first.label}: the {self.adapter.name} engine refused it on "
                                f"rank {self.rank}: {exc}")  # fmt: skip
            for op in group:
                self._fail(op, error)
            self._break(error, first)
            return
        self.calls += 1
        self._calls.append(_Call(group, running, scratch))

    def _poll_calls(self) -> bool:
        moved = False
        for call in list(self._calls):
            try:
                finished = call.running.done()
            except Exception as exc:
                self._calls.remove(call)
                name = self.adapter.name if self.adapter else "engine"
                cls = MismatchError if isinstance(exc, MismatchError) else BrokenError
                error = cls(f"{call.ops[0].label}: the {name} engine failed on rank "
                            f"{self.rank}: {exc}")  # fmt: skip
                for op in call.ops:
                    self._fail(op, error)
                self._break(error, call.ops[0])
                return True
            if finished:
                moved = True
                self._calls.remove(call)
                self._complete(call)
                os.sched_yield()  # let the waiter take the GIL now, not at the next switch
        return moved

    def _complete(self, call: _Call) -> None:
        at = 0
        for op in call.ops:
            n, at = op.flat.size, at + op.flat.size
            if op.request.done():  # failed meanwhile: it ran for the peers' sake; its memory
                continue  # is no longer the caller's to write
            if call.scratch is not None:
                op.flat[...] = call.scratch[at - n : at]
            if op.op == "avg" and isinstance(op.flat, np.ndarray):
                finalize(op.dtype, op.op, op.flat, self.world_size)
            if op.record is not None:
                self.flight.finish(op.record, None)
            try:
                value = op.result()
            except Exception as exc:
                op.request.set_exception(exc)
                continue
            op.request.set_result(value)

    # ---- failure -----------------------------------------------------------------------------

    def _fail_everywhere(self, op: Posted, error: BaseException) -> None:
        """Fail ``op`` with ``error`` here and, with the same class, on every rank; break."""
        self._fail(op, error)
        self._break(error, op)

    def _fail(self, op: Posted, error: BaseException) -> None:
        """Fail ``op``'s request. Peers may still agree it (this rank offered it), and then
        they need this rank in the engine call: it stays posted, on a scratch copy, so the
        caller's memory is free from now on; an op issued already stays in the engine."""
        if op.key in self._posted and not op.request.done():
            try:
                op.flat = _scratch(op.flat, op.ready)
                op.sends = {p: _scratch(a) for p, a in (op.sends or {}).items()}
                op.recvs = {p: _scratch(a) for p, a in (op.recvs or {}).items()}
            except Exception as exc:  # (out of memory): then it cannot run for anybody
                log.error("rank %d: no scratch copy of %s: %s", self.rank, op.label, exc)
        if op.record is not None and op.record.state == "pending":
            self.flight.finish(op.record, error)
        if not op.request.done():
            op.request.set_exception(error)

    def _break(self, error: BaseException, about: Posted | None = None) -> None:
        with self._lock:
            if self._broken is not None:
                return
            self._broken = error
        self.flight.broken = f"{type(error).__name__}: {error}"
        pending = list(self._posted.values()) + [op for c in self._calls for op in c.ops]
        for op in pending:  # (engine calls go on: MPI has no cancel, and peers are in them)
            self._fail(op, broken_by(op, error))
        name, instance = about.key if about is not None else (b"", 0)
        code = _ERROR_CODES.get(type(error), 3)  # type: ignore[arg-type]
        body = _BREAK_HEAD.pack(code, len(name), instance) + name + str(error).encode()[:4096]
        self._tell_all(BREAK, body)
        if self.settings.flight_dir:
            try:
                self.flight.dump(self.settings.flight_dir)
            except OSError as exc:
                log.warning("rank %d could not write its flight record: %s", self.rank, exc)

    def _on_break(self, peer: int, body: bytes) -> None:
        if len(body) < _BREAK_HEAD.size:
            raise BrokenError(f"rank {peer} sent a BREAK message of {len(body)} bytes")
        code, size, instance = _BREAK_HEAD.unpack_from(body)
        name = body[_BREAK_HEAD.size : _BREAK_HEAD.size + size]
        reason = body[_BREAK_HEAD.size + size :].decode(errors="replace")
        cls = _ERROR_CLASSES.get(code, BrokenError)
        op = self._live((name, instance)) or next(
            (o for c in self._calls for o in c.ops if o.key == (name, instance)), None
        )
        error = cls(f"{op.label if op else 'an operation'} failed on rank {peer}: {reason}"
                    if code != 3 else f"rank {peer} broke: {reason}")  # fmt: skip
        if op is not None:
            self._fail(op, error)
        self._break(error)

    def _on_goodbye(self, peer: int, reason: str) -> None:
        why = f"rank {peer} closed the communicator" + (f" ({reason})" if reason else "")
        with self._lock:
            self._departed[peer] = why
        live = [op for op in self._posted.values() if not op.request.done()]
        if live:
            self._break(BrokenError(f"{why} while rank {self.rank} had {live[0].label} pending"))

    # ---- time --------------------------------------------------------------------------------

    def _housekeeping(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, op = heapq.heappop(self._deadlines)
            if not op.request.done():
                self._fail_everywhere(op, TimeoutError(
                    f"{op.label} did not complete within its timeout of {op.timeout} s on "
                    f"rank {self.rank} ({self._waiting_for(op)})"))  # fmt: skip
        if now - self._last_beat >= self._beat_every:
            self._last_beat = now
            self._tell_all(BEAT)
            self._check_liveness(now)
            self._inspect_stalls(now)

    def _tell_all(self, kind: int, body: bytes = b"") -> None:
        """``kind`` to every peer still here; a channel that failed only loses the message."""
        for peer in self._heard:
            if peer not in self._departed:
                try:
                    self._channel.send(peer, kind, body)
                except Exception as exc:
                    log.debug("rank %d: no control message to rank %d: %s", self.rank, peer, exc)

    def _live(self, key: Key) -> Posted | None:
        """The posted, not yet agreed operation ``key`` whose request is still pending."""
        op = self._posted.get(key)
        return op if op is not None and not op.request.done() else None

    def _check_liveness(self, now: float) -> None:
        if self._broken is not None or not (self._posted or self._calls):
            return
        silent = [
            p
            for p, t in self._heard.items()
            if p not in self._departed and now - t > self._peer_timeout + self._beat_every
        ]
        if silent:  # what waits fails with the TimeoutError itself, as natively
            why = (
                f"rank {self.rank} heard nothing from {ranks_phrase(silent)} for "
                f"{self._peer_timeout} s (ASYNCREDUCE_PEER_TIMEOUT): dead or stopped?"
            )
            for op in [*self._posted.values(), *(o for c in self._calls for o in c.ops)]:
                self._fail(op, TimeoutError(f"{op.label}: {why}"))
            self._break(TimeoutError(why))

    def _waiting_for(self, op: Posted) -> str:
        if op.key in self._posted:
            missing = set(range(self.world_size)) - self._agreement.posted_by(op.key)
            return f"not posted by {ranks_phrase(missing)}"
        return "agreed; the engine has not finished it"

    def _inspect_stalls(self, now: float) -> None:
        after = self.settings.stall_warning
        if after <= 0:
            return
        for key, op in self._posted.items():
            due = now - op.started >= after and now - self._warned.get(key, -1e18) >= after
            if due and not op.request.done():
                self._warned[key] = now
                message = (f"stall: {op.label} posted on rank {self.rank} "
                           f"{now - op.started:.0f} s ago; {self._waiting_for(op)}")  # fmt: skip
                self.stall_reports.append(message)
                del self.stall_reports[:-100]
                log.warning("%s", message)

    # ---- closing -----------------------------------------------------------------------------

    def _goodbye(self) -> None:
        """Let running calls finish (peers need this rank in them), then GOODBYE to every peer
        and read until each said goodbye too (or the linger passed)."""
        linger = 0.5 if self._abort is not None else _LINGER
        if self._abort is not None:
            self._break(BrokenError(f"rank {self.rank} aborted: {self._abort}"))
        for op in list(self._posted.values()):
            self._fail(op, ClosedError(f"{op.label}: the communicator was closed"))
        deadline = time.monotonic() + linger
        while self._calls and time.monotonic() < deadline:
            if not self._poll_calls():
                time.sleep(_POLL)
        if self._calls:  # still in the engine: the peers hear BREAK before GOODBYE
            self._break(BrokenError(f"rank {self.rank} closed with {self._calls[0].ops[0].label} "
                                    "still running"))  # fmt: skip
        reason = f"it was broken: {self._broken}".encode()[:4096] if self._broken else b""
        self._agreement.stop()  # no new round: peers stop reading from us at our GOODBYE
        self._tell_all(GOODBYE, reason)
        # Until every peer said goodbye too (or the linger passed), keep answering rounds and
        # running what they agree: a peer may have agreed one of ours before it heard ours.
        while time.monotonic() < deadline + linger and (
            len(self._departed) < len(self._heard) or self._calls
        ):
            if not (self._poll_channel() | self._poll_calls()):
                time.sleep(_POLL if self._calls else 1e-3)
        self._channel.drain_sends(linger)

    def _fail_queued(self) -> None:
        """Fail what was submitted but never taken (the thread is ending)."""
        while True:
            try:
                op = self._queue.get_nowait()
            except queue.Empty:
                return
            if op is not None and not op.request.done():
                cause = self._broken or ClosedError("the communicator was closed")
                op.request.set_exception(broken_by(op, cause))

    def _fail_left(self) -> None:
        """Fail every request still pending as the thread ends (a crash, a failed break)."""
        cause = self._broken or ClosedError("the communicator was closed")
        for op in [*self._posted.values(), *(o for c in self._calls for o in c.ops)]:
            if not op.request.done():
                op.request.set_exception(broken_by(op, cause))

    def _close_adapter(self) -> None:
        if self.adapter is not None:
            try:
                self.adapter.close(pending=bool(self._calls))
            except Exception as exc:
                log.debug("closing the %s adapter: %s", self.adapter.name, exc)


def _fusion_bytes() -> int:
    text = os.environ.get("ASYNCREDUCE_FUSION_BYTES")
    if not text:
        return FUSION_BYTES
    from ..engine import _env_number

    return int(_env_number("ASYNCREDUCE_FUSION_BYTES", FUSION_BYTES, int, 0))


def _fuse(ops: list[Posted], limit: int) -> list[list[Posted]]:
    """Agreed operations as engine calls: small host allreduces of one dtype and reduction
    together (in the agreed order of their first member), everything else alone."""
    groups: list[list[Posted]] = []
    open_: dict[tuple[int, str | None], tuple[list[Posted], int]] = {}
    for op in ops:
        size = op.flat.nbytes if isinstance(op.flat, np.ndarray) else limit + 1
        if op.kind != "allreduce" or size > limit or limit == 0:
            groups.append([op])
            continue
        kind = (op.dtype.code, op.op)
        group, total = open_.get(kind, (None, 0))
        if group is None or total + size > limit:
            group, total = [], 0
            groups.append(group)
        group.append(op)
        open_[kind] = (group, total + size)
    return groups


def _scratch(flat: Any, ready: Any = None) -> Any:
    """A copy of an operation's memory to run it on once its caller has been told it failed
    (a device tensor: copied after its producer's kernels, on this thread's stream)."""
    if isinstance(flat, np.ndarray):
        return flat.copy()
    if ready is not None:
        import torch

        torch.cuda.current_stream(flat.device).wait_event(ready)
    return flat.clone()


def _pack(group: list[Posted]) -> Any:
    return np.concatenate([op.flat for op in group])
