"""The protocol of one rank, sans-IO: events in, commands out (as h11 does it for HTTP).

A ``Session`` takes events (an operation posted, a frame received, a frame sent, a peer lost,
a tick, a unit of work, closing) with the time passed in, changes its state, and appends
commands (commands.py) to ``self.commands`` for the engine thread to carry out. It owns no
socket, no thread and no clock, so every rule below can be tested in one process, with frames
delivered in any order (tests/wire.py).

Matching is by key, never by order (matching.py). Every frame carries the operation's
descriptor; a frame whose descriptor differs from the local one fails the operation here and,
through a ``Failed`` message, on every other rank, naming both sides. An operation completes
when its algorithm is done and every frame it sent has left.

Failure is sticky. The first failure (a lost or silent peer, a mismatch, a timeout, abort)
breaks the session: every pending operation fails with ``BrokenError`` chained to that cause,
and so does every later post; peers are told (``Failed`` for an operation, else ``Abort``) and
break at once instead of waiting out a timeout. A peer that said GOODBYE fails only what still
needs it. Back-pressure is flow.py, heartbeats and deadlines liveness.py, the stall questions
stall.py; the wire form of every control message is wire.py.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from ..algorithms import Array, PeerMemoryError, ProtocolError, Send
from ..errors import BrokenError, MismatchError
from ..flight import FlightRecorder, Record, settle
from ..transport.frame import DATA, GOODBYE, HEARTBEAT, Descriptor, Header
from . import commands as do
from . import wire
from .around import SideDoor
from .commands import Command
from .controls import ControlTraffic
from .epochs import Epochs
from .failure import broken_by, closed_under, same_error
from .flow import Flow, KeptFrame
from .liveness import Liveness
from .matching import Matching
from .membership import Membership
from .operation import Operation, Settings, bytes_of
from .outside import Outside
from .route import small
from .stall import StallInspector
from .wire import Control, Key, describe, mismatch_hint, payload_bytes

__all__ = ["Session", "broken_by"]  # broken_by: failure.py, named here for the engines

log = logging.getLogger("asyncreduce.engine")


_WORK_PATIENCE = 0.1  # seconds: an operation with work waiting this long goes first (work)


class Session(ControlTraffic, SideDoor, Epochs):
    """One rank's protocol state (see the module docstring)."""

    def __init__(
        self, rank: int, world_size: int, settings: Settings, flight: FlightRecorder, now: float
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.settings = settings
        self.flight = flight
        self.commands: list[Command] = []  # for the engine to apply, in order, then clear
        self.matching = Matching()
        self.flow = Flow(settings.held_bytes)
        self.liveness = Liveness(rank, world_size, settings.peer_timeout, now)
        self.stall = StallInspector(rank, world_size, settings.stall_warning)
        self.outside: Outside | None = None  # the same-host lane, once open (around.py)
        self.epoch, self.members, self.prefix = 0, frozenset(range(world_size)), b""
        self.agreement: Membership | None = None  # epochs.py
        self.agree_retry_at = 0.0
        self.lost_peers: set[int] = set()
        self.from_next: list[tuple[int, Control]] = []
        self.broken: BaseException | None = None
        self.stopping = False  # saying goodbye: only GOODBYE frames matter now
        self.working: set[Operation] = set()  # operations with work of their own to do
        self.spin_until = 0.0  # the engine busy-polls until then (see Engine._poll)
        self._landing: dict[int, tuple[Operation, Array]] = {}  # payloads landing in place
        self._order = itertools.count()
        self._now = now

    # ---- events --------------------------------------------------------------------------------

    def post(self, op: Operation, now: float, started: bool = False) -> None:
        """Start an operation posted on this rank (``started``: its algorithm started on the
        caller's thread, ``Engine.run_direct``, and the frames it sent so far are the transport's,
        snapshots of the buffer, so the session takes it over where it stands)."""
        self._now = now
        if self.broken is not None:
            self._fail(op, broken_by(op, self.broken))
            return
        earlier = self.matching.failed.get(op.key)
        if earlier is not None:
            self._fail(op, same_error(earlier, str(earlier)))
            return
        if self.prefix and self._of_another_epoch(op):  # (none before a first shrink)
            return
        self.matching.ops[op.key] = op
        op.small = small(payload_bytes(op.desc))
        self._spin_after(op)
        if op.announce:  # a named one the same-host lane would take: peers there hand it over
            self._control(self.liveness.open_peers(), wire.PostNotice(op.key, op.desc))
        elif self.flow.told:
            self._control(self.flow.told, wire.PostNotice(op.key, op.desc))
        op.age = next(self._order)
        op.started = now
        if op.record is None:  # (else a lane's operation the engine takes over: its record)
            op.record = self.flight.add(Record(*op.key, op.desc, op.priority, op.posted_at))
        if op.timeout is not None:
            op.deadline = now + op.timeout
            self.liveness.add_deadline(op)
        if self._guarded(op, _no_sends if started else op.algo.start):
            for peer, header, payload in self.matching.take_kept(op.key):
                accepted = self._accept(op, peer, header, payload)
                self.matching.spares.give(payload)
                if not accepted:
                    break
        if self.liveness.departed and self.matching.live(op):
            self._fail_what_needs_the_departed(op, posted=True)
        self._maybe_complete(op)
        if self.flow.told:  # (its early frames are no longer held)
            self._resume_drained()

    def buffer_for(self, peer: int, header: Header) -> memoryview | None:
        """Where a DATA payload from ``peer`` should land (the algorithm's buffer, or a spare
        one if its operation is not posted here); None for the transport's own buffer."""
        if header.type != DATA:
            return None
        op = self.matching.ops.get(header.key)
        if op is None:  # not posted here yet: it waits in a recycled buffer
            return self.matching.spares.take(header.payload_len)
        if not self._matches(op, peer, header):
            return None
        try:
            target = op.algo.recv_buffer(peer, header.step, header.seg, header.payload_len)
        except ProtocolError as exc:
            self._fail_everywhere(op, MismatchError(f"{op.label}: rank {self.rank}: {exc}"))
            return None
        self._landing[peer] = (op, target)
        return bytes_of(target)

    def on_view(self, peer: int, header: Header, view: memoryview, now: float) -> bool:
        """Consume a payload where it lies (valid only during the call); False: not taken."""
        self._now = now
        self.liveness.heard[peer] = now
        op = self.matching.ops.get(header.key)
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

    def on_frame(self, peer: int, header: Header, payload: memoryview, now: float) -> None:
        """A complete frame from ``peer`` (its payload where ``buffer_for`` said)."""
        self._now = now
        self.liveness.heard[peer] = now
        if header.type == HEARTBEAT:
            return
        landed = self._landing.pop(peer, None)
        if header.type == GOODBYE:
            self._on_goodbye(peer, bytes(payload).decode(errors="replace"))
            return
        if self.stopping:
            return
        if header.type != DATA:
            message = wire.decode(header, payload)
            if message is not None:
                self._on_control(peer, message)
            return
        op = self.matching.ops.get(header.key)
        if op is None:
            self._unposted(peer, header, payload)
            return
        self._spin_after(op)
        if landed is not None and landed[0] is op:
            target = landed[1]
            if self._guarded(op, lambda: op.algo.on_message(peer, header.step, header.seg, target)):
                self._maybe_complete(op)
        elif self._accept(op, peer, header, payload):
            self.matching.spares.give(payload)
            self._maybe_complete(op)

    def sent(self, token: object, now: float | None = None) -> None:
        """The frame sent with ``token`` has left this process. ``now`` is needed only for an
        operation's last frame (it may end the operation and start the spin window), so the
        engine reads the clock for that one alone, not for every frame."""
        if isinstance(token, Operation):
            if now is not None:
                self._now = now
            token.unsent -= 1
            self._maybe_complete(token)

    def lost(self, peer: int, error: BaseException, closing: bool) -> None:
        """The connection to ``peer`` is gone (not a failure while closing, or after goodbye)."""
        if not closing and peer not in self.liveness.departed:
            self.fail_all(
                BrokenError(f"rank {self.rank} lost its connection to rank {peer} ({error})")
            )
            self._suspect(peer)  # (after the break: it may decide the next membership)

    def withdrawn(self, peer: int, frames: list[KeptFrame]) -> None:
        """The answer to WITHDRAW: the frames taken back from ``peer``'s queue."""
        self.flow.withdrawn(peer, frames)

    def work(self, now: float) -> None:
        """One unit of the most urgent operation's own work (the highest priority, then the
        least key): between units the engine reads what came in, so a small urgent operation
        is not stuck behind a large one's reductions for longer than one segment. The key, not
        the order of posting, so that every rank works on the same operation first when threads
        posted them in different orders: each one's segments then meet their peers' while
        still in the cache, instead of every rank reducing another and waiting on the rest.
        One posted ``_WORK_PATIENCE`` ago or more goes before the keys, so a stream of
        operations with lesser names cannot keep one waiting."""
        self._now = now
        op = min(self.working, key=lambda o: (-o.priority, now - o.started < _WORK_PATIENCE, o.key))
        if self._guarded(op, op.algo.work):
            self._maybe_complete(op)
        if not op.algo.has_work:
            self.working.discard(op)

    def close(self, abort_reason: str | None, late: list[Operation]) -> None:
        """close() or abort() was called: fail what is pending (and ``late``, posted but not
        started) with ClosedError; an abort breaks first, so peers are told."""
        if abort_reason is not None:
            self.fail_all(BrokenError(f"rank {self.rank} aborted: {abort_reason}"))
        for op in list(self.matching.ops.values()) + late:
            self._fail(op, closed_under(op))

    def fail_all(self, error: BaseException, about: tuple[Key, Descriptor] | None = None) -> None:
        """The first failure breaks the session: fail everything pending (chained to
        ``error``), refuse new posts, tell every peer (``Failed`` for the operation that
        failed first, so it fails with the same class everywhere; else ``Abort``)."""
        if self.broken is not None:
            return
        self.broken = error
        for op in list(self.matching.ops.values()):
            self._fail(op, broken_by(op, error))
        self.flow.broken()
        message: Control = wire.Abort(str(error), self.epoch)
        if about is not None:
            message = wire.Failed(*about, type(error), str(error))  # type: ignore[arg-type]
        self._control(self.liveness.open_peers(), message)
        self.flight.broken = f"{type(error).__name__}: {error}"
        self.commands.append((do.BROKE, error))

    # ---- operations ----------------------------------------------------------------------------

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
            f"{describe(header.desc)}{mismatch_hint(op.desc, header.desc)}"))  # fmt: skip
        return False

    def _guarded(self, op: Operation, step: Callable[[], list[Send]]) -> bool:
        """Run one algorithm step and send what it returns; a failure fails the operation.
        Each send counts in ``unsent`` before any is applied, so an operation cannot complete
        while frames of the step are still to be handed over."""
        try:
            sends = step()
        except ProtocolError as exc:
            self._fail_everywhere(op, MismatchError(f"{op.label}: rank {self.rank}: {exc}"))
            return False
        except PeerMemoryError as exc:  # samehost/cma.py: the peer died, or announced bad memory
            self._fail_everywhere(op, BrokenError(f"{op.label}: rank {self.rank}: {exc}"))
            return False
        except Exception as exc:
            log.exception("%s failed in its algorithm", op.label)
            self._fail_everywhere(op, BrokenError(f"{op.label}: rank {self.rank}: {exc!r}"))
            return False
        for s in sends:
            self._send(op, s)
        live = self.matching.live(op)
        if live and op.algo.has_work:
            self.working.add(op)
        return live

    def _send(self, op: Operation, s: Send) -> None:
        if s.dst in self.liveness.departed:
            op.dropped_for = s.dst  # it closed: nobody reads it (a post fails for it: post)
            return
        payload = bytes_of(s.payload)
        head = wire.data_head(op.key, s.step, s.seg, payload.nbytes, op.desc)
        op.unsent += 1
        if not self.flow.may_send(s.dst, op.key):
            self.flow.keep_back(s.dst, (op, head, payload))  # until it is posted there
            return
        self.commands.append((do.SEND, s.dst, head, payload, op.priority, op, op.age))

    def _maybe_complete(self, op: Operation) -> None:
        if op.unsent or not op.algo.done or not self.matching.live(op):
            return
        self.matching.completed(op)
        self.liveness.prune(len(self.matching.ops), self.matching.live)
        self._ended(op)
        try:
            value = op.result()
        except Exception as exc:
            self._finish(op, None, exc)
            return
        self._finish(op, value, None)

    def _fail(self, op: Operation, error: BaseException) -> None:
        """Fail ``op`` at once; from here on nothing reads or writes the caller's buffer."""
        if self.matching.live(op):
            del self.matching.ops[op.key]
            self.matching.failed_with(op.key, error)
            self._ended(op)
            self.commands.append((do.DROP, op))
            for peer, (landing, _) in list(self._landing.items()):
                if landing is op:
                    self.commands.append((do.DIVERT, peer))
                    del self._landing[peer]
        if not op.ended:
            self._finish(op, None, error)

    def _fail_everywhere(self, op: Operation, error: BaseException) -> None:
        """Fail ``op`` here, tell every other rank to fail it the same way; break."""
        if self.matching.live(op):
            self._fail(op, error)
            self.fail_all(error, (op.key, op.desc))

    def _finish(self, op: Operation, value: Any, error: BaseException | None) -> None:
        op.ended = True
        settle(self.flight, self.rank, op.label, op.key, op.desc, op.priority, op.started,
               self._now, error, op.record)  # fmt: skip
        self.commands.append((do.FINISH, op, value, error))

    def _ended(self, op: Operation) -> None:
        """Forget what the stall inspector and flow control kept about ``op``."""
        self._spin_after(op)
        self.working.discard(op)
        self.stall.forget(op.key)
        self.flow.ended(op.key)

    def _spin_after(self, op: Operation) -> None:
        """A small operation started, heard from a peer or ended: the engine busy-polls a while."""
        if op.small:
            self.spin_until = self._now + self.settings.spin


def _no_sends() -> list[Send]:
    return []
