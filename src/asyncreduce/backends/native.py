"""The native backend: operations as our own engine's state machines, matched by key.

Theory of operation. An operation becomes an algorithm built for the communicator's own
numbering (``build``: doubling, ring, tree, ...; a direct exchange comes built), over the
caller's memory. A large allreduce on one host reads the peers' memory in place instead, from a
shared window or by cross-memory attach (samehost/planes.py); the descriptor's ``root`` says
which, so every rank runs the same one. A group's algorithm is wrapped (``Translated``) so the
engine sees the ranks it knows. The ``Operation`` then goes to the engine's thread (engine/),
which matches it with the peers' by key and completes the request. In a world of one there is
no engine: ``LocalBackend`` runs the same algorithm at once, in the caller's thread.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import plans
from ..algorithms import (
    KINDS,
    REDUCIBLE,
    REDUCTION_CODES,
    SMALL_ALLREDUCE_BYTES,
    Array,
    Barrier,
    Collective,
    DirectAllreduce,
    DType,
    RecursiveDoubling,
    RunsDirectly,
    Translated,
    build,
)
from ..buffers import Buffer, as_buffer, numpy_dtype
from ..engine import Engine
from ..errors import BrokenError, ClosedError, UsageError
from ..keys import Key
from ..lane import Lane, LaneOp
from ..plans import Plan
from ..protocol.operation import Operation
from ..request import CallbackRunner, Request
from ..samehost.mailbox import HERE, Mailbox, SlotHeader, header
from ..samehost.named import NamedSlots
from ..samehost.planes import DataPlane, SharedPlanes
from ..transport.frame import Descriptor
from .common import EngineBackend, log_post

if TYPE_CHECKING:
    from .ordered.engine import OrderedEngine

__all__ = ["DirectCalls", "LocalBackend", "NativeBackend"]

_DIRECT_KINDS = ("allreduce", "barrier")  # what Engine.run_direct may run on its caller's thread,
_DIRECT_ALGORITHMS = (RecursiveDoubling, Barrier)  # built as these (a group's are wrapped)
Prepared = tuple[DType, Descriptor, SlotHeader]  # DirectCalls.prepared: type, descriptor, header


def built(
    plan: Plan, rank: int, world_size: int, planes: SharedPlanes
) -> tuple[Collective, Descriptor]:
    """``plan``'s algorithm (for ``rank`` of ``world_size``) and descriptor."""
    kind, buf = plan.kind, plan.buf
    root, algo = plan.root, plan.algo
    if algo is None:
        plane = planes.choose(kind, buf.flat)
        root, shared = plane if plane is not None else (root, None)
        algo = build(kind, rank, world_size, buf.flat, buf.dtype, plan.op or "sum", plan.root,
                     shared)  # fmt: skip
    return algo, plan.descriptor(root, buf.dtype.code)


