"""What each operation is, as a ``Plan``: its memory, what goes to and comes from whom, and what
the caller gets back.

Theory of operation. A plan is built in the caller's thread from checked arguments (comm.py)
and handed to a backend (backends/). The reductions and broadcast work on the caller's flat
buffer itself; allgather on a new output with this rank's block already in place. Gather,
scatter, all-to-all and point-to-point are direct exchanges: the plan names the block sent to
each peer and the block each peer's data lands in (rows of the caller's arrays split
``world_size`` ways, no copy), with the ``Exchange`` algorithm that moves them on our own
engine; an ordered engine reads the same blocks (``sends``/``recvs``). ``result`` hands the
caller's type back once the operation completed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .algorithms import KINDS, REDUCTION_CODES, Array, Collective, Exchange
from .buffers import Buffer, as_buffer, elements
from .transport.frame import Descriptor

__all__ = ["Plan", "allgather", "alltoall", "barrier", "exchange", "gather", "receive",
           "reduce_scatter", "scatter", "send"]  # fmt: skip


@dataclass
class Plan:
    """One operation as a backend takes it: its kind, buffer (dtype and count, and the data
    of the built-in algorithms), how to hand the result back, and for direct exchanges the
    algorithm itself and the count every rank must agree on."""

    kind: str
    buf: Buffer
    result: Callable[[], Any]
    op: str | None = None
    root: int = 0
    algo: Collective | None = None
    count: int | None = None
    sends: dict[int, Array] | None = None  # a direct exchange's own buffers (ordered engines)
    recvs: dict[int, Array] | None = None
    tag: int | None = None  # point-to-point

    def descriptor(self, root: int, dtype_code: int) -> Descriptor:
        """What every rank must agree on: kind, dtype, reduction, ``root`` and count, checked
        to be ints that fit the wire (the count of a device tensor too: ``elements``)."""
        count = elements(self.buf.flat) if self.count is None else self.count
        reduce = REDUCTION_CODES[self.op] if self.op else 0
        return Descriptor.checked(KINDS[self.kind], dtype_code, reduce, root, count)


def barrier() -> Plan:
    """A barrier: an operation of nothing, whose result is None. The same plan for every
    barrier: it has no byte to write and nothing changes it."""
    return _BARRIER


def exchange(
    kind: str, rank: int, size: int, buf: Buffer, sends: dict[int, Array],
    recvs: dict[int, Array], result: Callable[[], Any], root: int, count: int | None = None,
    tag: int | None = None,
) -> Plan:  # fmt: skip
    """A direct exchange of ``sends`` and ``recvs`` (see algorithms/exchange.py)."""
    algo = Exchange(rank, size, sends, recvs)
    return Plan(kind, buf, result, None, root, algo, count, sends, recvs, tag)


def allgather(rank: int, size: int, buf: Buffer) -> Plan:
    """Every rank's ``buf`` into a new (size, *shape) output, this rank's row in place."""
    out = np.empty((size, *buf.shape), dtype=buf.flat.dtype)
    out.reshape(size, -1)[rank] = buf.flat
    gathered = Buffer(out, out.reshape(-1), out.shape, buf.dtype, buf.like)
    return Plan("allgather", gathered, lambda: buf.like(out))


def reduce_scatter(rank: int, size: int, buf: Buffer, op: str) -> Plan:
    """Reduce ``buf`` (first axis divisible by ``size``); the result is block ``rank``."""
    block = (buf.shape[0] // size, *buf.shape[1:])
    mine = buf.flat.reshape(size, -1)[rank].reshape(block)
    return Plan("reduce_scatter", buf, lambda: buf.like(mine), op)


def gather(rank: int, size: int, buf: Buffer, root: int) -> Plan:
    """``buf`` to ``root``, whose result is every rank's, as (size, *shape)."""
    if rank != root:
        return exchange("gather", rank, size, buf, {root: buf.flat}, {}, lambda: None, root)
    out = np.empty((size, *buf.shape), dtype=buf.flat.dtype)
    blocks = out.reshape(size, -1)
    blocks[root] = buf.flat
    recvs = {r: blocks[r] for r in range(size) if r != root}
    return exchange("gather", rank, size, buf, {}, recvs, lambda: buf.like(out), root)


def scatter(rank: int, size: int, buf: Buffer, source: Buffer | None, root: int) -> Plan:
    """Row ``rank`` of the root's ``source`` (checked: (size, *buf.shape)) into ``buf``."""
    if source is None:  # not the root
        return exchange("scatter", rank, size, buf, {}, {root: buf.flat}, lambda: buf.original,
                        root)  # fmt: skip
    blocks = source.flat.reshape(size, -1)
    buf.flat[:] = blocks[root]
    sends = {r: blocks[r] for r in range(size) if r != root}
    return exchange("scatter", rank, size, buf, sends, {}, lambda: buf.original, root)


def alltoall(rank: int, size: int, buf: Buffer) -> Plan:
    """Block ``j`` of ``buf`` to rank ``j``; the result holds rank ``i``'s block ``rank`` at
    ``i``."""
    out = np.empty(buf.shape, dtype=buf.flat.dtype)
    mine, theirs = buf.flat.reshape(size, -1), out.reshape(size, -1)
    theirs[rank] = mine[rank]
    others = [r for r in range(size) if r != rank]
    return exchange("alltoall", rank, size, buf, {r: mine[r] for r in others},
                    {r: theirs[r] for r in others}, lambda: buf.like(out), 0)  # fmt: skip


def send(rank: int, size: int, buf: Buffer, dst: int, tag: int) -> Plan:
    """``buf`` to ``dst``, matched by its receive from ``rank`` with ``tag``."""
    return exchange("p2p", rank, size, buf, {dst: buf.flat}, {}, lambda: None, rank, tag=tag)


def receive(rank: int, size: int, buf: Buffer, src: int, tag: int) -> Plan:
    """What ``src`` sends with ``tag``, into ``buf``; the result is the caller's object."""
    return exchange("p2p", rank, size, buf, {}, {src: buf.flat}, lambda: buf.original, src,
                    tag=tag)  # fmt: skip


_BARRIER = Plan("barrier", as_buffer(np.empty(0, np.uint8), "barrier"), lambda: None)
