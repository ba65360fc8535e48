"""Direct exchange: each rank sends given buffers to given peers and receives given buffers
from given peers; gather, scatter, all-to-all and point-to-point are all this.

Theory of operation. A rank's part is two maps, ``sends`` {peer: array} and ``recvs`` {peer:
array}, agreed between each pair (what one side sends, the other expects, byte for byte). Each
buffer travels in segments of ``SEGMENT_BYTES``; message ``(step, seg)`` is segment ``seg`` of
the pair's buffer, with ``step`` 1 on the last segment and 0 on the others, so a receiver that
expected a different size finds out at the first segment whose size or position disagrees
(``ProtocolError``: the ranks posted different operations), never waits for a segment that
will not come. An empty buffer is one empty last segment. Segments go straight into the
receive buffer (no copy) in any order; the rank is done when every expected segment came.

Bytes on the wire: each buffer once, directly to its peer; one round.
"""

from __future__ import annotations

from .base import SEGMENT_BYTES, Array, Collective, ProtocolError, Send, segments

__all__ = ["Exchange"]


class Exchange(Collective):
    """One rank's sends and receives of a direct exchange."""

    def __init__(self, rank: int, world_size: int, sends: dict[int, Array],
                 recvs: dict[int, Array]) -> None:  # fmt: skip
        super().__init__(rank, world_size)
        for peer in (*sends, *recvs):
            if not 0 <= peer < world_size or peer == rank:
                raise ValueError(f"rank {rank} cannot exchange with {peer} (world {world_size})")
        self._sends = {p: _bytes(a) for p, a in sends.items()}
        self._recvs = {p: _bytes(a) for p, a in recvs.items()}
        self._pieces = {p: _pieces(b.size) for p, b in self._recvs.items()}
        self._missing = {p: set(range(len(cuts))) for p, cuts in self._pieces.items()}
        self._expected = sum(len(cuts) for cuts in self._pieces.values())

    @property
    def pending_sources(self) -> set[int]:
        return {p for p, missing in self._missing.items() if missing}

    def start(self) -> list[Send]:
        sends = []
        for peer, data in self._sends.items():
            cuts = _pieces(data.size)
            for seg, (lo, hi) in enumerate(cuts):
                sends.append(Send(peer, int(seg == len(cuts) - 1), seg, data[lo:hi]))
        return sends

    def recv_buffer(self, src: int, step: int, seg: int, nbytes: int) -> Array:
        cuts = self._pieces.get(src)
        if cuts is None:
            raise ProtocolError(f"a message from rank {src}, which sends this rank nothing")
        if seg not in self._missing[src]:
            raise ProtocolError(f"segment {seg} from rank {src} is unexpected or a duplicate")
        if step != int(seg == len(cuts) - 1):
            raise ProtocolError(
                f"rank {src} sends {'its last' if step else 'a middle'} segment as segment "
                f"{seg} of {len(cuts)}: it sends {'fewer' if step else 'more'} bytes than this "
                "rank expects"
            )
        lo, hi = cuts[seg]
        return self._check_size(f"segment {seg} from rank {src}", self._recvs[src][lo:hi], nbytes)

    def on_message(self, src: int, step: int, seg: int, payload: Array) -> list[Send]:
        self._missing[src].discard(seg)
        self._received += 1
        return []


def _bytes(array: Array) -> Array:
    return array.reshape(-1).view("u1")


def _pieces(nbytes: int) -> list[tuple[int, int]]:
    return segments(0, nbytes, SEGMENT_BYTES)
