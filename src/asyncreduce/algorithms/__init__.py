"""Sans-IO collective algorithms: pure state machines, numpy in, messages out.

``build`` picks the algorithm for an operation from what every rank agrees on (kind, element
count, dtype, world size), so all ranks pick the same one without talking.
"""

from __future__ import annotations

from ..kernels.fold import Combining, Swap
from ..kernels.pool import CorePool
from ..kernels.reduction import (
    DTYPE_BY_CODE,
    DTYPES,
    REDUCIBLE,
    REDUCTION_CODES,
    REDUCTIONS,
    DType,
    combine,
    finalize,
    reduction_refused,
)
from .barrier import Barrier
from .base import (
    SEGMENT_BYTES,
    Array,
    Collective,
    PeerMemoryError,
    ProtocolError,
    RunsDirectly,
    Send,
    segments,
    split,
)
from .doubling import DirectAllreduce, RecursiveDoubling
from .exchange import Exchange
from .ring import Ring
from .shared import PeerMemory, SharedAllreduce, WindowMemory
from .translated import RenumberedMemory, Translated
from .tree import TreeBroadcast

__all__ = [
    "Array",
    "Barrier",
    "CROSS_MEMORY",
    "CROSS_MEMORY_BYTES",
    "Collective",
    "PeerMemoryError",
    "Combining",
    "DType",
    "DTYPES",
    "DirectAllreduce",
    "DTYPE_BY_CODE",
    "Exchange",
    "KINDS",
    "ProtocolError",
    "REDUCTIONS",
    "REDUCTION_CODES",
    "RecursiveDoubling",
    "RunsDirectly",
    "Ring",
    "SEGMENT_BYTES",
    "SMALL_ALLREDUCE_BYTES",
    "PeerMemory",
    "Send",
    "Swap",
    "RenumberedMemory",
    "SharedAllreduce",
    "Translated",
    "WindowMemory",
    "TreeBroadcast",
    "build",
    "combine",
    "finalize",
    "reduction_refused",
    "REDUCIBLE",
    "segments",
    "split",
]

#: Allreduces up to this size use recursive doubling (fewest rounds); larger ones the ring.
SMALL_ALLREDUCE_BYTES = 64 << 10

#: An allreduce descriptor's ``root`` when the ranks read each other's ordinary buffers by
#: cross-memory attach (shared windows put their number there, 1 and up; 0: neither).
CROSS_MEMORY = 0xFFFF_FFFF

#: Allreduces of ordinary buffers from this size up read the peers' buffers by cross-memory
#: attach where every rank can (below, the ring through the arenas is quicker: its kernel
#: copies are cheaper than three rounds of messages).
CROSS_MEMORY_BYTES = 2 << 20

#: Operation kinds and their wire codes. reduce runs an allreduce (non-roots on a copy); gather,
#: scatter, alltoall and p2p (one send matched with one receive) are direct exchanges.
KINDS: dict[str, int] = {
    "allreduce": 1,
    "broadcast": 2,
    "allgather": 3,
    "reduce_scatter": 4,
    "barrier": 5,
    "reduce": 6,
    "gather": 7,
    "scatter": 8,
    "alltoall": 9,
    "p2p": 10,
}


def _blocks(count: int, parts: int) -> list[tuple[int, int]]:
    size = count // parts
    return [(i * size, (i + 1) * size) for i in range(parts)]


def build(
    kind: str,
    rank: int,
    world_size: int,
    buffer: Array,
    dtype: DType,
    reduce_op: str = "sum",
    root: int = 0,
    shared: tuple[int, PeerMemory] | None = None,
    pool: CorePool | None = None,
) -> Collective:
    """The state machine for one rank's part of an operation.

    ``buffer`` is flat: the data (allreduce, broadcast, reduce_scatter) or the whole output
    with this rank's block already in place (allgather). ``shared`` (allreduce only): what
    this rank's READY announces and how the peers' buffers are read, when every rank reads
    the others' in place (shared windows, cross-memory attach; the descriptor says which, so
    all ranks agree). ``pool``: idle cores that take pieces of a large reduction (kernels/pool.py).
    """
    if kind in ("allreduce", "reduce"):
        if shared is not None:
            return SharedAllreduce(rank, world_size, buffer, dtype, reduce_op, *shared, pool)
        if buffer.nbytes <= SMALL_ALLREDUCE_BYTES:
            return RecursiveDoubling(rank, world_size, buffer, dtype, reduce_op)
        return Ring(rank, world_size, buffer, dtype, reduce_op, gather=True, pool=pool)
    if kind == "broadcast":
        return TreeBroadcast(rank, world_size, buffer, root)
    if kind == "allgather":
        return Ring(rank, world_size, buffer, dtype, None, True, _blocks(buffer.size, world_size))
    if kind == "reduce_scatter":
        return Ring(rank, world_size, buffer, dtype, reduce_op, False,
                    _blocks(buffer.size, world_size), pool=pool)  # fmt: skip
    if kind == "barrier":
        return Barrier(rank, world_size)
    raise ValueError(f"unknown operation kind {kind!r}; expected one of {sorted(KINDS)}")
