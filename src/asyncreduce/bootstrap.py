"""Building a communicator: from the launcher's environment to connected ranks.

Theory of operation. ``init`` asks launchers.py who this process is and how the ranks meet,
opens that store (ours, served by rank 0; torchrun's agent store; a file store; or ours with
its address sent through MPI), and ``connect`` does the rest over it:

1. every rank checks its world size against rank 0's (a rank told otherwise stops every rank
   at once through an ``abort`` key, naming both sizes, instead of leaving them to time out);
2. each rank listens on the address on its route to the store, publishes it, and the mesh is
   dialled (one TCP connection per pair, authenticated when there is a secret);
3. ranks on the same host (same boot and network namespace) map shared-memory arenas, and the
   ranks on a host count themselves (``local_rank``, ``local_world_size``, unless the launcher
   said);
4. when every rank is on one host, cross-memory attach is probed (see cma.py);
5. rank 0 keeps a store it serves open until every rank is done with it; the engine starts,
   the ranks agree on a shared clock origin, and one INFO line says what was chosen.

In torchrun's store, which outlives any one rendezvous, every init keeps its keys under a
namespace of its own (``asyncreduce/<restart>/<n>/``).
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import socket
import struct
import time

import numpy as np

from . import cma
from .auth import secret_from_env
from .cma import CrossMemory
from .comm import Communicator
from .engine import Engine
from .errors import UsageError
from .launchers import Place, Rendezvous, detect
from .protocol.operation import Settings
from .rendezvous import PrefixStore, Store, TCPStore, gather, store_from_env_or_args
from .rendezvous.signed import signed
from .transport.mesh import connect_mesh
from .transport.shm import Arena, Segment, create_arena, host_identity, open_arena
from .transport.tcp import TcpTransport

__all__ = ["connect", "init"]

log = logging.getLogger("asyncreduce.comm")
_INITS = itertools.count()  # rendezvous made by this process: each gets its own namespace
_CHALLENGE = 16  # bytes of the random challenge each rank sends each other rank
_ABORT = "abort"  # the key a rank sets when it finds the job inconsistent


def init(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    *,
    init_method: str | None = None,
    timeout: float = 30.0,
    backend: str | None = None,
    comm: object = None,
    group: object = None,
) -> Communicator:
    """Join the job and connect to every other rank.

    Inside an initialized torch.distributed job (``dist.init_process_group`` first), and with
    no argument given, the ranks meet in that job's store. Otherwise anything not given comes
    from the launcher: ``asyncreduce run``, torchrun (through the
    store its agent serves), srun, mpirun (Open MPI, MPICH/Hydra, MVAPICH, PMIx; on one host
    nothing more is needed, across hosts either MASTER_ADDR/MASTER_PORT or mpi4py), or RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand. ``init_method`` may be
    ``tcp://host:port`` or ``file:///shared/dir``. Raises UsageError when the environment is
    incomplete or contradicts itself, and TimeoutError naming the ranks that did not join
    within ``timeout`` seconds.

    ``backend`` (default: ASYNCREDUCE_BACKEND, else "native"): "native" is our own engine;
    "mpi" runs the same operations over mpi4py (``comm``: a communicator, COMM_WORLD by
    default); "torch" over a group of an initialized torch.distributed job (``group``, its
    WORLD by default: gloo, nccl, ...). See docs/engines.md.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise UsageError(
            f"timeout must be a positive number of seconds (how long to wait for the other "
            f"ranks to join), got {timeout!r}"
        )
    chosen = backend or os.environ.get("ASYNCREDUCE_BACKEND") or "native"
    if chosen not in ("native", "mpi", "torch"):
        raise UsageError(f"backend={chosen!r} is not one of native, mpi, torch")
    if comm is not None and chosen != "mpi" or group is not None and chosen != "torch":
        raise UsageError("comm= is for backend='mpi' and group= for backend='torch'")
    if chosen == "mpi":
        from .ordered.connect import connect_mpi

        return connect_mpi(comm, timeout)
    if chosen == "torch":
        from .ordered.connect import connect_torch

        return connect_torch(group, timeout)
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
        from .c10d_store import C10dStore

        shared = C10dStore(torch_job[0], timeout, os.environ.get("MASTER_ADDR"))
        return connect(PrefixStore(_namespace(place), shared), place, deadline, settings,
                       serving=False)  # fmt: skip
    store, serving = _open_store(place, timeout)
    try:
        return connect(PrefixStore(_namespace(place), store), place, deadline, settings,
                       serving=serving)  # fmt: skip
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


