"""Allreduce over shared windows: every rank reads its peers' buffers in place.

Theory of operation. When every rank of the job is on one host and the buffer lies in a
shared window (``Communicator.shared_empty``), each rank can read every other rank's buffer
directly, so no payload needs to travel and only three tiny messages per pair are needed. The
buffer is cut into n chunks; rank r owns chunk r.

* step 0, READY (8 bytes: where the buffer starts in the sender's window): "my buffer holds
  my input". Once READY came from every peer, rank r reduces chunk r in place, combining the
  peers' chunk r straight from their windows in ascending rank order (so the result does not
  depend on arrival order), and sends
* step 1, REDUCED (empty): "chunk r is final in my window". On REDUCED from q, rank r copies
  chunk q from q's window into its own buffer. Once r has copied every chunk and reduced its
  own, it has read all it ever will of every peer's buffer, and sends each
* step 2, RELEASED (empty): "I no longer read your buffer". A rank is done when every peer
  released it: only then may its caller touch the buffer again.

Why it is safe: rank q reads r's chunk q during q's reduction, before q sends REDUCED, and
rank r writes its chunk q only after that REDUCED; r's chunk r is written before r sends
REDUCED and read by the others only after it. Per rank: one read-modify-write pass over its
own chunk per peer, and one copy of every other chunk; for two ranks about two passes over
the buffer, against four through the arenas for the ring, and no payload crosses a socket.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .base import Array, Collective, ProtocolError, Send, split
from .reduction import DType, combine, finalize

__all__ = ["SharedAllreduce", "READY", "REDUCED", "RELEASED"]

READY, REDUCED, RELEASED = 0, 1, 2
_STEPS = (READY, REDUCED, RELEASED)
_OFFSET = np.dtype("<u8")


class SharedAllreduce(Collective):
    """Allreduce of ``buffer``, which starts ``offset`` bytes into this rank's window;
    ``windows`` maps every peer to its whole window (uint8), readable here."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        buffer: Array,
        dtype: DType,
        reduce_op: str,
        offset: int,
        windows: Mapping[int, Array],
    ) -> None:
        super().__init__(rank, world_size)
        self.buffer = buffer
        self.dtype = dtype
        self.reduce_op = reduce_op
        self.peers = [p for p in range(world_size) if p != rank]
        if sorted(windows) != self.peers:
            raise ValueError(f"rank {rank}: windows of ranks {sorted(windows)}, need {self.peers}")
        self._windows = windows
        self._chunks = split(buffer.size, world_size)
        self._offset = np.array([offset], dtype=_OFFSET)
        self._inbox = {p: np.empty(_OFFSET.itemsize, np.uint8) for p in self.peers}
        self._theirs: dict[int, Array] = {}  # peer -> its buffer, once it said READY
        self._seen: set[tuple[int, int]] = set()
        self._reduced = False
        self._to_copy: set[int] = set()  # peers whose chunk is final but not yet copied here
        self._copied: set[int] = set()
        self._released = False
        self._expected = 3 * len(self.peers)

    @property
    def pending_sources(self) -> set[int]:
        if self.done:
            return set()
        return {p for p in self.peers if any((p, s) not in self._seen for s in _STEPS)}

    def start(self) -> list[Send]:
        return self._to_all(READY, self._offset.view(np.uint8))

    def _to_all(self, step: int, payload: Array) -> list[Send]:
        return [Send(p, step, 0, payload) for p in self.peers]

    def recv_buffer(self, src: int, step: int, seg: int, nbytes: int) -> Array:
        if src not in self._inbox or step not in _STEPS or seg != 0:
            raise ProtocolError(f"shared allreduce: unexpected message {step}/{seg} from {src}")
        if (src, step) in self._seen:
            raise ProtocolError(f"shared allreduce: message {step} from rank {src} twice")
        if step == READY:
            return self._check_size("shared allreduce", self._inbox[src], nbytes)
        return self._check_size("shared allreduce", self.buffer[:0], nbytes)

    def on_message(self, src: int, step: int, seg: int, payload: Array) -> list[Send]:
        self._seen.add((src, step))
        self._received += 1
        sends: list[Send] = []
        if step == READY:
            self._theirs[src] = self._peer_buffer(src, int(payload.view(_OFFSET)[0]))
            if len(self._theirs) == len(self.peers):
                sends += self._reduce_mine()
        elif step == REDUCED:
            self._to_copy.add(src)
        return sends + self._copy_ready()

    def _peer_buffer(self, peer: int, offset: int) -> Array:
        """The peer's buffer in its window; ProtocolError if it does not fit there."""
        window = self._windows[peer]
        nbytes = self.buffer.nbytes
        if offset % self.buffer.itemsize or offset + nbytes > window.nbytes:
            raise ProtocolError(
                f"shared allreduce: rank {peer} has {nbytes} bytes at offset {offset} "
                f"of its {window.nbytes}-byte window"
            )
        return window[offset : offset + nbytes].view(self.buffer.dtype)

    def _reduce_mine(self) -> list[Send]:
        a, b = self._chunks[self.rank]
        mine = self.buffer[a:b]
        for peer in self.peers:
            combine(self.dtype, self.reduce_op, mine, self._theirs[peer][a:b])
        finalize(self.dtype, self.reduce_op, mine, self.world_size)
        self._reduced = True
        return self._to_all(REDUCED, self.buffer[:0])

    def _copy_ready(self) -> list[Send]:
        """Copy every final chunk whose owner said where it is; release peers once all read."""
        for peer in [p for p in self._to_copy if p in self._theirs]:
            a, b = self._chunks[peer]
            self.buffer[a:b] = self._theirs[peer][a:b]
            self._to_copy.discard(peer)
            self._copied.add(peer)
        if self._reduced and not self._released and len(self._copied) == len(self.peers):
            self._released = True
            return self._to_all(RELEASED, self.buffer[:0])
        return []
