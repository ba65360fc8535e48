"""Allreduce over shared memory: every rank reads its peers' buffers where they are.

Theory of operation. When every rank of the job is on one host, each rank can read every
other rank's buffer directly, so no payload needs to travel: only tiny messages (two per
pair, and one per segment). How a peer's buffer is read is a ``PeerMemory``: in place, when
the buffers lie in shared windows (``Communicator.shared_empty``, ``WindowMemory``), or with
one kernel copy per piece from the peer process (``asyncreduce.samehost.cma.CrossMemory``) for
ordinary buffers. The buffer is cut into n chunks; rank r owns chunk r.

* step 0, READY (8 bytes: where the buffer is, for the peers' ``PeerMemory``: its offset in
  the sender's window, or its address): "my buffer holds my input". Once READY came from
  every peer, rank r reduces its chunk segment by segment (``SEGMENT_BYTES``) in place,
  combining the peers' segment in ascending rank order (so the result does not depend on
  arrival order), and after each sends
* step 1, REDUCED, segment j (empty): "segment j of chunk r is final in my buffer". On it,
  rank r copies that segment out of the sender's buffer into its own. The first
  segment is reduced at once, each further one after one more REDUCED came in: the segments
  are copied soon after they were written, while they are still in the cache the cores share
  (about 30% faster than whole chunks in a two-thread experiment), and the ranks keep pace.
* step 2, RELEASED (empty): once rank r has reduced all of its chunk and copied every other,
  it reads no peer's buffer any more and says so. A rank is done when every peer released
  it: only then may its caller touch the buffer again.

Why it is safe: rank q reads r's segment j of chunk q while reducing it, before it sends
REDUCED for it, and rank r writes that segment only after that REDUCED; r's own segments are
written before r sends their REDUCED and read by the others only after it. Why it finishes:
if it stalled, every unfinished rank would have reduced one more segment than all the others
together have (at least one each), which two unfinished ranks cannot both have, and a single
one has then reduced more than any chunk has segments (their counts differ by at most one).

Messages only record what arrived; the reading is the algorithm's ``work``, one segment (a
reduction, or a copy) per call, so the engine can do it between other operations' frames,
the most urgent first. While any of it is left, every peer whose buffer it will still read
stays in ``pending_sources``, so a peer that leaves meanwhile fails the operation here.

Where this rank has idle cores (kernels/pool.py), each segment's reduction and copy is cut
among them: the same elements, combined in the same order, on several cores at once.

Per rank: one read-modify-write pass over its own chunk per peer, and one copy of every other
chunk; for two ranks about two passes over the buffer, against four through the arenas for
the ring, and no payload crosses a socket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import numpy as np

from ..kernels.pool import CorePool
from ..kernels.reduction import DType, combine, finalize
from .base import SEGMENT_BYTES, Array, Collective, ProtocolError, Send, segments, split

__all__ = ["PeerBuffer", "PeerMemory", "SharedAllreduce", "WindowMemory"]

READY, REDUCED, RELEASED = 0, 1, 2
_OFFSET = np.dtype("<u8")


class PeerBuffer(Protocol):
    """One peer's buffer, as ``SharedAllreduce`` reads it."""

    def read(self, start: int, stop: int) -> Iterator[tuple[int, Array]]:
        """Elements [start, stop) as (first element, array) pieces, each valid until the next."""

    def copy_to(self, out: Array, start: int) -> None:
        """out[:] = elements [start, start + out.size)."""


class PeerMemory(Protocol):
    """Where the peers' buffers are, from what their READY said."""

    def buffer(self, peer: int, where: int, like: Array) -> PeerBuffer:
        """Rank ``peer``'s buffer, announced at ``where``, with ``like``'s dtype and size;
        ProtocolError if it cannot be there."""


class WindowMemory:
    """Peers' buffers in shared windows mapped here: READY says the offset in the window."""

    def __init__(self, windows: Mapping[int, Array]) -> None:
        self.windows = windows  # peer -> its whole window (uint8)

    def buffer(self, peer: int, where: int, like: Array) -> PeerBuffer:
        window = self.windows.get(peer)
        if window is None or where % like.itemsize or where + like.nbytes > window.nbytes:
            size = "no" if window is None else f"its {window.nbytes}-byte"
            raise ProtocolError(
                f"shared allreduce: rank {peer} has {like.nbytes} bytes at offset {where} "
                f"of {size} window"
            )
        return _Mapped(window[where : where + like.nbytes].view(like.dtype))


class _Mapped:
    """A peer's buffer mapped here: read in place."""

    def __init__(self, view: Array) -> None:
        self.view = view

    def read(self, start: int, stop: int) -> Iterator[tuple[int, Array]]:
        yield start, self.view[start:stop]

    def copy_to(self, out: Array, start: int) -> None:
        out[:] = self.view[start : start + out.size]


