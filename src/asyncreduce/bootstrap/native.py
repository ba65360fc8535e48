"""A native communicator: steps 1-5 of the package docstring over the job's store."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time

import numpy as np

from ..auth import secret_from_env
from ..comm import Communicator
from ..engine import Engine
from ..errors import BrokenError, UsageError
from ..launchers import Place, Rendezvous, detect
from ..protocol.operation import Settings
from ..rendezvous import PrefixStore, Store, TCPStore
from ..rendezvous.signed import signed
from ..transport.mesh import connect_mesh
from ..transport.tcp import TcpTransport
from .doors import Admission, doors_from_env, knock
from .meet import ABORT, gather, remaining
from .samehost import cross_memory, identity, local_place, open_lane, share_memory
from .stores import open_store

__all__ = ["connect", "connect_admitted", "join", "rejoin"]

log = logging.getLogger("asyncreduce.comm")
_INITS = itertools.count()  # rendezvous made by this process: each gets its own namespace


def join(
    rank: int | None, world_size: int | None, master_addr: str | None, master_port: int | None,
    init_method: str | None, timeout: float,
) -> Communicator:  # fmt: skip
    """``init(backend="native")``, its arguments checked: meet in a torch job's store if this
    is one and nothing was given, else in the store the launcher names."""
    explicit = (rank, world_size, master_addr, master_port, init_method) != (None,) * 5
    torch_job = None if explicit else _torch_job()
    if torch_job is not None:  # inside a torch.distributed job: meet in its store
        store, torch_rank, torch_world = torch_job
        place = _in_torch_job(torch_rank, torch_world)
    else:
        place = detect(rank, world_size, master_addr, master_port, init_method)
    if place.world_size == 1:
        log.info("rank 0 of 1 joined (launcher: %s): nobody to talk to", place.launcher)
        return Communicator(0, 1, None)
    settings = Settings.from_env()  # a bad value fails here, before anyone waits for us
    deadline = time.monotonic() + timeout
    if torch_job is not None:
        from ..c10d_store import C10dStore

        shared = C10dStore(torch_job[0], timeout, os.environ.get("MASTER_ADDR"))
        return connect(PrefixStore(_namespace(place), shared), place, deadline, settings,
                       serving=False)  # fmt: skip
    store, serving = open_store(place, timeout)
    try:
        return connect(PrefixStore(_namespace(place), store), place, deadline, settings,
                       serving=serving)  # fmt: skip
    finally:
        store.close()


def rejoin(timeout: float) -> Communicator:
    """``init`` in a process that restarts a rank of a running elastic job: knock on the
    other members' doors (doors.py) until they let it in, then connect to the new membership.
    Its rank there is not its old one (the members keep theirs, joiners come after them):
    ``comm.admission.slots`` names each rank's place in ``ASYNCREDUCE_DOORS``."""
    doors = doors_from_env()
    if doors is None:
        raise UsageError("a restarted rank finds the job through ASYNCREDUCE_DOORS, which is unset")
    slot = detect().rank
    deadline = time.monotonic() + timeout
    settings = Settings.from_env()
    while True:
        admission = knock(doors, slot, deadline)
        comm = connect_admitted(admission, deadline, settings)
        if comm is not None:
            comm.admission = admission
            return comm
        log.info("slot %d: the members gave up forming %s; knocking again", slot,
                 admission.namespace)  # fmt: skip


def connect_admitted(
    admission: Admission, deadline: float, settings: Settings
) -> Communicator | None:
    """The communicator of a new membership, as ``admission`` describes it; None if it could
    not be formed (someone failed meanwhile: the reason is logged)."""
    host, port = admission.rendezvous
    place = Place(admission.rank, admission.world_size, None, None, "asyncreduce rejoin",
                  Rendezvous("serve", host, port))  # fmt: skip
    try:
        store = TCPStore(host, port, is_server=False, timeout=max(0.1, remaining(deadline)))
    except (OSError, BrokenError) as exc:
        log.warning("rank %d of %s: %s", admission.rank, admission.namespace, exc)
        return None
    try:
        return connect(PrefixStore(admission.namespace, store), place, deadline, settings,
                       serving=False)  # fmt: skip
    except (OSError, BrokenError, UsageError) as exc:
        log.warning("rank %d of %s could not connect: %s", admission.rank, admission.namespace,
                    exc)  # fmt: skip
        return None
    finally:
        store.close()


def _torch_job() -> tuple[object, int, int] | None:
    """(store, rank, world size) of an initialized torch.distributed job, if this is one."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    return store, dist.get_rank(), dist.get_world_size()


def _in_torch_job(rank: int, world_size: int) -> Place:
    """A torch job's place: its rank and size, the local ones from its launcher if it said."""
    try:
        launched = detect(env=os.environ)
        local = (launched.local_rank, launched.local_world_size)
        launcher = f"torch.distributed ({launched.launcher})"
    except UsageError:
        local, launcher = (None, None), "torch.distributed"
    return Place(rank, world_size, *local, launcher, Rendezvous("agent"))


def _namespace(place: Place) -> str:
    """Where this rendezvous keeps its keys: a store of our own is new for every init, but
    torchrun's (or a torch job's) lives as long as the job, so each init there gets keys of
    its own (numbered per process: every rank calls init as often) under the attempt's
    restart count."""
    if place.rendezvous.kind != "agent":
        return "asyncreduce/"
    return f"asyncreduce/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_INITS)}/"