def _open_store(place: Place, timeout: float) -> tuple[Store, bool]:
    """The store of this job, and whether this rank serves it."""
    meeting, rank = place.rendezvous, place.rank
    if meeting.kind == "url":
        return store_from_env_or_args(rank, place.world_size, None, None, meeting.url,
                                      timeout), rank == 0  # fmt: skip
    if meeting.kind == "agent":
        from .c10d_store import torchrun_store

        assert meeting.host is not None and meeting.port is not None
        return torchrun_store(meeting.host, meeting.port, timeout), False
    if meeting.kind == "mpi":
        return _store_through_mpi(place, timeout), rank == 0
    assert meeting.host is not None and meeting.port is not None
    if meeting.derived:
        _warn_derived(place, meeting.host, meeting.port)
    return TCPStore(meeting.host, meeting.port, is_server=rank == 0, timeout=timeout), rank == 0


def _warn_derived(place: Place, host: str, port: int) -> None:
    """Without a secret, warn that a port derived from the job id can be taken first."""
    if secret_from_env() is not None:
        return
    log.warning(
        "SECURITY: the ranks meet at %s:%d, a port derived from the job id (%s): another user "
        "of a host of this job can predict it and serve a store of their own there first. A "
        "rank refuses a store or a rank of another user on its own host, but no rank on "
        "another host can tell. Set ASYNCREDUCE_SECRET (or ASYNCREDUCE_SECRET_FILE) on every "
        "rank; MASTER_PORT chooses the port", host, port, place.launcher,
    )  # fmt: skip


def _store_through_mpi(place: Place, timeout: float) -> TCPStore:
    """mpirun across hosts: rank 0 serves a store on its own address and tells the others
    where through one MPI broadcast of a fixed-size byte buffer (nothing pickled)."""
    from mpi4py import MPI  # initializes MPI if the program has not

    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (place.rank, place.world_size):
        raise UsageError(
            f"{place.launcher} says rank {place.rank} of {place.world_size} but MPI's "
            f"COMM_WORLD says rank {world.Get_rank()} of {world.Get_size()}"
        )
    where = bytearray(256)
    store = None
    if place.rank == 0:
        host = os.environ.get("ASYNCREDUCE_ADDR") or _host_addresses()[0]
        store = TCPStore(host, 0, is_server=True, timeout=timeout)
        where[:] = f"{host} {store.port}".encode().ljust(len(where), b"\0")
    world.Bcast([where, MPI.BYTE], root=0)
    if store is not None:
        return store
    host, port = bytes(where).rstrip(b"\0").decode().split()
    return TCPStore(host, int(port), is_server=False, timeout=timeout)


