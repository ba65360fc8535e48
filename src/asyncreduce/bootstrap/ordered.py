"""``ar.init(backend="mpi")`` and ``ar.init(backend="torch")``: a communicator over an ordered
engine. Each rank's place comes from the engine's own communicator (no store, no launcher
variables needed); one INFO line says what was chosen."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from ..backends.ordered.engine import OrderedEngine
from ..backends.ordered.native import NativeEndpoint
from ..comm import Communicator
from ..errors import UsageError
from ..protocol.operation import Settings
from .meet import remaining
from .native import join

__all__ = ["connect_mpi", "connect_torch"]

log = logging.getLogger("asyncreduce.comm")


def connect_mpi(comm: Any = None, timeout: float = 30.0) -> Communicator:
    """A communicator over ``comm`` (an mpi4py communicator; COMM_WORLD by default).
    TimeoutError when a rank has not called it within ``timeout`` seconds."""
    from ..backends.ordered.mpi import MpiAdapter, check_thread_level, meet, prefer_ring

    prefer_ring()
    check_thread_level()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
        raise UsageError(f"comm must be an mpi4py communicator, got {comm!r}")
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return Communicator(0, 1, None, local=(0, 1))
    control = os.environ.get("ASYNCREDUCE_CONTROL") or "mpi"
    if control not in ("mpi", "native"):
        raise UsageError(f"ASYNCREDUCE_CONTROL={control!r}: expected mpi or native")
    deadline = time.monotonic() + timeout
    comms, local, threads = meet(comm, deadline, timeout)  # (no blocking MPI call)
    endpoint = None
    if control == "native":
        world = list(
            comm.Get_group().Translate_ranks(list(range(size)), MPI.COMM_WORLD.Get_group())
        )
        endpoint = NativeEndpoint(_native(remaining(deadline)), world.__getitem__)
    one_host = local[1] == size
    engine = OrderedEngine(rank, size, lambda: MpiAdapter(comms, endpoint, one_host, threads),
                           Settings.from_env())  # fmt: skip
    return _started(Communicator(rank, size, engine, local=local), "mpi", remaining(deadline))


def connect_torch(group: Any = None, timeout: float = 30.0) -> Communicator:
    """A communicator over ``group`` of an initialized torch.distributed job (its WORLD by
    default). Collective over the job's default group: a Gloo group of ``group``'s ranks is
    made beside it, for the control messages (every rank of the job must call this)."""
    import torch.distributed as dist

    from ..backends.ordered.torchdist import TorchAdapter, destroy_groups

    if dist.is_available() and not dist.is_initialized() and _launched():
        import torch

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_available() or not dist.is_initialized():
        raise UsageError(
            "backend='torch' needs torch.distributed.init_process_group(...) first "
            "(or a launcher's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
        )
    group = dist.group.WORLD if group is None else group
    ranks = dist.get_process_group_ranks(group)
    backend = str(dist.get_backend(group))
    # A group of our own: the caller's own collectives on ``group`` would interleave with ours
    # in a different order on each rank (groups pair collectives by sequence number).
    group = dist.new_group(ranks, backend=backend)
    host = group if "gloo" in backend or "mpi" in backend else dist.new_group(ranks, backend="gloo")
    native = _native(timeout)  # (collective over the job, like new_group)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        native.close()
        raise UsageError(f"this process (rank {dist.get_rank()}) is not in the group {ranks}")
    if size == 1:
        native.close()
        destroy_groups(group, host)
        return Communicator(0, 1, None)
    endpoint = NativeEndpoint(native, ranks.__getitem__)
    engine = OrderedEngine(rank, size, lambda: TorchAdapter(group, host, endpoint),
                           Settings.from_env())  # fmt: skip
    return _started(Communicator(rank, size, engine), "torch", timeout)


def _launched() -> bool:
    """Whether a launcher (torchrun, asyncreduce run) said where torch.distributed meets."""
    return all(os.environ.get(v) for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _native(timeout: float) -> Communicator:
    """A native communicator of the whole job, for the control channel."""
    return join(None, None, None, None, None, timeout)


def _started(comm: Communicator, backend: str, timeout: float) -> Communicator:
    """Check that every rank fuses alike, agree on a clock origin, say what was chosen."""
    engine = comm._ordered
    assert engine is not None
    try:
        fusion = comm.allgather(np.array([engine.fusion_bytes], np.int64),
                                name="asyncreduce/start", timeout=timeout)[:, 0]  # fmt: skip
    except BaseException:
        comm.abort("init did not finish")  # (its thread ends; the peers' inits fail too)
        raise
    if len(set(fusion.tolist())) > 1:
        comm.close()
        raise UsageError(
            f"ASYNCREDUCE_FUSION_BYTES differs between ranks ({fusion.tolist()}): every rank "
            "must fuse alike, or they issue different engine calls"
        )
    comm._clock_origin = time.perf_counter()
    plane = comm.data_plane
    log.info("rank %d of %d joined over backend=%r: the %s engine, control messages on %s, "
             "allreduces fused up to %d bytes", comm.rank, comm.world_size, backend,
             plane.engine, plane.control, engine.fusion_bytes)  # fmt: skip
    return comm