class NativeBackend(EngineBackend):
    """A communicator (or a group of it: ``members``) over our own ``Engine``."""

    devices = False
    ordered: OrderedEngine | None = None

    def __init__(
        self, engine: Engine, rank: int, world_size: int, planes: SharedPlanes,
        members: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        self.engine = self._runs = engine
        self.rank, self.world_size = rank, world_size  # the communicator's numbering
        self.planes = planes
        self.members = tuple(range(engine.world_size)) if members is None else members
        self._translated = self.members != tuple(range(engine.world_size))  # a true subgroup
        self.lane: Lane | None = None  # the world's same-host lane, once opened (lane.py)
        self._known: dict[tuple[str, int, str, int], tuple[Descriptor, SlotHeader]] = {}

    def submit(
        self, plan: Plan, key: Key, label: str, priority: int, timeout: float | None,
        request: Request[Any],
    ) -> None:  # fmt: skip
        lane = self.lane
        announce = False
        if lane is not None and lane.takes(plan.kind, plan.buf, key):
            desc, _ = self._described(plan, label)
            if lane.post(self._lane_op(plan, key, label, timeout, desc), request):
                return
            announce = True  # a named one the lane could not take: the peers must hear
        self.on_engine(plan, key, label, priority, timeout, request, announce)

    def on_engine(
        self, plan: Plan, key: Key, label: str, priority: int, timeout: float | None,
        request: Request[Any], announce: bool = False,
    ) -> None:  # fmt: skip
        """Post ``plan`` on the engine (``announce``: tell every peer, whose lane may hold
        the key: lane/named.py)."""
        algo, desc = self._built(plan, key, label)
        op = Operation(key, label, desc, algo, request, plan.result, priority, timeout)
        op.announce = announce
        self.engine.submit(op)

    def _built(self, plan: Plan, key: Key, label: str) -> tuple[Collective, Descriptor]:
        """``plan``'s algorithm as the engine runs it (a group's renumbered), its descriptor,
        logged; where the lane is open, an unnamed one it does not take is noted in its slot
        (every unnamed operation takes one)."""
        algo, desc = self._small_allreduce(plan) or built(
            plan, self.rank, self.world_size, self.planes
        )
        self.note_slot(key, desc)
        if self._translated:
            engine = self.engine
            algo = Translated(algo, self.members, engine.rank, engine.world_size)
        log_post(self.rank, label, desc)
        return algo, desc

    def note_slot(self, key: Key, desc: Descriptor) -> None:
        """Where the lane is open, an unnamed operation it does not take is noted in its slot:
        every unnamed operation takes one, and the lane's next one waits for it."""
        if self.lane is not None and not key[0]:
            self.lane.note(key[1], desc)

    def run(
        self, plan: Plan, key: Key, label: str, priority: int, timeout: float | None,
        runner: CallbackRunner,
    ) -> Request[Any] | None:  # fmt: skip
        """``submit`` for a caller that waits for the operation at once: one the lane takes
        runs on the caller's thread where it can (``Lane.run_waiting``), and so does a small
        allreduce or a barrier the engine takes, over the sockets (``Engine.run_direct``); None:
        done, its result is in place. Any other gets a request (``runner`` runs its
        callbacks), returned."""
        lane = self.lane
        if lane is not None and key[0] and lane.takes(plan.kind, plan.buf, key):
            request: Request[Any] = Request(label, runner)
            self.submit(plan, key, label, priority, timeout, request)
            return request
        if lane is None or not lane.takes(plan.kind, plan.buf, key):
            algo, desc = self._built(plan, key, label)
            made = _adopter(key, label, desc, algo, plan.result, priority, timeout, runner)
            if isinstance(algo, _DIRECT_ALGORITHMS) and plan.kind in _DIRECT_KINDS:
                return self.engine.run_direct(key, label, desc, algo, priority, timeout, made)
            op = made()
            self.engine.submit(op)
            return op.request
        desc, head = self._described(plan, label)
        posted = time.monotonic() if timeout is not None else 0.0
        buf, reduce_op = plan.buf, plan.op or "sum"
        adopt = _lane_adopter(key, label, desc, lambda: buf, reduce_op, plan.result, timeout,
                              posted, runner)  # fmt: skip
        return lane.run_waiting(key[1], head, buf.flat, buf.dtype, reduce_op, timeout, adopt)

    def _small_allreduce(self, plan: Plan) -> tuple[Collective, Descriptor] | None:
        """What ``built`` makes of a small allreduce (recursive doubling: no shared memory
        under ``SMALL_ALLREDUCE_BYTES``), its descriptor kept (``_descriptor``): the most
        frequent operation, whose general build cost as much as a look at the wire. None
        for any other."""
        buf = plan.buf
        if plan.kind != "allreduce" or buf.flat.nbytes > SMALL_ALLREDUCE_BYTES:
            return None
        op = plan.op or "sum"
        algo = RecursiveDoubling(self.rank, self.world_size, buf.flat, buf.dtype, op)
        return algo, self._descriptor(plan)[0]

    def _lane_op(
        self, plan: Plan, key: Key, label: str, timeout: float | None, desc: Descriptor
    ) -> LaneOp:
        return LaneOp(key, label, desc, plan.buf, plan.op or "sum", plan.result, timeout)

    def _described(self, plan: Plan, label: str) -> tuple[Descriptor, SlotHeader]:
        """A lane operation's descriptor and slot header (``_descriptor`` keeps them),
        ``admitted``."""
        found = self._descriptor(plan)
        self.admitted(label, found[0])
        return found

    def admitted(self, label: str, desc: Descriptor) -> None:
        """A lane operation refused (raised) if the engine refuses posts (closed, broken),
        else logged. Not for a goodbye: the lane fails an operation only if the rank that
        left has not published it (``Lane.watch``), as every rank judges it, whenever it
        posted it and read the goodbye."""
        refused = self.engine.refusal(label, goodbyes=False)
        if refused is not None:
            raise refused
        log_post(self.rank, label, desc)

    def _descriptor(self, plan: Plan) -> tuple[Descriptor, SlotHeader]:
        """A small allreduce's (or a barrier's) descriptor and lane slot header, kept per
        kind, dtype, reduction and count (a loop posts the same few): building them costs
        more than a look."""
        buf = plan.buf
        same = (plan.kind, buf.dtype.code, plan.op or "sum", buf.flat.size)
        found = self._known.get(same)
        if found is None:
            if len(self._known) >= 256:
                self._known.clear()
            desc = plan.descriptor(0, buf.dtype.code)
            found = self._known[same] = (desc, header(HERE, desc))
        return found

    def open_lane(self, mailbox: Mailbox, named: NamedSlots | None = None) -> None:
        """Send the world's small allreduces through ``mailbox`` from now on, named ones too
        where there are ``named`` slots (every rank switches at the same point: after the
        collective that made the mailboxes)."""
        self.lane = Lane(mailbox, self.rank, self.world_size, self.convert, self.engine.nudge,
                         named, self.engine.flight)  # fmt: skip
        self.engine.take_lane(self.lane)

    def convert(self, op: LaneOp) -> None:
        """Run a lane operation on the engine after all (a peer runs it there, or disagrees
        about it): the engine's matching completes it or fails it on every rank."""
        kind = "barrier" if op.desc.kind == KINDS["barrier"] else "allreduce"  # (Lane.takes)
        algo = build(kind, self.rank, self.world_size, op.buf.flat, op.buf.dtype, op.op)
        made = Operation(op.key, op.label, op.desc, algo, op.request, op.result, 0, op.timeout)
        made.announce = bool(op.key[0])  # peers whose lane holds it must hand it over too
        try:
            self.engine.submit(made)
        except (BrokenError, ClosedError) as exc:
            op.request.set_exception(exc)

    def group(self, members: tuple[int, ...]) -> NativeBackend:
        engine_ranks = tuple(self.members[r] for r in members)
        planes = self.planes.for_group(engine_ranks, self.engine.world_size)
        return NativeBackend(self.engine, members.index(self.rank), len(members), planes,
                             engine_ranks)  # fmt: skip

    @property
    def data_plane(self) -> DataPlane:
        return dataclasses.replace(self.planes.data_plane("native"), lane=self.lane is not None)


class DirectCalls:
    """A communicator's blocking small allreduce of a numpy array, and its barrier, run on
    the caller's thread (``Engine.run_direct``) in the fewest Python steps: the most frequent calls
    of all (a loss, a metric, a layer's gradients in forward mode), where each step of the
    general path (a ``Buffer``, a ``Plan``, ``NativeBackend.run``) costs as much as a look at
    the wire. The same operations as the general path's, key, descriptor and algorithm
    alike; an allreduce this does not take (``prepared`` says None) the general path runs,
    with its checks and errors."""

    def __init__(self, backend: NativeBackend) -> None:
        self._backend = backend
        self._known: dict[tuple[np.dtype[Any], str, int], Prepared | None] = {}
        empty = numpy_dtype(np.dtype(np.uint8))
        assert empty is not None
        self._barrier = Descriptor(KINDS["barrier"], empty.code, 0, 0, 0)

    def prepared(self, x: Array, op: str) -> Prepared | None:
        """``x``'s element type, the operation's descriptor and lane slot header, if this runs
        it: a small, contiguous, writable array and a reduction its type takes. Kept per
        dtype, reduction and count (a loop posts the same)."""
        flags = x.flags
        if not (flags.c_contiguous and flags.writeable):
            return None
        same = (x.dtype, op, x.size)
        found = self._known.get(same, False)
        if found is False:
            found = self._learn(x, op)
            if len(self._known) >= 256:
                self._known.clear()
            self._known[same] = found
        return found  # type: ignore[return-value]

    def _learn(self, x: Array, op: str) -> Prepared | None:
        dtype = numpy_dtype(x.dtype)
        if dtype is None or (dtype.code, op) not in REDUCIBLE or x.nbytes > SMALL_ALLREDUCE_BYTES:
            return None
        desc = Descriptor(KINDS["allreduce"], dtype.code, REDUCTION_CODES[op], 0, x.size)
        return dtype, desc, header(HERE, desc)

    def allreduce(
        self, x: Array, prepared: Prepared, op: str, key: Key, label: str, priority: int,
        runner: CallbackRunner,
    ) -> Request[Any] | None:  # fmt: skip
        """``Engine.run_direct`` of the allreduce of ``x`` (``prepared``), numbered ``key``, or
        ``Lane.run_waiting`` where the lane takes it (unnamed; ``NativeBackend.run``'s checks):
        None, done in place; else its request."""
        backend = self._backend
        dtype, desc, head = prepared
        flat = x if x.ndim == 1 else x.reshape(-1)
        lane = backend.lane
        if lane is not None and key[0] and lane.named is not None:
            backend.admitted(label, desc)
            in_lane = _lane_adopter(key, label, desc, lambda: as_buffer(x, "x"), op, lambda: x,
                                    None, 0.0, runner)  # fmt: skip
            made = lane.run_named(key, label, desc, head, flat, dtype, op, in_lane)
            if made is not False:
                return made
            request: Request[Any] = Request(label, runner)  # the lane cannot take it: the engine
            plan = Plan("allreduce", as_buffer(x, "x"), lambda: x, op)
            backend.on_engine(plan, key, label, priority, None, request, announce=True)
            return request
        if lane is not None and not key[0]:
            backend.admitted(label, desc)
            in_lane = _lane_adopter(key, label, desc, lambda: as_buffer(x, "x"), op, lambda: x,
                                    None, 0.0, runner)  # fmt: skip
            return lane.run_waiting(key[1], head, flat, dtype, op, None, in_lane)
        algo = DirectAllreduce(backend.rank, backend.world_size, flat, dtype, op)
        log_post(backend.rank, label, desc)
        adopt = _adopter(key, label, desc, algo, lambda: x, priority, None, runner)
        return backend.engine.run_direct(key, label, desc, algo, priority, None, adopt)

    def barrier(self, key: Key, label: str, runner: CallbackRunner) -> Request[Any] | None:
        """``Engine.run_direct`` of a barrier numbered ``key`` (``Lane.run_waiting``, where the
        lane takes it: ``NativeBackend.run``): None, done; else its request."""
        backend, desc = self._backend, self._barrier
        lane = backend.lane
        if lane is not None and (not key[0] or lane.named is not None):
            return backend.run(plans.barrier(), key, label, 0, None, runner)
        backend.note_slot(key, desc)  # (as _built does)
        algo = Barrier(backend.rank, backend.world_size)
        log_post(backend.rank, label, desc)
        adopt = _adopter(key, label, desc, algo, _nothing, 0, None, runner)
        return backend.engine.run_direct(key, label, desc, algo, 0, None, adopt)


def _lane_adopter(
    key: Key, label: str, desc: Descriptor, buffer: Callable[[], Buffer], op: str,
    result: Callable[[], Any], timeout: float | None, posted: float, runner: CallbackRunner,
) -> Callable[[], LaneOp]:  # fmt: skip
    """How a blocking call makes its ``LaneOp`` (with a request whose callbacks ``runner``
    runs) where ``Lane.run_waiting`` cannot finish it alone: only then, since most never need
    one."""

    def adopt() -> LaneOp:
        made = LaneOp(key, label, desc, buffer(), op, result, timeout, posted)
        made.request = Request(label, runner)
        return made

    return adopt


def _nothing() -> None:
    """A barrier's result."""


def _adopter(
    key: Key, label: str, desc: Descriptor, algo: Collective | RunsDirectly,
    result: Callable[[], Any],
    priority: int, timeout: float | None, runner: CallbackRunner,
) -> Callable[[], Operation]:  # fmt: skip
    """How a blocking call makes its ``Operation`` (with a request whose callbacks ``runner``
    runs) where it cannot run on its caller's thread to the end (``Engine.run_direct``'s ``adopt``):
    only then, since most never need one. The engine goes on with ``algo.algorithm``, from
    wherever the run left it."""

    def adopt() -> Operation:
        request: Request[Any] = Request(label, runner)
        return Operation(key, label, desc, algo.algorithm, request, result, priority, timeout)

    return adopt


class LocalBackend:
    """A world of one: nothing to talk to; every operation completes as it is posted."""

    devices = False
    members: tuple[int, ...] = (0,)
    engine: Engine | None = None
    ordered: OrderedEngine | None = None
    broken: BaseException | None = None

    def __init__(self) -> None:
        self.planes = SharedPlanes(False, None)

    def refusal(self, plan: Plan, priority: int) -> str | None:
        return None

    def submit(
        self, plan: Plan, key: Key, label: str, priority: int, timeout: float | None,
        request: Request[Any],
    ) -> None:  # fmt: skip
        algo, desc = built(plan, 0, 1, self.planes)
        log_post(0, label, desc)
        algo.start()
        request.set_result(plan.result())

    def group(self, members: tuple[int, ...]) -> LocalBackend:
        return LocalBackend()

    def close(self) -> None:
        pass

    def abort(self, reason: str) -> None:
        pass

    @property
    def stall_reports(self) -> list[str]:
        return []

    @property
    def data_plane(self) -> DataPlane:
        return DataPlane("local")

    def flight_record(self) -> dict[str, Any]:
        return {"rank": 0, "world_size": 1, "records": []}

    def dump_flight_record(self, path: str) -> str:
        raise UsageError("a world of one records no operations")