def connect(
    store: Store, place: Place, deadline: float, settings: Settings, *, serving: bool
) -> Communicator:
    """Steps 1-5 of the module docstring over ``store``; ``serving``: this rank serves it.
    With a secret, every value in a store that does not authenticate its clients itself
    (torch's, a file store) is signed and checked (rendezvous/signed.py)."""
    store = signed(store, secret_from_env())
    rank, world_size = place.rank, place.world_size
    _agree_on_world_size(store, rank, world_size, deadline)
    host = _local_address(_store_host(store))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((host, 0))
        listener.listen(world_size)
        if rank == 0:
            store.set("token", os.urandom(16))
        token = store.get("token", remaining(deadline))
        me = f"{host}:{listener.getsockname()[1]}".encode()
        # a rank serving the store waits a little longer, so the others time out on their own
        # (naming who is missing) instead of seeing the store vanish
        wait = remaining(deadline) + (0.5 if serving else 0.0)
        found = gather(store, "addr", rank, world_size, me, wait)
        addresses = [(a.decode().rsplit(":", 1)[0], int(a.decode().rsplit(":", 1)[1]))
                     for a in found]  # fmt: skip
        socks = connect_mesh(rank, world_size, listener, addresses, token, deadline)
        identities = gather(store, "host", rank, world_size, identity(), remaining(deadline))
        arenas, tcp_only = share_memory(store, rank, world_size, identities, deadline)
        one_host = len(arenas) == world_size - 1
        cross, no_cross = (
            cross_memory(store, rank, world_size, deadline)
            if one_host
            else (None, "not every rank is on this host")
        )
        if serving:
            _leave_store(store, rank, world_size, deadline)
        else:
            store.set(f"left/{rank}", b"")
    local = local_place(place, identities)
    engine = Engine(rank, world_size, lambda s: TcpTransport(rank, socks, s, arenas), settings)
    comm = Communicator(rank, world_size, engine, one_host, cross, local)
    comm._clock_origin = _shared_clock_origin(comm, one_host, remaining(deadline))
    open_lane(comm, remaining(deadline))
    log.info("%s", _describe(comm, place.launcher, sorted(arenas), tcp_only, one_host, no_cross))
    return comm


def _agree_on_world_size(store: Store, rank: int, world_size: int, deadline: float) -> None:
    """Every rank must have been told rank 0's world size: one that was not tells everyone."""
    if rank == 0:
        store.set("world", str(world_size).encode())
        return
    try:
        theirs = int(store.get("world", remaining(deadline)))
    except TimeoutError:
        raise TimeoutError(f"rendezvous: rank 0 never joined (rank {rank} waited for it)") from None
    if theirs != world_size:
        reason = (f"ranks disagree on the world size: rank 0 was told {theirs}, rank {rank} "
                  f"{world_size}; give every rank the same WORLD_SIZE")  # fmt: skip
        store.set(ABORT, reason.encode())
        raise UsageError(reason)


def _store_host(store: Store) -> str:
    found = getattr(store, "host", None)
    return found if isinstance(found, str) and found else "127.0.0.1"


def _local_address(toward: str) -> str:
    """The address of this host on the route to ``toward`` (no packet is sent)."""
    override = os.environ.get("ASYNCREDUCE_ADDR")
    if override:
        return override
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((toward, 9))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _leave_store(store: Store, rank: int, world_size: int, deadline: float) -> None:
    """The serving rank closes its store only once every other rank is done with it."""
    for peer in range(world_size):
        if peer != rank:
            store.get(f"left/{peer}", remaining(deadline))


def _describe(
    comm: Communicator, launcher: str, shared: list[int], tcp_only: dict[int, str],
    one_host: bool, no_cross: str,
) -> str:  # fmt: skip
    """The one INFO line of a new communicator: who, and which data plane to each peer."""
    planes = [f"rank {p}: shared memory (same host)" for p in shared]
    planes += [f"rank {p}: tcp ({why})" for p, why in sorted(tcp_only.items())]
    cross = "on" if comm.data_plane.cross_memory else f"off ({no_cross})"
    windows = "on" if one_host else "off (not every rank is on this host)"
    return (
        f"rank {comm.rank} of {comm.world_size} joined (launcher: {launcher}; local rank "
        f"{comm.local_rank} of {comm.local_world_size}); {'; '.join(planes)}; "
        f"cross-memory attach: {cross}; shared windows: {windows}"
    )


def _shared_clock_origin(comm: Communicator, one_host: bool, timeout: float) -> float:
    """This rank's clock reading of the instant rank 0 left a barrier at the end of init.

    On one host every process reads the same CLOCK_MONOTONIC, so rank 0's reading is the
    answer. Across hosts each rank takes, over five barriers, the median of its own reading
    minus rank 0's at the barrier's end, which is its clock's offset up to the barrier's skew
    (about one message latency)."""
    offsets = []
    rank0 = 0.0
    for _ in range(1 if one_host else 5):
        comm.barrier(name="asyncreduce/clock", timeout=timeout)
        now = time.perf_counter()
        readings = comm.allgather(np.array([now]), name="asyncreduce/clock", timeout=timeout)
        rank0 = float(readings[0][0])
        offsets.append(0.0 if one_host else now - rank0)
    return rank0 + sorted(offsets)[len(offsets) // 2]