def _host_addresses() -> list[str]:
    """This host's IPv4 addresses, loopback last (SIOCGIFADDR on every interface)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name[:15].encode())
            try:
                reply = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on this interface
            found.append(socket.inet_ntoa(reply[20:24]))
    return sorted(found, key=lambda address: address.startswith("127.")) or ["127.0.0.1"]


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
        token = store.get("token", _remaining(deadline))
        me = f"{host}:{listener.getsockname()[1]}".encode()
        # a rank serving the store waits a little longer, so the others time out on their own
        # (naming who is missing) instead of seeing the store vanish
        wait = _remaining(deadline) + (0.5 if serving else 0.0)
        found = _gather(store, "addr", rank, world_size, me, wait)
        addresses = [(a.decode().rsplit(":", 1)[0], int(a.decode().rsplit(":", 1)[1]))
                     for a in found]  # fmt: skip
        socks = connect_mesh(rank, world_size, listener, addresses, token, deadline)
        identities = _gather(store, "host", rank, world_size, _identity(), _remaining(deadline))
        arenas, tcp_only = _share_memory(store, rank, world_size, identities, deadline)
        one_host = len(arenas) == world_size - 1
        cross, no_cross = (
            _cross_memory(store, rank, world_size, deadline)
            if one_host
            else (None, "not every rank is on this host")
        )
        if serving:
            _leave_store(store, rank, world_size, deadline)
        else:
            store.set(f"left/{rank}", b"")
    local = _local_place(place, identities)
    engine = Engine(rank, world_size, lambda s: TcpTransport(rank, socks, s, arenas), settings)
    comm = Communicator(rank, world_size, engine, one_host, cross, local)
    comm._clock_origin = _shared_clock_origin(comm, one_host, _remaining(deadline))
    comm._open_lane(_remaining(deadline))
    log.info("%s", _describe(comm, place.launcher, sorted(arenas), tcp_only, one_host, no_cross))
    return comm


def _remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (monotonic), never quite zero: a timeout to pass on."""
    return max(0.001, deadline - time.monotonic())


def _gather(
    store: Store, what: str, rank: int, world_size: int, value: bytes, timeout: float
) -> list[bytes]:
    """``gather`` that gives up at once, with its reason, when a rank set the abort key."""
    return gather(store, what, rank, world_size, value, timeout, abort=_ABORT)


def _agree_on_world_size(store: Store, rank: int, world_size: int, deadline: float) -> None:
    """Every rank must have been told rank 0's world size: one that was not tells everyone."""
    if rank == 0:
        store.set("world", str(world_size).encode())
        return
    try:
        theirs = int(store.get("world", _remaining(deadline)))
    except TimeoutError:
        raise TimeoutError(f"rendezvous: rank 0 never joined (rank {rank} waited for it)") from None
    if theirs != world_size:
        reason = (f"ranks disagree on the world size: rank 0 was told {theirs}, rank {rank} "
                  f"{world_size}; give every rank the same WORLD_SIZE")  # fmt: skip
        store.set(_ABORT, reason.encode())
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


def _identity() -> bytes:
    """This host's identity and whether this rank takes shared memory: "<identity>|<0/1>"."""
    enabled = os.environ.get("ASYNCREDUCE_SHM", "1") != "0"
    return f"{host_identity()}|{int(enabled)}".encode()


def _local_place(place: Place, identities: list[bytes]) -> tuple[int, int]:
    """(local rank, local world size): the launcher's, or counted among same-host ranks."""
    if place.local_rank is not None and place.local_world_size is not None:
        return place.local_rank, place.local_world_size
    hosts = [ident.rsplit(b"|", 1)[0] for ident in identities]
    mine = [r for r, h in enumerate(hosts) if h == hosts[place.rank]]
    return mine.index(place.rank), len(mine)


def _share_memory(
    store: Store, rank: int, world_size: int, identities: list[bytes], deadline: float
) -> tuple[dict[int, tuple[Arena, Arena]], dict[int, str]]:
    """Shared-memory arenas with every rank on this host: {peer: (arena we write, arena we read)},
    and for every other peer why it is TCP only.

    Arenas are anonymous segments (transport/shm.py), never named in /dev/shm, so nothing is
    left behind however the job ends (a rank killed while it waits here included); each rank
    closes its descriptors once every rank has mapped its arenas. ASYNCREDUCE_SHM=0 on either
    side of a pair keeps it on TCP.
    """
    host, enabled = identities[rank].rsplit(b"|", 1)
    local, tcp_only = [], {}
    for p in range(world_size):
        if p == rank:
            continue
        their_host, their_flag = identities[p].rsplit(b"|", 1)
        if their_host != host:
            tcp_only[p] = "another host"
        elif enabled != b"1":
            tcp_only[p] = "ASYNCREDUCE_SHM=0 here"
        elif their_flag != b"1":
            tcp_only[p] = f"ASYNCREDUCE_SHM=0 on rank {p}"
        else:
            local.append(p)
    outgoing: dict[int, tuple[Segment, Arena]] = {}
    arenas: dict[int, tuple[Arena, Arena]] = {}
    try:
        for peer in local:
            outgoing[peer] = create_arena()
            store.set(f"shm/{rank}/{peer}", outgoing[peer][0].name.encode())
        for peer in local:
            theirs = store.get(f"shm/{peer}/{rank}", _remaining(deadline)).decode()
            arenas[peer] = (outgoing[peer][1], open_arena(theirs))
        _gather(store, "shm-mapped", rank, world_size, b"", _remaining(deadline))
    except BaseException:
        for _, arena in outgoing.values():
            arena.close()
        for _, incoming in arenas.values():
            incoming.close()
        raise
    finally:
        for segment, _ in outgoing.values():
            segment.close()
    return arenas, tcp_only


