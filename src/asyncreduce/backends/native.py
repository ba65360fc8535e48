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
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .. import plans
from ..algorithms import (
    KINDS,
    REDUCIBLE,
    REDUCTION_CODES,
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
from ..errors import BrokenError, ClosedError
from ..flight import settle
from ..keys import Key
from ..lane import Lane, LaneOp
from ..plans import Plan
from ..protocol.operation import Operation
from ..protocol.route import DIRECT, LANE, NAMED, NO_LANE, UNNAMED, route, small
from ..request import CallbackRunner, Request
from ..samehost.mailbox import HERE, Mailbox, SlotHeader, header
from ..samehost.named import NamedSlots
from ..samehost.planes import DataPlane, SharedPlanes
from ..transport.frame import Descriptor
from .common import EngineBackend, log_post

if TYPE_CHECKING:
    from .ordered.engine import OrderedEngine

__all__ = ["Described", "DirectCalls", "NativeBackend", "adopter", "built"]

Prepared = tuple[DType, Descriptor, SlotHeader]  # Described: type, descriptor, slot header
_KEPT = 256  # Described: at most this many (a loop posts the same few)


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
                     shared, planes.lent_cores())  # fmt: skip
    return algo, plan.descriptor(root, buf.dtype.code)


class NativeBackend(EngineBackend):
    """A communicator (or a group of it: ``members``) over our own ``Engine``."""

    devices = False
    ordered: OrderedEngine | None = None
    epoch = 0  # the membership it belongs to (asyncreduce.shrink: survivors.py)

    def __init__(
        self, engine: Engine, rank: int, world_size: int, planes: SharedPlanes,
        members: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        self.engine = self._runs = engine
        self.rank, self.world_size = rank, world_size  # the communicator's numbering
        self.planes = planes
        self.members = tuple(range(engine.world_size)) if members is None else members
        self.whole = self.members == tuple(range(engine.world_size))  # not a true subgroup
        self.lane: Lane | None = None  # the world's same-host lane, once opened (lane/)
        self.reach = NO_LANE  # what the lane takes (protocol/route.py)
        self.small_ways = self._small_ways()
        self.described = Described()

    def _small_ways(self) -> tuple[int, int]:
        """The ways of a small allreduce a caller waits for, named and not (``route``'s, kept:
        the direct calls ask for every call, and only the lane's opening changes them)."""
        whole = self.whole
        named = route("allreduce", 0, True, self.reach, True, whole)
        return named, route("allreduce", 0, False, self.reach, True, whole)

    def retire(self) -> None:
        """Its membership is over (asyncreduce.shrink): its operations go to the engine, whose
        session refuses them as of an earlier membership (the lane still holds lost ranks)."""
        self.lane, self.reach = None, NO_LANE
        self.small_ways = self._small_ways()

    def way(self, kind: str, nbytes: int, key: Key, waiting: bool) -> int:
        """Where an operation goes (protocol/route.py)."""
        return route(kind, nbytes, bool(key[0]), self.reach, waiting, self.whole)

    def submit(
        self, plan: Plan, key: Key, label: str, priority: int, timeout: float | None,
        request: Request[Any],
    ) -> None:  # fmt: skip
        announce = False
        lane = self.lane
        if lane is not None and self.way(plan.kind, plan.buf.flat.nbytes, key, False) == LANE:
            _, desc, _ = self._admitted(plan, key, label)
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
        op = Operation(key, label, desc, request, plan.result, timeout, algo, priority)
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
        if not self.whole:
            engine = self.engine
            algo = Translated(algo, self.members, engine.rank, engine.world_size)
        log_post(self.rank, label, desc)
        return algo, desc

    def note_slot(self, key: Key, desc: Descriptor) -> None:
        """Where the lane is open, an unnamed operation it does not take is noted in its slot:
        every unnamed operation takes one, and the lane's next one waits for it."""
        if self.lane is not None and not key[0]:
            self.lane.note(key[1], desc)

    def run_waiting(
        self, plan: Plan, key: Key, label: str, priority: int, timeout: float | None,
        runner: CallbackRunner,
    ) -> Request[Any] | None:  # fmt: skip
        """``submit`` for a caller that waits for the operation at once, the way ``route``
        says: an unnamed one in the lane runs on the caller's thread where it can
        (``Lane.run_waiting``), and so does a direct run (``Engine.run_direct``); None: done,
        its result is in place. Any other gets a request (``runner`` runs its callbacks),
        returned."""
        buf = plan.buf
        way = self.way(plan.kind, buf.flat.nbytes, key, True)
        if way != LANE:
            algo, desc = self._built(plan, key, label)
            adopt = adopter(label, runner, _operation, key, label, desc, algo, plan.result,
                            priority, timeout)  # fmt: skip
            if way == DIRECT:
                assert isinstance(algo, (RecursiveDoubling, Barrier))  # (``route``)
                return self.engine.run_direct(key, label, desc, algo, priority, timeout, adopt)
            op = adopt()
            self.engine.submit(op)
            return op.request
        if key[0]:
            request: Request[Any] = Request(label, runner)
            self.submit(plan, key, label, priority, timeout, request)
            return request
        assert self.lane is not None  # (``route``: LANE)
        _, desc, head = self._admitted(plan, key, label)
        posted = time.monotonic() if timeout is not None else 0.0
        reduce_op = plan.op or "sum"
        adopt_op = adopter(label, runner, _lane_op, key, label, desc, lambda: buf, reduce_op,
                           plan.result, timeout, posted)  # fmt: skip
        return self.lane.run_waiting(key, desc, head, buf.flat, buf.dtype, reduce_op, timeout,
                                     adopt_op)  # fmt: skip

    def _small_allreduce(self, plan: Plan) -> tuple[Collective, Descriptor] | None:
        """What ``built`` makes of a small allreduce (recursive doubling: no shared memory
        when ``small``), its descriptor kept (``described``): the most frequent operation,
        whose general build cost as much as a look at the wire. None for any other."""
        buf = plan.buf
        if plan.kind != "allreduce" or not small(buf.flat.nbytes):
            return None
        op = plan.op or "sum"
        algo = RecursiveDoubling(self.rank, self.world_size, buf.flat, buf.dtype, op)
        return algo, self.described.plan(plan)[1]

    def _lane_op(
        self, plan: Plan, key: Key, label: str, timeout: float | None, desc: Descriptor
    ) -> LaneOp:
        return LaneOp(key, label, desc, plan.buf, plan.op or "sum", plan.result, timeout)

    def _admitted(self, plan: Plan, key: Key, label: str) -> Prepared:
        """A lane operation's type, descriptor and slot header (``described``), ``admitted``."""
        found = self.described.plan(plan)
        self.admitted(key, label, found[1])
        return found

    def admitted(self, key: Key, label: str, desc: Descriptor) -> None:
        """A lane operation refused (raised) if the engine refuses posts (closed, broken),
        else logged. Not for a goodbye: the lane fails an operation only if the rank that
        left has not published it (``Session.watch_outside``), as every rank judges it,
        whenever it posted it and read the goodbye."""
        refused = self.engine.refusal(label, False, key)
        if refused is not None:
            raise refused
        log_post(self.rank, label, desc)

    def open_lane(self, mailbox: Mailbox, named: NamedSlots | None = None) -> None:
        """Send the world's small allreduces through ``mailbox`` from now on, named ones too
        where there are ``named`` slots (every rank switches at the same point: after the
        collective that made the mailboxes)."""
        self.lane = Lane(mailbox, self.rank, self.world_size, self.convert, self.engine.nudge,
                         named, self.engine.flight)  # fmt: skip
        self.reach = UNNAMED if named is None else NAMED
        self.small_ways = self._small_ways()
        self.engine.take_lane(self.lane)

    def convert(self, op: LaneOp) -> None:
        """Run a lane operation on the engine after all (a peer runs it there, or disagrees
        about it): the engine's matching completes it or fails it on every rank."""
        kind = "barrier" if op.desc.kind == KINDS["barrier"] else "allreduce"  # (``route``)
        algo = build(kind, self.rank, self.world_size, op.buf.flat, op.buf.dtype, op.op)
        made = Operation(op.key, op.label, op.desc, op.request, op.result, op.timeout, algo)
        made.announce = bool(op.key[0])  # peers whose lane holds it must hand it over too
        made.record = op.record  # (its flight record, if the lane watched it: one per operation)
        try:
            self.engine.submit(made)
        except (BrokenError, ClosedError) as exc:
            settle(self.engine.flight, self.rank, op.label, op.key, op.desc, 0, op.started,
                   time.monotonic(), exc, op.record)  # fmt: skip
            op.request.set_exception(exc)

    def group(self, members: tuple[int, ...]) -> NativeBackend:
        engine_ranks = tuple(self.members[r] for r in members)
        planes = self.planes.for_group(engine_ranks, self.engine.world_size)
        return NativeBackend(self.engine, members.index(self.rank), len(members), planes,
                             engine_ranks)  # fmt: skip

    @property
    def data_plane(self) -> DataPlane:
        return dataclasses.replace(self.planes.data_plane("native"), lane=self.lane is not None)


class Described:
    """The type, descriptor and lane slot header of the small operations a loop posts again and
    again, kept per kind, element type, reduction and count (building them costs more than a
    look at the wire), at most ``_KEPT`` of them; for the general path (``plan``) and the
    direct calls (``array``) alike."""

    def __init__(self) -> None:
        self._known: dict[tuple[Any, ...], Prepared | None] = {}

    def plan(self, plan: Plan) -> Prepared:
        """``plan``'s (an allreduce or a barrier, checked by the caller)."""
        buf, op = plan.buf, plan.op or "sum"
        same = (plan.kind, buf.dtype.code, op, buf.flat.size)
        found = self._known.get(same)
        if found is None:
            found = self._keep(same, _prepared(buf.dtype, plan.descriptor(0, buf.dtype.code)))
        return found  # type: ignore[no-any-return]

    def array(self, x: Array, op: str) -> Prepared | None:
        """An allreduce of ``x``'s, if the direct calls run it: a small, contiguous, writable
        array and a reduction its type takes (``DirectCalls``)."""
        flags = x.flags
        if not (flags.c_contiguous and flags.writeable):
            return None
        same = (x.dtype, op, x.size)
        found = self._known.get(same, False)
        if found is False:
            found = self._keep(same, _allreduce(x, op))
        return found  # type: ignore[return-value]

    def _keep(self, same: tuple[Any, ...], found: Prepared | None) -> Any:
        if len(self._known) >= _KEPT:
            self._known.clear()
        self._known[same] = found
        return found


def _allreduce(x: Array, op: str) -> Prepared | None:
    """``Described.array``'s, made: None where the direct calls do not take it."""
    dtype = numpy_dtype(x.dtype)
    if dtype is None or (dtype.code, op) not in REDUCIBLE or not small(x.nbytes):
        return None
    return _prepared(dtype, Descriptor(KINDS["allreduce"], dtype.code, REDUCTION_CODES[op], 0,
                                       x.size))  # fmt: skip


def _prepared(dtype: DType, desc: Descriptor) -> Prepared:
    return dtype, desc, header(HERE, desc)


class DirectCalls:
    """A communicator's blocking small allreduce of a numpy array, and its barrier, run on
    the caller's thread in the fewest Python steps, the way ``route`` says (the lane's
    ``run_waiting``/``run_named``, or ``Engine.run_direct``): the most frequent calls of all
    (a loss, a metric, a layer's gradients in forward mode), where each step of the general
    path (a ``Buffer``, a ``Plan``, ``NativeBackend.run_waiting``) costs as much as a look at the
    wire. The same operations as the general path's, key, descriptor and algorithm alike; an
    allreduce this does not take (``prepared`` says None) the general path runs, with its
    checks and errors."""

    def __init__(self, backend: NativeBackend) -> None:
        self._backend = backend
        # ``x``'s element type, the operation's descriptor and lane slot header, if this runs
        # it: ``prepared(x, op)`` (bound here: it is asked for every call)
        self.prepared: Callable[[Array, str], Prepared | None] = backend.described.array
        empty = numpy_dtype(np.dtype(np.uint8))
        assert empty is not None
        self._barrier = Descriptor(KINDS["barrier"], empty.code, 0, 0, 0)

    def allreduce(
        self, x: Array, prepared: Prepared, op: str, key: Key, label: str, priority: int,
        runner: CallbackRunner,
    ) -> Request[Any] | None:  # fmt: skip
        """The allreduce of ``x`` (``prepared``), numbered ``key``, the way ``route`` says:
        None, done in place; else its request."""
        backend = self._backend
        dtype, desc, head = prepared
        flat = x if x.ndim == 1 else x.reshape(-1)
        way = backend.small_ways[not key[0]]
        if way != LANE:
            assert way == DIRECT  # (``route``: DirectCalls is the world's)
            algo = DirectAllreduce(backend.rank, backend.world_size, flat, dtype, op)
            log_post(backend.rank, label, desc)
            adopt_run = adopter(label, runner, _operation, key, label, desc, algo, lambda: x,
                                priority, None)  # fmt: skip
            return backend.engine.run_direct(key, label, desc, algo, priority, None, adopt_run)
        lane = backend.lane
        assert lane is not None  # (``route``)
        backend.admitted(key, label, desc)
        adopt = adopter(label, runner, _lane_op, key, label, desc, lambda: as_buffer(x, "x"), op,
                        lambda: x, None, 0.0)  # fmt: skip
        if not key[0]:
            return lane.run_waiting(key, desc, head, flat, dtype, op, None, adopt)
        made = lane.run_named(key, label, desc, head, flat, dtype, op, adopt)
        if made is not False:
            return made
        request: Request[Any] = Request(label, runner)  # the lane cannot take it: the engine
        plan = Plan("allreduce", as_buffer(x, "x"), lambda: x, op)
        backend.on_engine(plan, key, label, priority, None, request, announce=True)
        return request

    def barrier(self, key: Key, label: str, runner: CallbackRunner) -> Request[Any] | None:
        """A barrier numbered ``key``, the way ``route`` says (the lane's through
        ``NativeBackend.run_waiting``): None, done; else its request."""
        backend, desc = self._backend, self._barrier
        if backend.way("barrier", 0, key, True) != DIRECT:
            return backend.run_waiting(plans.barrier(), key, label, 0, None, runner)
        backend.note_slot(key, desc)  # (as _built does)
        algo = Barrier(backend.rank, backend.world_size)
        log_post(backend.rank, label, desc)
        adopt = adopter(label, runner, _operation, key, label, desc, algo, _nothing, 0, None)
        return backend.engine.run_direct(key, label, desc, algo, 0, None, adopt)


T = TypeVar("T", Operation, LaneOp)


def adopter(
    label: str, runner: CallbackRunner, make: Callable[..., T], *args: Any
) -> Callable[[], T]:
    """How a blocking call makes its operation, ``make(request, *args)`` with a request whose
    callbacks ``runner`` runs, where it cannot finish on its caller's thread
    (``Engine.run_direct``'s and the lane's ``adopt``): only then, since most never need one.
    One closure per call: this is made for every blocking call."""

    def adopt() -> T:
        return make(Request(label, runner), *args)

    return adopt


def _operation(
    request: Request[Any], key: Key, label: str, desc: Descriptor,
    algo: Collective | RunsDirectly, result: Callable[[], Any], priority: int,
    timeout: float | None,
) -> Operation:  # fmt: skip
    """An engine operation of a run given up: the engine goes on with ``algo.algorithm``, from
    wherever the run left it."""
    return Operation(key, label, desc, request, result, timeout, algo.algorithm, priority)


def _lane_op(
    request: Request[Any], key: Key, label: str, desc: Descriptor, buffer: Callable[[], Buffer],
    op: str, result: Callable[[], Any], timeout: float | None, posted: float,
) -> LaneOp:  # fmt: skip
    """A lane operation of a run the lane's caller could not finish alone."""
    made = LaneOp(key, label, desc, buffer(), op, result, timeout, posted)
    made.request = request
    return made


def _nothing() -> None:
    """A barrier's result."""