class SharedAllreduce(Collective):
    """Allreduce of ``buffer``; this rank's READY announces ``where`` (its place for the
    peers' ``PeerMemory``), and ``memory`` finds the peers' buffers from theirs."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        buffer: Array,
        dtype: DType,
        reduce_op: str,
        where: int,
        memory: PeerMemory,
        pool: CorePool | None = None,
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        super().__init__(rank, world_size)
        self.buffer = buffer
        self.dtype = dtype
        self.reduce_op = reduce_op
        self.peers = [p for p in range(world_size) if p != rank]
        self._memory = memory
        self._pool = pool  # idle cores that take pieces of each segment (kernels/pool.py)
        seg_elems = max(1, segment_bytes // dtype.itemsize)
        self._segs = [segments(a, b, seg_elems) for a, b in split(buffer.size, world_size)]
        self._where = np.array([where], dtype=_OFFSET)
        self._inbox = {p: np.empty(_OFFSET.itemsize, np.uint8) for p in self.peers}
        self._theirs: dict[int, PeerBuffer] = {}  # peer -> its buffer, once it said READY
        self._seen: set[tuple[int, int, int]] = set()  # (src, step, seg)
        self._reduced = 0  # segments of my chunk reduced so far
        self._to_copy: list[tuple[int, int]] = []  # (peer, segment) final there, not yet here
        self._copied = 0
        self._to_copy_in_all = sum(len(self._segs[p]) for p in self.peers)
        self._released = not self.peers  # a world of one has nothing to read or tell
        self._left = {p: 2 + len(self._segs[p]) for p in self.peers}  # messages still to come
        self._expected = sum(self._left.values())

    @property
    def pending_sources(self) -> set[int]:
        """Peers with messages still to come, and those whose buffers are still to be read:
        all of them while my chunk is not reduced, then those with segments left to copy."""
        waiting = {p for p, left in self._left.items() if left}
        if self._reduced < len(self._segs[self.rank]) and not self._released:
            return waiting | set(self.peers)
        return waiting | {p for p, _ in self._to_copy}

    def _known(self, src: int, step: int, seg: int) -> bool:
        """Whether ``src`` sends this rank a message named (step, seg) at all."""
        if step == REDUCED:
            return 0 <= seg < len(self._segs[src])
        return step in (READY, RELEASED) and seg == 0

    def start(self) -> list[Send]:
        return self._to_all(READY, 0, self._where.view(np.uint8))

    def _to_all(self, step: int, seg: int, payload: Array) -> list[Send]:
        return [Send(p, step, seg, payload) for p in self.peers]

    def recv_buffer(self, src: int, step: int, seg: int, nbytes: int) -> Array:
        if src not in self._inbox or not self._known(src, step, seg):
            raise ProtocolError(f"shared allreduce: unexpected message {step}/{seg} from {src}")
        if (src, step, seg) in self._seen:
            raise ProtocolError(f"shared allreduce: message {step}/{seg} from rank {src} twice")
        if step == READY:
            return self._check_size("shared allreduce", self._inbox[src], nbytes)
        return self._check_size("shared allreduce", self.buffer[:0], nbytes)

    def on_message(self, src: int, step: int, seg: int, payload: Array) -> list[Send]:
        self._seen.add((src, step, seg))
        self._received += 1
        self._left[src] -= 1
        if step == READY:
            where = int(payload.view(_OFFSET)[0])
            self._theirs[src] = self._memory.buffer(src, where, self.buffer)
        elif step == REDUCED:
            self._to_copy.append((src, seg))
        return []  # the reading and reducing are ``work``, one segment at a time

    @property
    def done(self) -> bool:
        return self._received == self._expected and self._released

    @property
    def has_work(self) -> bool:
        return self._may_reduce() or self._copyable() is not None or self._finished_here()

    def work(self) -> list[Send]:
        """Reduce my next segment if I may, else copy one final segment of a peer's; then, once
        nothing is left to read, say RELEASED."""
        sends = []
        if self._may_reduce():
            sends = self._reduce_one()
        elif (index := self._copyable()) is not None:
            peer, seg = self._to_copy.pop(index)
            theirs = self._theirs[peer]
            self._on_cores(lambda x, y: theirs.copy_to(self.buffer[x:y], x), *self._segs[peer][seg])
            self._copied += 1
        if self._finished_here():
            self._released = True
            sends += self._to_all(RELEASED, 0, self.buffer[:0])
        return sends

    def _may_reduce(self) -> bool:
        """Every READY is here and I have reduced no more than one segment beyond the REDUCED
        messages heard so far: the first at once, then one per segment a peer finished, so a
        peer's segment is copied here soon after it was written (still in the shared cache)
        and the ranks keep pace."""
        heard = self._copied + len(self._to_copy)  # REDUCED messages received so far
        ready = len(self._theirs) == len(self.peers) and not self._released
        return ready and self._reduced < min(len(self._segs[self.rank]), heard + 1)

    def _reduce_one(self) -> list[Send]:
        self._on_cores(self._reduce_range, *self._segs[self.rank][self._reduced])
        self._reduced += 1
        return self._to_all(REDUCED, self._reduced - 1, self.buffer[:0])

    def _reduce_range(self, a: int, b: int) -> None:
        """Elements [a, b) of my chunk: the peers' combined in, in ascending rank order."""
        target = self.buffer[a:b]
        for peer in self.peers:
            for start, piece in self._theirs[peer].read(a, b):
                combine(self.dtype, self.reduce_op, target[start - a :][: piece.size], piece)
        finalize(self.dtype, self.reduce_op, target, self.world_size)

    def _on_cores(self, work: Callable[[int, int], None], a: int, b: int) -> None:
        """``work`` over [a, b), cut among the pool's cores where there is one (every element
        is still done by one thread, with the same operands in the same order)."""
        if self._pool is None:
            work(a, b)
        else:
            self._pool.run(work, a, b, self.buffer.itemsize)

    def _copyable(self) -> int | None:
        """Where in the queue a final segment waits whose owner said where its buffer is."""
        for index, (peer, _) in enumerate(self._to_copy):
            if peer in self._theirs:
                return index
        return None

    def _finished_here(self) -> bool:
        """Every segment of mine is reduced and every peer's copied here, and RELEASED is not
        yet said: this rank reads no peer's buffer any more."""
        mine = self._segs[self.rank]
        complete = self._reduced == len(mine) and self._copied == self._to_copy_in_all
        return complete and not self._released
