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
the last event and every ``_POLL`` seconds after that (or, while the only calls running are
an adapter's helper thread's, until one ends, an operation is posted, or a beat or deadline
is due). Nothing it calls blocks, so deadlines, heartbeats and close always get their turn.

Failure is sticky as in the native engine: the first failure (a mismatch found in the
agreement, a per-call timeout, an engine error, a silent or departed peer, ``abort``) fails
every pending request here with ``BrokenError`` chained to it, and a BREAK message tells the
other ranks, which fail the same operation with the same class (failure.py). Engine calls
already issued cannot be taken back (MPI has no cancel for collectives): after a break they
are abandoned. Fusion is in fusion.py; heartbeats, deadlines and stalls in liveness.py.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import BrokenError, ClosedError, MismatchError, ranks_phrase
from ...flight import FlightRecorder, Record
from ...keys import Key
from ...protocol import Settings, broken_by, describe
from .agreement import Agreed, Agreement, Entry
from .channel import BEAT, BREAK, GOODBYE, ROUND, Channel
from .failure import break_error, break_message, read_break, run_on_scratch
from .fusion import Call, complete, fuse, fusion_bytes_from_env, pack
from .liveness import Liveness
from .posted import Adapter, Posted

__all__ = ["OrderedEngine"]

log = logging.getLogger("asyncreduce.ordered")
_POLL, _POLL_MAX = 50e-6, 500e-6  # seconds between polls past the spin: doubling while
# nothing moves (a long transfer over TCP needs little attention; every test costs CPU the
# caller's computation could use: bench overlap --hosts), back to the least at each event
_LINGER = 2.0
#: close() waits this long for the thread at most: its goodbye takes up to 3 lingers (calls,
#: peers' goodbyes, sends), and nothing it calls blocks; past it, close() returns anyway
_JOIN = 3 * _LINGER + 2.0
_ABANDONED: list[Any] = []  # calls still in the engine when their thread ended: kept alive


