"""Ring reduce-scatter and allgather, chunked and pipelined; together they are ring allreduce.

Theory of operation (n ranks, this one is r, left = r-1, right = r+1, all mod n). The flat
buffer is cut into n chunks and each chunk into segments of ``SEGMENT_BYTES``.

* Reduce-scatter, steps k = 0 .. n-2: send chunk (r-k-1) to the right; receive chunk (r-k-2)
  from the left and combine it into ours. After step n-2 this rank holds chunk r fully reduced.
* Allgather, steps k = 0 .. n-2 (numbered n-1+k on the wire): send chunk (r-k) to the right;
  receive chunk (r-k-1) from the left straight into place. Afterwards every rank has everything.

Each segment moves on its own: segment j of step k+1 leaves as soon as segment j of step k
arrived (and was reduced), so the wire, the copy and the reduction overlap. Messages of
different steps touch different chunks, so they may arrive in any order. Bytes on the wire per
rank: 2 (n-1)/n of the buffer for allreduce, (n-1)/n for each half alone. The final value of a
chunk is computed on one rank and copied to the others, so every rank ends bitwise equal.
"""

from __future__ import annotations

import numpy as np

from ..kernels.pool import CorePool
from ..kernels.reduction import DType, combine, finalize
from .base import SEGMENT_BYTES, Array, Collective, ProtocolError, Send, segments, split

__all__ = ["Ring"]


class Ring(Collective):
    """Reduce-scatter and/or allgather over ``chunks`` of the flat ``buffer``.

    ``reduce_op`` None means allgather only (the buffer already holds this rank's chunk r).
    ``gather`` False means reduce-scatter only (chunk r of the buffer holds the result).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        buffer: Array,
        dtype: DType,
        reduce_op: str | None,
        gather: bool,
        chunks: list[tuple[int, int]] | None = None,
        segment_bytes: int = SEGMENT_BYTES,
        pool: CorePool | None = None,
    ) -> None:
        super().__init__(rank, world_size)
        self._pool = pool  # idle cores that take pieces of each segment's reduction
        self.buffer = buffer
        self.dtype = dtype
        self.reduce_op = reduce_op
        self.gather = gather
        n = world_size
        self.chunks = chunks if chunks is not None else split(buffer.size, n)
        seg_elems = max(1, segment_bytes // dtype.itemsize)
        self._segs = [segments(a, b, seg_elems) for a, b in self.chunks]
        self.left, self.right = (rank - 1) % n, (rank + 1) % n
        self._rs_steps = n - 1 if reduce_op is not None else 0
        self._ag_steps = n - 1 if gather else 0
        self._expected = sum(len(self._segs[self._recv_chunk(k)]) for k in range(self._steps))
        self._seen: set[tuple[int, int]] = set()
        self._scratch: Array | None = None

    @property
    def _steps(self) -> int:
        return self._rs_steps + self._ag_steps

    @property
    def pending_sources(self) -> set[int]:
        return set() if self.done else {self.left}

    def _send_chunk(self, step: int) -> int:
        k = step if step < self._rs_steps else step - self._rs_steps
        shift = 1 if step < self._rs_steps else 0
        return (self.rank - k - shift) % self.world_size

    def _recv_chunk(self, step: int) -> int:
        return (self._send_chunk(step) - 1) % self.world_size

    def _sends(self, step: int, seg: int | None = None) -> list[Send]:
        """Segment ``seg`` (or all segments) of the chunk this rank sends at ``step``."""
        if step >= self._steps:
            return []
        pieces = self._segs[self._send_chunk(step)]
        picked = range(len(pieces)) if seg is None else (seg,)
        return [Send(self.right, step, j, self.buffer[slice(*pieces[j])]) for j in picked]

    def start(self) -> list[Send]:
        return [] if self.world_size == 1 else self._sends(0)

    def _target(self, src: int, step: int, seg: int, nbytes: int) -> Array:
        """The part of the buffer message (src, step, seg) is for; ProtocolError if unexpected."""
        if src != self.left or not 0 <= step < self._steps:
            raise ProtocolError(f"ring: unexpected message step {step} from rank {src}")
        pieces = self._segs[self._recv_chunk(step)]
        if not 0 <= seg < len(pieces) or (step, seg) in self._seen:
            raise ProtocolError(f"ring: unexpected segment {seg} of step {step} from rank {src}")
        return self._check_size("ring", self.buffer[slice(*pieces[seg])], nbytes)

    def recv_buffer(self, src: int, step: int, seg: int, nbytes: int) -> Array:
        target = self._target(src, step, seg, nbytes)
        if step >= self._rs_steps:
            return target  # allgather: straight into place
        if self._scratch is None or self._scratch.size < target.size:
            self._scratch = np.empty_like(target)
        return self._scratch[: target.size]

    def takes_view(self, src: int, step: int, seg: int) -> bool:
        return step < self._rs_steps  # reduce straight from shared memory: no scratch copy

    def on_view(self, src: int, step: int, seg: int, view: memoryview) -> list[Send]:
        if not self.takes_view(src, step, seg):
            return super().on_view(src, step, seg, view)
        target = self._target(src, step, seg, view.nbytes)
        return self.on_message(src, step, seg, np.frombuffer(view, self.buffer.dtype, target.size))

    def on_message(self, src: int, step: int, seg: int, payload: Array) -> list[Send]:
        self._seen.add((step, seg))
        self._received += 1
        if step < self._rs_steps:
            assert self.reduce_op is not None
            target = self.buffer[slice(*self._segs[self._recv_chunk(step)][seg])]
            last = step == self._rs_steps - 1
            if self._pool is None:
                self._combine(target, payload, last, 0, target.size)
            else:  # (pieces of it on idle cores: the same elements, in the same order)
                self._pool.run(lambda a, b: self._combine(target, payload, last, a, b), 0,
                               target.size, target.itemsize)  # fmt: skip
        return self._sends(step + 1, seg)

    def _combine(self, target: Array, payload: Array, last: bool, a: int, b: int) -> None:
        """Elements [a, b) of a received segment combined into ours (finalized if ``last``)."""
        assert self.reduce_op is not None
        combine(self.dtype, self.reduce_op, target[a:b], payload[a:b])
        if last:
            finalize(self.dtype, self.reduce_op, target[a:b], self.world_size)
