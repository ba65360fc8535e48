"""Going on without lost ranks: ``shrink`` (ULFM's ``MPIX_Comm_shrink``, with no coordinator and
no help from the lost ranks).

After a failure breaks the communicator (a rank killed, stopped, cut off or slower than the
peer timeout: every survivor's pending and later operations fail with BrokenError), each
survivor calls ``shrink(comm)``. The ranks still alive agree on who remains
(protocol/membership.py: Paxos over the ranks, any of them may lead, rank 0 included) over the
connections they already have, and each gets a communicator of the survivors, numbered 0..k-1
in the order of their old ranks. A rank the others excluded (it came back from a stop, or its
link) gets BrokenError saying so, and never disturbs them: the survivors ignore whatever it
still sends of the old membership.

``let_in`` is the other way: at a step boundary the members let in the processes that
restarted lost ranks and knocked on their doors (bootstrap/doors.py), on a new communicator.

Only the native engine can do this: over ``backend="mpi"`` (Open MPI 4 ends the whole job when
a rank dies) and ``backend="torch"`` it raises UsageError. See docs/elastic.md.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .backends.native import NativeBackend
from .bootstrap.doors import Admission, Door
from .bootstrap.native import connect_admitted
from .comm import Communicator
from .engine.parts import ShrinkCall
from .errors import ClosedError, UsageError
from .keys import Keys
from .protocol.epochs import epoch_prefix
from .protocol.operation import Settings
from .request import Request

__all__ = ["let_in", "shrink"]

log = logging.getLogger("asyncreduce.comm")


def shrink(comm: Communicator, timeout: float | None = 60.0) -> Communicator:
    """A communicator of the ranks of ``comm`` still alive, as they all agree (see the module
    docstring); every survivor calls it. ``comm`` then refuses new operations (BrokenError);
    closing it closes nothing, closing the one returned closes the connections.

    Raises BrokenError on a rank the others excluded, and TimeoutError after ``timeout``
    seconds where this rank reaches fewer than a quorum of the ranks (more than half; of two
    halves, the one holding the lowest rank): it is cut off, or most ranks are lost."""
    backend = comm._backend
    if comm._parent is not None:
        raise UsageError("shrink the communicator this group lives on, then make the group again")
    if not isinstance(backend, NativeBackend):
        raise UsageError(
            "shrink needs the native engine (the default backend): over MPI (Open MPI 4 ends "
            "the whole job when a rank dies) or torch.distributed a lost rank ends the job"
        )  # fmt: skip
    if comm._closed:
        raise ClosedError("shrink: the communicator is closed")
    engine = backend.engine
    label = f"shrink of membership {backend.epoch} on rank {comm.rank}"
    request: Request[frozenset[int]] = Request(label, comm._runner)
    engine.shrink(ShrinkCall(backend.epoch, request))
    try:
        survivors = request.wait(timeout)
    except TimeoutError as exc:
        raise TimeoutError(
            f"rank {comm.rank}: no agreement on who is alive within {timeout} s: this rank "
            "reaches fewer than a quorum of the ranks (it may be cut off, or most are lost)"
        ) from exc
    return _successor(comm, backend, tuple(sorted(survivors)))


def _successor(
    comm: Communicator, backend: NativeBackend, members: tuple[int, ...]
) -> Communicator:
    """The survivors' communicator (``members``: their engine ranks), which takes over the
    engine, the callbacks' thread and the shared memory from ``comm``."""
    engine = backend.engine
    planes = backend.planes.for_group(members, engine.world_size)
    rank = members.index(engine.rank)
    successor_backend = NativeBackend(engine, rank, len(members), planes, members)
    successor_backend.epoch = epoch = backend.epoch + 1
    successor = Communicator(rank, len(members), successor_backend,
                             local=(comm.local_rank, comm.local_world_size))  # fmt: skip
    successor._runner.close()
    successor._runner = comm._runner
    successor._keys = Keys(epoch_prefix(epoch).decode())
    successor._clock_origin = comm._clock_origin
    comm._parent = successor  # (its close closes nothing now; its abort aborts the successor)
    backend.retire()
    return successor


def let_in(
    comm: Communicator, door: Door, doors: list[tuple[str, int]], slots: tuple[int, ...],
    attempt: int, timeout: float = 10.0,
) -> tuple[Communicator, tuple[int, ...]] | None:  # fmt: skip
    """Every member calls it at the same step boundary (``slots``: the slot of each rank of
    ``comm``; ``attempt``: a number the members share and never use twice, such as the
    step). If somebody knocked for a vacant slot on any member's door, they all form a new
    communicator with the joiners, which come after the members, and return it with its
    slots; else None.

    The members first share what they heard (one allreduce: the largest nonce per vacant
    slot), so they all admit the same joiners; the door of rank 0 serves the rendezvous. If
    forming it failed anywhere (one allreduce on ``comm`` says), they all close it and
    return None: ``comm`` stands. ``comm`` is not closed here."""
    vacant = [s for s in range(len(doors)) if s not in slots]
    if not vacant:
        return None
    heard = door.knocks(vacant)
    nonces = np.array([heard.get(s, 0) for s in vacant], np.int64)
    nonces = comm.allreduce(nonces, op="max", name="asyncreduce.let_in.knocks")
    joiners = [(s, int(n)) for s, n in zip(vacant, nonces.tolist(), strict=True) if n]
    if not joiners:
        return None
    order = (*slots, *sorted(s for s, _ in joiners))
    namespace = f"asyncreduce/grow/{attempt}/{'-'.join(str(n) for _, n in joiners)}/"
    for slot, nonce in joiners:
        door.admit(slot, nonce, Admission(doors[slots[0]], namespace, order.index(slot),
                                          len(order), order))  # fmt: skip
    mine = Admission(doors[slots[0]], namespace, comm.rank, len(order), order)
    grown = connect_admitted(mine, time.monotonic() + timeout, Settings.from_env())
    for slot, nonce in joiners:
        door.forget(slot, nonce)
    formed = comm.allreduce(np.array([grown is not None], np.int64), op="min",
                            name="asyncreduce.let_in.formed")  # fmt: skip
    if formed[0] and grown is not None:
        return grown, order
    log.warning("rank %d: the new membership %s did not form everywhere; going on without "
                "slots %s", comm.rank, order, [s for s, _ in joiners])  # fmt: skip
    if grown is not None:
        grown.abort("the members gave up forming this membership")
    return None
