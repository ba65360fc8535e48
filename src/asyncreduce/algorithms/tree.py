"""Binomial-tree broadcast, pipelined by segment.

Theory of operation: ranks are renumbered relative to the root (v = (r - root) mod n). The
parent of v is v with its lowest set bit cleared; the children of v are v + 2^i for every
2^i below v's lowest set bit (every 2^i < n for the root). Each segment is received straight
into place and forwarded to the children at once, so a deep tree streams instead of waiting
for the whole buffer at each level. ceil(log2 n) levels; each non-root rank receives the
buffer once, and each rank sends it once per child.
"""

from __future__ import annotations

from .base import SEGMENT_BYTES, Array, Collective, ProtocolError, Send, segments

__all__ = ["TreeBroadcast"]


class TreeBroadcast(Collective):
    """Broadcast ``buffer`` from ``root`` to every rank, in place."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        buffer: Array,
        root: int,
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        super().__init__(rank, world_size)
        if not 0 <= root < world_size:
            raise ValueError(f"root {root} outside world of size {world_size}")
        self.buffer = buffer
        self.root = root
        n = world_size
        v = (rank - root) % n
        low = v & -v if v else 1 << n.bit_length()
        self.parent = None if v == 0 else ((v - low) + root) % n
        self.children = [
            (v + (1 << i) + root) % n
            for i in range(n.bit_length())
            if (1 << i) < low and v + (1 << i) < n
        ]
        seg_elems = max(1, segment_bytes // max(1, buffer.itemsize))
        self._segs = segments(0, buffer.size, seg_elems)
        self._seen: set[int] = set()
        self._expected = 0 if self.parent is None else len(self._segs)

    @property
    def pending_sources(self) -> set[int]:
        return set() if self.done or self.parent is None else {self.parent}

    def _forward(self, seg: int) -> list[Send]:
        piece = self.buffer[slice(*self._segs[seg])]
        return [Send(child, 0, seg, piece) for child in self.children]

    def start(self) -> list[Send]:
        if self.parent is not None:
            return []
        return [s for j in range(len(self._segs)) for s in self._forward(j)]

    def recv_buffer(self, src: int, step: int, seg: int, nbytes: int) -> Array:
        if src != self.parent or step != 0 or not 0 <= seg < len(self._segs) or seg in self._seen:
            raise ProtocolError(f"broadcast: unexpected segment {seg} from rank {src}")
        return self._check_size("broadcast", self.buffer[slice(*self._segs[seg])], nbytes)

    def on_message(self, src: int, step: int, seg: int, payload: Array) -> list[Send]:
        self._seen.add(seg)
        self._received += 1
        return self._forward(seg)
