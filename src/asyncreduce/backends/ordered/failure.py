"""Failure in the ordered engine: how a failed operation ends, how the communicator breaks, the
BREAK message, and failed operations that stay offered.

Theory of operation. Failure is sticky: the first one (a mismatch found in the agreement, an
operation past its ``timeout``, an engine error, a silent or departed peer, ``abort``) breaks
the communicator on this rank (``Breaker.break_communicator``): every pending request fails
with ``BrokenError`` chained to it, the flight record is written (ASYNCREDUCE_FLIGHT_DIR), and
a BREAK message (error class code, the key of the operation it is about, the reason) tells
every peer, which fails that operation with the same class (``MismatchError``,
``TimeoutError``, else ``BrokenError``) and breaks too. Engine calls already issued go on (MPI
has no cancel for collectives, and the peers are in them): after a break they are abandoned.

The liveness rules that end operations live here too (the clocks are protocol/liveness.py's,
shared with the native engine): an operation past its deadline fails everywhere with
``TimeoutError``; a silent peer (seen here at a beat, or by the control channel, whichever
first) fails what waits with a ``BrokenError`` naming it (the peer timeout's ``TimeoutError``
its cause), worded as natively, then breaks; a peer's GOODBYE breaks only if something offered
here is still pending (nobody can agree it now). At a beat that came after this rank's own
thread was away (``Liveness.away``), silence waits for the next beat: what the peers sent
meanwhile may not be read yet.

A failed request does not take its operation back from the peers. Once this rank offered it
to the agreement, the peers may still agree it, and then they need this rank in the engine
call (MPI has no cancel for collectives). So a failed operation stays offered, a "zombie":
it is moved onto a scratch copy of its memory (``run_on_scratch``), which the caller's buffer
is free of from the moment its request failed, and runs there for the peers' sake.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import BrokenError
from ...flight import FlightRecorder
from ...keys import Key
from ...protocol import broken_by
from ...protocol.failure import silent, unheard
from ...protocol.liveness import Liveness
from ...protocol.wire import BROKEN_CODE, ERROR_CLASSES, ERROR_CODES
from .channel import BREAK
from .fusion import Call
from .posted import Posted

__all__ = ["Breaker", "break_error", "break_message", "read_break", "run_on_scratch"]

log = logging.getLogger("asyncreduce.ordered")
_BREAK_HEAD = struct.Struct("<BHQ")  # error class code, key name length, key instance
_REASON_BYTES = 4096


class Breaker:
    """The failure path of one ordered engine (module docstring). Only its thread calls these;
    ``broken`` and ``departed`` change under ``lock``, which ``submit`` holds to read them."""

    def __init__(
        self, rank: int, flight: FlightRecorder, flight_dir: str | None, lock: threading.Lock,
        liveness: Liveness[Posted], posted: dict[Key, Posted], calls: list[Call],
        tell_all: Callable[[int, bytes], None],
    ) -> None:  # fmt: skip
        """``posted`` and ``calls``: the engine's operations not yet agreed and its engine calls
        in flight (the engine's own tables); ``tell_all``: a control message to every peer."""
        self.rank, self.flight, self._flight_dir, self._lock = rank, flight, flight_dir, lock
        self._liveness, self._posted, self._calls = liveness, posted, calls
        self._tell_all = tell_all
        self.broken: BaseException | None = None  # the first failure: sticky
        self.departed = liveness.departed  # the peers that said goodbye: why, in words

    def pending(self) -> list[Posted]:
        """Every operation not yet agreed, or in an engine call."""
        return [*self._posted.values(), *(o for c in self._calls for o in c.ops)]

    def fail(self, op: Posted, error: BaseException) -> None:
        """Fail ``op``'s request. Peers may still agree it (this rank offered it), and then
        they need this rank in the engine call: it stays posted, on a scratch copy, so the
        caller's memory is free from now on; an op issued already stays in the engine."""
        if op.key in self._posted and not op.request.done():
            run_on_scratch(op, self.rank)  # (it stays offered, for the peers)
        if op.record is not None and op.record.state == "pending":
            self.flight.finish(op.record, error)
        if not op.request.done():
            op.request.set_exception(error)

    def fail_everywhere(self, op: Posted, error: BaseException) -> None:
        """Fail ``op`` with ``error`` here and, with the same class, on every rank; break."""
        self.fail(op, error)
        self.break_communicator(error, op)

    def fail_call(self, ops: list[Posted], error: BaseException) -> None:
        """Fail every operation of one engine call (that failed, or never started); break."""
        for op in ops:
            self.fail(op, error)
        self.break_communicator(error, ops[0])

    def break_communicator(self, error: BaseException, about: Posted | None = None) -> None:
        """Break on ``error`` (once: later failures only fail their own operations): fail
        every pending request, tell every peer (about operation ``about``), write the record."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = error
        self.flight.broken = f"{type(error).__name__}: {error}"
        for op in self.pending():  # (engine calls go on: MPI has no cancel, peers are in them)
            self.fail(op, broken_by(op, error))
        self._tell_all(BREAK, break_message(error, about.key if about is not None else None))
        if self._flight_dir:
            try:
                self.flight.dump(self._flight_dir)
            except OSError as exc:
                log.warning("rank %d could not write its flight record: %s", self.rank, exc)

    def on_break(self, peer: int, body: bytes) -> None:
        """``peer`` broke (its BREAK message): fail what it was about with its class; break."""
        code, key, reason = read_break(peer, body)
        op = self._live(key) or next((o for c in self._calls for o in c.ops if o.key == key), None)
        error = break_error(code, peer, op.label if op is not None else None, reason)
        if op is not None:
            self.fail(op, error)
        self.break_communicator(error)

    def on_goodbye(self, peer: int, reason: str) -> None:
        """``peer`` closed: it agrees nothing more, so what is offered here and pending breaks."""
        why = f"rank {peer} closed the communicator" + (f" ({reason})" if reason else "")
        with self._lock:
            self.departed[peer] = why
        live = [op for op in self._posted.values() if not op.request.done()]
        if live:
            self.break_communicator(
                BrokenError(f"{why} while rank {self.rank} had {live[0].label} pending")
            )

    def fail_expired(self, now: float, waiting_for: Callable[[Posted], str]) -> None:
        """Fail everywhere each operation whose deadline passed by ``now`` and still pends
        (``waiting_for``: on what, in words)."""
        for op in self._liveness.expired(now):
            if not op.request.done():
                self.fail_everywhere(op, TimeoutError(
                    f"{op.label} did not complete within its timeout of {op.timeout} s on "
                    f"rank {self.rank} ({waiting_for(op)})"))  # fmt: skip

    def fail_if_silent(self, now: float) -> None:
        """At a beat: while something is pending, a peer silent for too long fails it (not
        right after this rank's own absence: see the module docstring)."""
        liveness = self._liveness
        if self.broken is not None or not (self._posted or self._calls) or liveness.away:
            return
        peers = liveness.silent(now)
        if peers:
            self.fail_silent(unheard(peers, liveness.peer_timeout))

    def fail_silent(self, what: str) -> None:
        """A peer is silent (seen here, or by the control channel, whichever first; ``what``
        names it): what waits fails with a BrokenError saying so, the peer timeout's
        TimeoutError its cause, as natively (protocol/failure.py ``silent_for``), then the
        engine breaks."""
        wait = self._liveness.peer_timeout
        for op in self.pending():
            self.fail(op, silent(f"{op.label} failed on rank {self.rank}: {what}", wait))
        self.break_communicator(silent(f"rank {self.rank}: {what}", wait))

    def _live(self, key: Key) -> Posted | None:
        """The posted, not yet agreed operation ``key`` whose request is still pending."""
        op = self._posted.get(key)
        return op if op is not None and not op.request.done() else None


def break_message(error: BaseException, about: Key | None) -> bytes:
    """The BREAK body for ``error``, about operation ``about`` (None: no one operation)."""
    name, instance = about if about is not None else (b"", 0)
    code = ERROR_CODES.get(type(error), BROKEN_CODE)  # type: ignore[arg-type]
    return _BREAK_HEAD.pack(code, len(name), instance) + name + str(error).encode()[:_REASON_BYTES]


def read_break(peer: int, body: bytes) -> tuple[int, Key, str]:
    """(error class code, key, reason) of ``peer``'s BREAK; BrokenError if malformed."""
    if len(body) < _BREAK_HEAD.size:
        raise BrokenError(f"rank {peer} sent a BREAK message of {len(body)} bytes")
    code, size, instance = _BREAK_HEAD.unpack_from(body)
    name = body[_BREAK_HEAD.size : _BREAK_HEAD.size + size]
    reason = body[_BREAK_HEAD.size + size :].decode(errors="replace")
    return code, (name, instance), reason


def break_error(code: int, peer: int, label: str | None, reason: str) -> Exception:
    """The error this rank fails with when ``peer`` broke with ``code`` about ``label``."""
    cls = ERROR_CLASSES.get(code, BrokenError)
    return cls(f"{label or 'an operation'} failed on rank {peer}: {reason}"
               if code != BROKEN_CODE else f"rank {peer} broke: {reason}")  # fmt: skip


def run_on_scratch(op: Posted, rank: int) -> None:
    """Move ``op`` (failed, still offered) onto scratch copies of its memory."""
    try:
        op.flat = _scratch(op.flat, op.ready)
        op.sends = {p: _scratch(a) for p, a in (op.sends or {}).items()}
        op.recvs = {p: _scratch(a) for p, a in (op.recvs or {}).items()}
    except Exception as exc:  # (out of memory): then it cannot run for anybody
        log.error("rank %d: no scratch copy of %s: %s", rank, op.label, exc)


def _scratch(flat: Any, ready: Any = None) -> Any:
    """A copy of an operation's memory to run it on once its caller has been told it failed
    (a device tensor: copied after its producer's kernels, on this thread's stream)."""
    if isinstance(flat, np.ndarray):
        return flat.copy()
    if ready is not None:
        import torch

        torch.cuda.current_stream(flat.device).wait_event(ready)
    return flat.clone()