class OrderedEngine:
    """Runs one communicator's operations on ``make_adapter()``'s engine (module docstring)."""

    ordered = True

    def __init__(
        self, rank: int, world_size: int, make_adapter: Callable[[], Adapter],
        settings: Settings | None = None, fusion_bytes: int | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings or Settings()
        self.rank, self.world_size = rank, world_size
        self.fusion_bytes = fusion_bytes_from_env() if fusion_bytes is None else fusion_bytes
        self.flight = FlightRecorder(rank, world_size, self.settings.flight_records, describe)
        self._liveness = Liveness(rank, self.settings.peer_timeout, self.settings.stall_warning)
        self.stall_reports = self._liveness.stall_reports
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
        self._calls: list[Call] = []
        self._started = threading.Event()
        self._wake = threading.Event()  # ends a nap: a helper thread's call ended, or a post
        self._napping = False
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
            if self._napping:  # (a nap through a helper's long call: offer this one now)
                self._wake.set()

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
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN)
            if self._thread.is_alive():  # a bug, or an engine call that blocked after all
                log.warning("rank %d: the ordered engine thread did not end within %.0f s of "
                            "close(); it is left behind", self.rank, _JOIN)  # fmt: skip

    # ---- the thread --------------------------------------------------------------------------

    def _run(self, make_adapter: Callable[[], Adapter]) -> None:
        np.seterr(all="ignore")
        try:
            self.adapter = make_adapter()
            if hasattr(self.adapter, "wake"):
                self.adapter.wake = self._wake.set
            self._channel = Channel(self.adapter.endpoint, self.rank, self.world_size)
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        self._liveness.start(self.world_size, time.monotonic())
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
                if self._calls and all(getattr(c.running, "wakes", False) for c in self._calls):
                    self._nap(self._liveness.until_due(now))  # (its end wakes us; a post too)
                else:
                    self._nap(nap)
                    nap = min(2 * nap, _POLL_MAX)
            elif not moved:
                os.sched_yield()

    def _nap(self, seconds: float) -> None:
        """Sleep ``seconds``, or until a helper's call ends or something is submitted."""
        self._napping = True
        if self._wake.wait(seconds):
            self._wake.clear()
        self._napping = False

    def _take(self, block: bool) -> tuple[bool, bool]:
        """Take submitted operations: (closing, took any)."""
        took = False
        if not block and self._queue.empty():  # (the common case, without an exception)
            return False, False
        try:
            beat = self._liveness.beat_every
            item = self._queue.get(timeout=beat) if block else self._queue.get_nowait()
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
        self._liveness.watch(op, len(self._posted) + sum(len(c.ops) for c in self._calls))
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
            why = f"rank {self.rank}: the control channel failed: {exc}"
            if isinstance(exc, TimeoutError):  # the channel found a silent peer first
                self._fail_silent(why)
            else:
                self._break(BrokenError(why))
            return True

    def _read_channel(self) -> bool:
        moved = False
        for peer, kind, body in self._channel.poll():
            moved = True
            self._liveness.heard[peer] = time.monotonic()
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
            self._liveness.agreed(a.key)
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
        for group in fuse(ops, self.fusion_bytes):
            self._issue(group)

    def _issue(self, group: list[Posted]) -> None:
        assert self.adapter is not None
        first = group[0]
        scratch = pack(group)
        try:
            running = self.adapter.start(first, first.flat if scratch is None else scratch)
        except Exception as exc:
            why = f"the {self.adapter.name} engine refused it on rank {self.rank}: {exc}"
            self._fail_call(group, BrokenError(f"{first.label}: {why}"))
            return
        self.calls += 1
        self._calls.append(Call(group, running, scratch))

    def _poll_calls(self) -> bool:
        moved = False
        for call in list(self._calls):
            try:
                finished = call.running.done()
            except Exception as exc:
                self._calls.remove(call)
                name = self.adapter.name if self.adapter else "engine"
                cls = MismatchError if isinstance(exc, MismatchError) else BrokenError
                self._fail_call(call.ops, cls(f"{call.ops[0].label}: the {name} engine failed "
                                              f"on rank {self.rank}: {exc}"))  # fmt: skip
                return True
            if finished:
                moved = True
                self._calls.remove(call)
                complete(call, self.world_size, self.flight)
                os.sched_yield()  # let the waiter take the GIL now, not at the next switch
        return moved

    # ---- failure -----------------------------------------------------------------------------

    def _fail_everywhere(self, op: Posted, error: BaseException) -> None:
        """Fail ``op`` with ``error`` here and, with the same class, on every rank; break."""
        self._fail(op, error)
        self._break(error, op)

    def _fail_call(self, ops: list[Posted], error: BaseException) -> None:
        """Fail every operation of one engine call (that failed, or never started); break."""
        for op in ops:
            self._fail(op, error)
        self._break(error, ops[0])

    def _fail(self, op: Posted, error: BaseException) -> None:
        """Fail ``op``'s request. Peers may still agree it (this rank offered it), and then
        they need this rank in the engine call: it stays posted, on a scratch copy, so the
        caller's memory is free from now on; an op issued already stays in the engine."""
        if op.key in self._posted and not op.request.done():
            run_on_scratch(op, self.rank)  # (failure.py: it stays offered, for the peers)
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
        for op in self._pending():  # (engine calls go on: MPI has no cancel, peers are in them)
            self._fail(op, broken_by(op, error))
        self._tell_all(BREAK, break_message(error, about.key if about is not None else None))
        if self.settings.flight_dir:
            try:
                self.flight.dump(self.settings.flight_dir)
            except OSError as exc:
                log.warning("rank %d could not write its flight record: %s", self.rank, exc)

    def _on_break(self, peer: int, body: bytes) -> None:
        code, key, reason = read_break(peer, body)
        op = self._live(key) or next((o for c in self._calls for o in c.ops if o.key == key), None)
        error = break_error(code, peer, op.label if op is not None else None, reason)
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
        liveness = self._liveness
        while (op := liveness.next_expired(now)) is not None:
            if not op.request.done():
                self._fail_everywhere(op, TimeoutError(
                    f"{op.label} did not complete within its timeout of {op.timeout} s on "
                    f"rank {self.rank} ({self._waiting_for(op)})"))  # fmt: skip
        if liveness.beat_due(now):
            self._tell_all(BEAT)
            self._check_liveness(now)
            liveness.inspect_stalls(now, self._posted, self._waiting_for)

    def _tell_all(self, kind: int, body: bytes = b"") -> None:
        """``kind`` to every peer still here (GOODBYE: to every peer, since one that said
        goodbye first waits for ours); a channel that failed only loses the message."""
        for peer in self._liveness.heard:
            if peer not in self._departed or kind == GOODBYE:
                try:
                    self._channel.send(peer, kind, body)
                except Exception as exc:
                    log.debug("rank %d: no control message to rank %d: %s", self.rank, peer, exc)

    def _live(self, key: Key) -> Posted | None:
        """The posted, not yet agreed operation ``key`` whose request is still pending."""
        op = self._posted.get(key)
        return op if op is not None and not op.request.done() else None

    def _pending(self) -> list[Posted]:
        """Every operation not yet agreed, or in an engine call."""
        return [*self._posted.values(), *(o for c in self._calls for o in c.ops)]

    def _check_liveness(self, now: float) -> None:
        if self._broken is not None or not (self._posted or self._calls):
            return
        why = self._liveness.silence(now, self._departed)
        if why is not None:
            self._fail_silent(why)

    def _fail_silent(self, why: str) -> None:
        """A peer is silent (seen here, or by the control channel, whichever first): what
        waits fails with the TimeoutError itself, as natively, then the engine breaks."""
        for op in self._pending():
            self._fail(op, TimeoutError(f"{op.label}: {why}"))
        self._break(TimeoutError(why))

    def _waiting_for(self, op: Posted) -> str:
        if op.key in self._posted:
            missing = set(range(self.world_size)) - self._agreement.posted_by(op.key)
            return f"not posted by {ranks_phrase(missing)}"
        return "agreed; the engine has not finished it"

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
            len(self._departed) < len(self._liveness.heard) or self._calls
        ):
            if not (self._poll_channel() | self._poll_calls()):
                time.sleep(_POLL if self._calls else 1e-3)
        self._channel.drain_sends(linger)

    def _fail_left(self) -> None:
        """Fail every request still pending as the thread ends (a crash, a failed break), and
        what was submitted but never taken."""
        cause = self._broken or ClosedError("the communicator was closed")
        left = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                left.append(item)
        for op in [*left, *self._pending()]:
            if not op.request.done():
                op.request.set_exception(broken_by(op, cause))

    def _close_adapter(self) -> None:
        if self.adapter is not None:
            try:
                self.adapter.close(pending=bool(self._calls))
            except Exception as exc:
                log.debug("closing the %s adapter: %s", self.adapter.name, exc)