def _cross_memory(
    store: Store, rank: int, world_size: int, deadline: float
) -> tuple[CrossMemory | None, str]:
    """Cross-memory attach with every peer (all on this host), if every rank can read every
    other's memory (see cma.py): each rank sends each other a random challenge through the
    store, keeps those it was sent in its own memory and says where, and reads its own back
    from every peer's pid. ASYNCREDUCE_CMA=0 on any rank turns it off for all; a rank that
    could not read logs why, once. Returns the reader (None: off) and why it is off."""
    wanted = os.environ.get("ASYNCREDUCE_CMA", "1") != "0" and cma.available()
    mine = [os.urandom(_CHALLENGE) for _ in range(world_size)]  # mine[p]: what p must hold
    record = struct.pack("<Q", os.getpid()) + b"".join(mine) if wanted else b""
    records = _gather(store, "cma", rank, world_size, record, _remaining(deadline))
    sizes_ok = all(len(r) == 8 + _CHALLENGE * world_size for r in records)
    held = np.frombuffer(  # the challenges sent to this rank, in rank order, kept alive below
        b"".join(r[8 + _CHALLENGE * rank :][:_CHALLENGE] for r in records) if sizes_ok else b"",
        np.uint8,
    ).copy()
    where = struct.pack("<Q", held.ctypes.data) if sizes_ok else b""
    places = _gather(store, "cma-at", rank, world_size, where, _remaining(deadline))
    pids = {p: struct.unpack("<Q", r[:8])[0] for p, r in enumerate(records) if sizes_ok}
    why = _unreadable(rank, pids, places, mine) if wanted and sizes_ok else "not every rank can"
    verdict = b"" if why else b"1"
    verdicts = _gather(store, "cma-ok", rank, world_size, verdict, _remaining(deadline))
    del held  # every rank has read it
    if why and wanted:
        log.info(
            "rank %d: cross-memory attach is off (%s); large allreduces of ordinary buffers "
            "take the ring through the arenas. Yama ptrace_scope 0 or CAP_SYS_PTRACE would "
            "allow it; ASYNCREDUCE_CMA=0 turns it off without trying", rank, why,
        )  # fmt: skip
    if not all(verdicts):
        return None, why or "another rank cannot read" if wanted else "ASYNCREDUCE_CMA=0"
    return CrossMemory({p: pid for p, pid in pids.items() if p != rank}), ""


def _unreadable(
    rank: int, pids: dict[int, int], places: list[bytes], mine: list[bytes]
) -> str | None:
    """Why this rank cannot read some peer's challenge back from its pid, or None."""
    if len(set(pids.values())) != len(pids):
        return "two ranks announced the same process"
    for peer, pid in pids.items():
        if peer == rank:
            continue
        if not cma.owned_by_me(pid) or len(places[peer]) != 8:
            return f"rank {peer} announced process {pid}, not another process of this user"
        address = struct.unpack("<Q", places[peer])[0] + _CHALLENGE * rank
        failure = cma.probe(pid, address, mine[peer])
        if failure is not None:
            return f"reading rank {peer} (process {pid}): {failure}"
    return None


def _leave_store(store: Store, rank: int, world_size: int, deadline: float) -> None:
    """The serving rank closes its store only once every other rank is done with it."""
    for peer in range(world_size):
        if peer != rank:
            store.get(f"left/{peer}", _remaining(deadline))


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
