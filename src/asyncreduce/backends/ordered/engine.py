"""The ordered engine: one thread that owns an engine needing one order (MPI, torch.distributed)
and runs our key-matched operations on it.

Theory of operation. Callers ``submit`` a ``Posted`` operation (a queue put). The thread:
takes what was submitted and offers each collective to the agreement (agreement.py), whose
contributions travel on the control channel (channel.py); runs what became agreed, in the
agreed order, as engine calls (calls.py; fusing small allreduces of one dtype and reduction
into one call: fusion.py); tests every running call (which is what makes MPI progress while
the caller computes); completes requests. Point-to-point operations need no agreement: MPI and
Gloo already match a send and a receive by source and tag in the order posted, as we do.

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
are abandoned. Heartbeats and deadlines are timed by protocol/liveness.py (as natively),
stalls by stalls.py; the goodbye of close() and abort(), and the end of the thread, are in
closing.py.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from ...errors import BrokenError, ClosedError, ranks_phrase
from ...flight import FlightRecorder, Record
from ...keys import Key
from ...protocol import Settings, broken_by, describe
from ...protocol.liveness import Liveness
from .agreement import Agreement, Entry
from .calls import CallRunner
from .channel import BEAT, BREAK, GOODBYE, ROUND, Channel
from .closing import JOIN, fail_left, release, say_goodbye
from .failure import Breaker
from .fusion import Call, fusion_bytes_from_env
from .posted import Adapter, Posted
from .stalls import Stalls

__all__ = ["OrderedEngine"]

log = logging.getLogger("asyncreduce.ordered")
_POLL, _POLL_MAX = 50e-6, 500e-6  # seconds between polls past the spin: doubling while
# nothing moves (a long transfer over TCP needs little attention; every test costs CPU the
# caller's computation could use: bench overlap --hosts), back to the least at each event


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
        self._liveness: Liveness[Posted] = Liveness(
            rank, world_size, self.settings.peer_timeout, time.monotonic()
        )  # (started again when the thread is: making the adapter may take long)
        self._stalls = Stalls(rank, self.settings.stall_warning)
        self.stall_reports = self._stalls.stall_reports
        self.adapter: Adapter | None = None
        self._queue: queue.SimpleQueue[Posted | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._abort: str | None = None
        self._agreement = Agreement(rank, world_size)
        self._posted: dict[Key, Posted] = {}  # not yet agreed (collectives)
        self._calls: list[Call] = []  # engine calls in flight (calls.py issues and tests them)
        self._breaker = Breaker(
            rank, self.flight, self.settings.flight_dir, self._lock, self._liveness,
            self._posted, self._calls, self._tell_all,
        )  # fmt: skip
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
            broken, departed = self._breaker.broken, self._breaker.departed
            if broken is not None:
                raise BrokenError(f"{op.label}: the communicator is broken: {broken}") from broken
            if self._closed:
                raise ClosedError(f"{op.label}: the communicator is closed")
            if departed:
                raise BrokenError(f"{op.label}: {next(iter(departed.values()))}")
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
        return self._breaker.broken

    @property
    def calls(self) -> int:
        """Engine calls issued (fusion makes this smaller than the operations)."""
        return self._runner.issued

    def _shut(self, abort: str | None) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed, self._abort = True, abort
        self._queue.put(None)
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN)
            if self._thread.is_alive():  # a bug, or an engine call that blocked after all
                log.warning("rank %d: the ordered engine thread did not end within %.0f s of "
                            "close(); it is left behind", self.rank, JOIN)  # fmt: skip

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
        self._runner = CallRunner(
            self.adapter, self.rank, self.world_size, self.flight, self._stalls, self._posted,
            self._calls, self._breaker,
        )  # fmt: skip
        self._liveness.start(time.monotonic())
        self._started.set()
        try:
            self._loop()
            say_goodbye(self.rank, self._abort, self._breaker, self._runner,
                        posted=self._posted, calls=self._calls, agreement=self._agreement,
                        channel=self._channel, peers=len(self._liveness.heard),
                        poll_channel=self._poll_channel, tell_all=self._tell_all)  # fmt: skip
        except BaseException as exc:  # a bug: fail loudly, never hang the callers
            log.exception("asyncreduce ordered engine thread crashed")
            self._breaker.break_communicator(
                BrokenError(f"rank {self.rank}: the ordered engine crashed: {exc!r}")
            )
        finally:
            with self._lock:
                self._closed = True
            fail_left(self._queue, self._pending(), self._breaker.broken)
            release(self.adapter, self._calls)

    def _loop(self) -> None:
        last_event, nap = time.monotonic(), _POLL
        while True:  # (once broken, failed ops left offered keep nobody spinning)
            busy = bool(self._calls) or (self._breaker.broken is None and bool(self._posted))
            idle = not busy and time.monotonic() - last_event > self.settings.spin
            stop, took = self._take(block=idle)  # (spin a while first: the next post is near)
            if stop:
                return
            moved = took | self._poll_channel() | self._runner.poll()
            now = time.monotonic()
            if moved:
                last_event, nap = now, _POLL
            self._housekeeping(now)
            if busy and not moved and now - last_event > self.settings.spin:
                if self._calls and all(getattr(c.running, "wakes", False) for c in self._calls):
                    self._nap(self._liveness.timeout(now))  # (its end wakes us; a post too)
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
        breaker = self._breaker
        if breaker.broken is not None:
            op.request.set_exception(broken_by(op, breaker.broken))
            return
        if breaker.departed:  # (submitted before the goodbye was read): nobody can agree it
            why = next(iter(breaker.departed.values()))
            op.request.set_exception(BrokenError(f"{op.label}: {why}"))
            breaker.break_communicator(
                BrokenError(f"{why} while rank {self.rank} had {op.label} pending")
            )
            return
        op.record = self.flight.add(Record(*op.key, op.desc, op.priority, time.time()))
        self._watch(op)
        if op.kind == "p2p":  # matched by the engine itself, by source and tag, in order
            self._runner.issue([op])
            return
        self._posted[op.key] = op
        self._send_rounds(self._agreement.post(Entry(*op.key, op.desc, op.priority)))

    def _watch(self, op: Posted) -> None:
        """Keep ``op``'s deadline, if it has a timeout; those of operations that ended are
        forgotten once they outnumber the pending ones, as natively."""
        if op.timeout is None:
            return
        self._liveness.add_deadline(op)
        pending = len(self._posted) + sum(len(c.ops) for c in self._calls) + 1
        self._liveness.prune(pending, lambda o: not o.request.done())

    def _send_rounds(self, out: list[tuple[int, bytes]]) -> None:
        try:
            for peer, message in out:
                self._channel.send(peer, ROUND, message)
        finally:  # what was agreed runs, whatever happened to the messages
            self._runner.run_agreed(self._agreement.take_agreed(), self.fusion_bytes)

    def _poll_channel(self) -> bool:
        try:
            return self._read_channel()
        except Exception as exc:  # (a lost peer in the native endpoint, an MPI error, ...)
            what = f"the control channel failed: {exc}"
            if isinstance(exc.__cause__ or exc, TimeoutError):  # it found a silent peer
                self._breaker.fail_silent(what)
            else:
                self._breaker.break_communicator(BrokenError(f"rank {self.rank}: {what}"))
            return True

    def _read_channel(self) -> bool:
        moved = False
        for peer, kind, body in self._channel.poll():
            moved = True
            self._liveness.heard[peer] = time.monotonic()
            if kind == ROUND:
                self._send_rounds(self._agreement.receive(peer, body))
            elif kind == GOODBYE:
                self._breaker.on_goodbye(peer, body.decode(errors="replace"))
            elif kind == BREAK:
                self._breaker.on_break(peer, body)
        return moved

    # ---- time --------------------------------------------------------------------------------

    def _housekeeping(self, now: float) -> None:
        """Deadlines that passed fail their operations; at each beat, a BEAT to every peer,
        silent peers judged and stalls reported (protocol/liveness.py times them, failure.py
        acts)."""
        self._breaker.fail_expired(now, self._waiting_for)
        if self._liveness.beat_due(now):
            self._tell_all(BEAT)
            self._breaker.fail_if_silent(now)
            self._stalls.inspect(now, self._posted, self._waiting_for)

    def _tell_all(self, kind: int, body: bytes = b"") -> None:
        """``kind`` to every peer still here (GOODBYE: to every peer, since one that said
        goodbye first waits for ours); a channel that failed only loses the message."""
        departed = self._breaker.departed
        for peer in self._liveness.heard:
            if peer not in departed or kind == GOODBYE:
                try:
                    self._channel.send(peer, kind, body)
                except Exception as exc:
                    log.debug("rank %d: no control message to rank %d: %s", self.rank, peer, exc)

    def _pending(self) -> list[Posted]:
        """Every operation not yet agreed, or in an engine call."""
        return self._breaker.pending()

    def _waiting_for(self, op: Posted) -> str:
        if op.key in self._posted:
            missing = set(range(self.world_size)) - self._agreement.posted_by(op.key)
            return f"not posted by {ranks_phrase(missing)}"
        return "agreed; the engine has not finished it"
