"""Same-host memory at init: shared-memory arenas with every rank on this host, cross-memory
attach when every rank is on it, and each rank's place among those of its host (steps 3 and 4
of the package docstring); and, once the communicator runs, its same-host lane (step 5)."""

from __future__ import annotations

import logging
import os
import struct

import numpy as np

from ..backends.native import NativeBackend
from ..comm import Communicator
from ..envvars import env_number
from ..errors import BrokenError
from ..lane import lane_wanted
from ..launchers import Place
from ..rendezvous import Store
from ..samehost import cma
from ..samehost.cma import CrossMemory
from ..samehost.mailbox import native_wanted, open_mailbox, region_bytes
from ..samehost.named import MAX_RANKS, named_bytes, native_named_wanted, open_named
from ..samehost.shm import Arena, Segment, create_arena, host_identity, open_arena
from ..samehost.window import WindowError
from .meet import gather, remaining

__all__ = ["cross_memory", "identity", "local_place", "open_lane", "share_memory"]

log = logging.getLogger("asyncreduce.comm")
CHALLENGE = 16  # bytes of the random challenge each rank sends each other rank
_LANE = "asyncreduce/lane"  # the key of the collectives that open the same-host lane


def identity() -> bytes:
    """This host's identity and whether this rank takes shared memory: "<identity>|<0/1>"."""
    enabled = os.environ.get("ASYNCREDUCE_SHM", "1") != "0"
    return f"{host_identity()}|{int(enabled)}".encode()


def local_place(place: Place, identities: list[bytes]) -> tuple[int, int]:
    """(local rank, local world size): the launcher's, or counted among same-host ranks."""
    if place.local_rank is not None and place.local_world_size is not None:
        return place.local_rank, place.local_world_size
    hosts = [ident.rsplit(b"|", 1)[0] for ident in identities]
    mine = [r for r, h in enumerate(hosts) if h == hosts[place.rank]]
    return mine.index(place.rank), len(mine)


def share_memory(
    store: Store, rank: int, world_size: int, identities: list[bytes], deadline: float
) -> tuple[dict[int, tuple[Arena, Arena]], dict[int, str]]:
    """Shared-memory arenas with every rank on this host: {peer: (arena we write, arena we read)},
    and for every other peer why it is TCP only.

    Arenas are anonymous segments (samehost/shm.py), never named in /dev/shm, so nothing is
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
            theirs = store.get(f"shm/{peer}/{rank}", remaining(deadline)).decode()
            arenas[peer] = (outgoing[peer][1], open_arena(theirs))
        gather(store, "shm-mapped", rank, world_size, b"", remaining(deadline))
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


def cross_memory(
    store: Store, rank: int, world_size: int, deadline: float
) -> tuple[CrossMemory | None, str]:
    """Cross-memory attach with every peer (all on this host), if every rank can read every
    other's memory (see samehost/cma.py): each rank sends each other a random challenge through the
    store, keeps those it was sent in its own memory and says where, and reads its own back
    from every peer's pid. ASYNCREDUCE_CMA=0 on any rank turns it off for all; a rank that
    could not read logs why, once. Returns the reader (None: off) and why it is off."""
    wanted = os.environ.get("ASYNCREDUCE_CMA", "1") != "0" and cma.available()
    mine = [os.urandom(CHALLENGE) for _ in range(world_size)]  # mine[p]: what p must hold
    record = struct.pack("<Q", os.getpid()) + b"".join(mine) if wanted else b""
    records = gather(store, "cma", rank, world_size, record, remaining(deadline))
    sizes_ok = all(len(r) == 8 + CHALLENGE * world_size for r in records)
    held = np.frombuffer(  # the challenges sent to this rank, in rank order, kept alive below
        b"".join(r[8 + CHALLENGE * rank :][:CHALLENGE] for r in records) if sizes_ok else b"",
        np.uint8,
    ).copy()
    where = struct.pack("<Q", held.ctypes.data) if sizes_ok else b""
    places = gather(store, "cma-at", rank, world_size, where, remaining(deadline))
    pids = {p: struct.unpack("<Q", r[:8])[0] for p, r in enumerate(records) if sizes_ok}
    why = _unreadable(rank, pids, places, mine) if wanted and sizes_ok else "not every rank can"
    verdict = b"" if why else b"1"
    verdicts = gather(store, "cma-ok", rank, world_size, verdict, remaining(deadline))
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
        address = struct.unpack("<Q", places[peer])[0] + CHALLENGE * rank
        failure = cma.probe(pid, address, mine[peer])
        if failure is not None:
            return f"reading rank {peer} (process {pid}): {failure}"
    return None


def open_lane(comm: Communicator, timeout: float) -> None:
    """Open the same-host lane (lane.py) of a new communicator, collectively, where our own
    engine reaches every rank on this host and every rank wants it (``lane_wanted``): the
    last step of init, once the ranks can run collectives."""
    backend = comm._backend
    if not isinstance(backend, NativeBackend) or not backend.planes.offers_windows:
        return
    named_wanted = env_number("ASYNCREDUCE_LANE_NAMED", 1, int, 0) > 0
    wanted = np.array([lane_wanted(backend.engine.settings), native_wanted(), named_wanted,
                       native_named_wanted()], np.int8)  # fmt: skip
    lane, native, named, native_named = comm.allreduce(wanted, op="min", name=_LANE,
                                                       timeout=timeout)  # fmt: skip
    if not lane:
        return
    named = named and comm.world_size <= MAX_RANKS
    try:
        window = backend.planes.windows.create(
            comm.rank, region_bytes() + (named_bytes() if named else 0),
            lambda record: comm.allgather(record, name=_LANE, timeout=timeout),
            lambda: comm.barrier(name=_LANE, timeout=timeout), listed=False,
        )  # fmt: skip
    except WindowError as exc:
        comm.abort(f"rank {comm.rank}: could not open the same-host lane: {exc}")
        raise BrokenError(f"init on rank {comm.rank}: the same-host lane: {exc}") from exc
    mine, peers = window.mine, window.peers
    slots = open_named(comm.rank, mine, peers, bool(native_named)) if named else None
    backend.open_lane(open_mailbox(comm.rank, window.mine, window.peers, bool(native)), slots)
