"""Fusion: small agreed allreduces run as one engine call.

Theory of operation. Every engine call costs a fixed latency (MPI's and NCCL's own rounds),
which dominates small operations. Operations agreed in one round are issued in the agreed
order; host allreduces of at most ``fusion_bytes`` each, of one dtype and reduction, join one
``Call`` of at most ``fusion_bytes`` in all (in the order of its first member): their memory is
packed into one scratch, the call reduces the scratch, and each member's part is copied back
into the caller's memory when it completes (unless that member failed meanwhile). Every rank
agreed the same operations in the same order and fuses with the same limit (checked at
connect), so every rank issues the same calls. Everything else runs alone, on its own memory.
When a call completes, ``complete`` finishes each member (a host average, which the engines
sum, is divided here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...buffers import elements
from ...envvars import env_number
from ...flight import FlightRecorder
from ...kernels.reduction import finalize
from .posted import Posted, Running

__all__ = ["FUSION_BYTES", "Call", "complete", "fuse", "fusion_bytes_from_env", "pack"]

#: Agreed allreduces up to this many bytes each, of one dtype and reduction, run as one engine
#: call of up to this many bytes (ASYNCREDUCE_FUSION_BYTES; 0: never). Chosen by measurement:
#: docs/engines.md.
FUSION_BYTES = 64 << 10


@dataclass(eq=False)
class Call:
    """One engine call in flight: one operation, or several fused into ``scratch``."""

    ops: list[Posted]
    running: Running
    scratch: Any = None  # fused: the packed buffer


def fusion_bytes_from_env() -> int:
    """The limit of this process: ASYNCREDUCE_FUSION_BYTES, or ``FUSION_BYTES``."""
    return env_number("ASYNCREDUCE_FUSION_BYTES", FUSION_BYTES, int, 0)


def fuse(ops: list[Posted], limit: int) -> list[list[Posted]]:
    """Agreed operations as engine calls: small host allreduces of one dtype and reduction
    together (in the agreed order of their first member), everything else alone."""
    groups: list[list[Posted]] = []
    open_: dict[tuple[int, str | None], tuple[list[Posted], int]] = {}
    for op in ops:
        size = op.flat.nbytes if isinstance(op.flat, np.ndarray) else limit + 1
        if op.kind != "allreduce" or size > limit or limit == 0:
            groups.append([op])
            continue
        kind = (op.dtype.code, op.op)
        group, total = open_.get(kind, (None, 0))
        if group is None or total + size > limit:
            group, total = [], 0
            groups.append(group)
        group.append(op)
        open_[kind] = (group, total + size)
    return groups


def pack(group: list[Posted]) -> Any:
    """The scratch a fused call runs over (None for one operation: it runs on its memory)."""
    return np.concatenate([op.flat for op in group]) if len(group) > 1 else None


def complete(call: Call, world_size: int, flight: FlightRecorder) -> None:
    """Complete every operation of a finished ``call`` (of ``world_size`` ranks): its part of a
    fused scratch back into its memory, an average divided, its record and request done."""
    at = 0
    for op in call.ops:
        n = elements(op.flat)  # (a device tensor's ``size`` is a method)
        at += n
        if op.request.done():  # failed meanwhile: it ran for the peers' sake; its memory
            continue  # is no longer the caller's to write
        if call.scratch is not None:
            op.flat[...] = call.scratch[at - n : at]
        if op.op == "avg" and isinstance(op.flat, np.ndarray):
            finalize(op.dtype, op.op, op.flat, world_size)
        if op.record is not None:
            flight.finish(op.record, None)
        try:
            value = op.result()
        except Exception as exc:
            op.request.set_exception(exc)
            continue
        op.request.set_result(value)
