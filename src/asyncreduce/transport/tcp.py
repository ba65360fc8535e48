"""TCP transport: frames over one connection per pair of ranks, driven by one selector loop.

Theory of operation. The connections come ready from the mesh (mesh.py); ``TcpTransport``
owns them from then on as non-blocking sockets. A frame to an idle connection goes
straight into the socket; otherwise it is queued, and a peer's queue is a heap on
(-priority, age, order): a frame of a more urgent operation overtakes queued ones at frame
granularity, and among equals the older operation's frames go first, so operations in flight
together finish one after another, as early as each can, instead of all at the end. Headers
and payloads leave together in one ``sendmsg``, several small frames at a time. Receiving
is the sans-IO ``FrameReader`` (frame.py) fed from the socket: headers come through a small
staging buffer (several small frames per ``recv``); a payload that came whole with its header
may be consumed right there (``frame_view``), else, once the header is checked, the payload
is received straight into the buffer the sink names, usually its final place, waking only
once a good part of the rest has arrived (SO_RCVLOWAT). A large payload to a same-host peer
travels in its shared-memory arena instead (the shm lane: a flagged header on the wire,
CREDIT frames returning the space). Closing is a handshake: GOODBYE, half-close, read to EOF.
EOF otherwise, a reset, or a frame that breaks the protocol ends that connection and is
reported once.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import selectors
import socket
from collections import deque
from collections.abc import Collection
from typing import TYPE_CHECKING

from ..samehost.shm import SHM_MIN_BYTES, Arena
from .arena import credited, from_arena, to_arena
from .base import FrameSink, Transport
from .connection import Connection, Outgoing
from .frame import (
    CREDIT,
    DATA,
    FLAG_SHM,
    GOODBYE,
    Descriptor,
    FrameError,
    Header,
    pack_header,
)
from .listener import WakeUp
from .pairs import NOT_HERE, QuietPairs, native_take_wanted

if TYPE_CHECKING:
    from ..kernels.fold import Combining, Swap

__all__ = ["TcpTransport", "native_take_wanted"]

_READS_PER_EVENT = 64
_BATCH_FRAMES = 64  # at most this many frames per sendmsg (IOV_MAX is 1024)
_BATCH_BYTES = 1 << 20  # small frames are batched up to this size
_BURST_BYTES = 4 << 20  # written to one peer before incoming frames are read again


class TcpTransport(Transport):
    """Frames over one TCP connection per peer (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        sockets: dict[int, socket.socket],
        sink: FrameSink,
        arenas: dict[int, tuple[Arena, Arena]] | None = None,
    ) -> None:
        """``arenas`` maps a same-host peer to (the arena this rank writes, the one it reads)."""
        self.rank = rank
        self.sink = sink
        self._selector = selectors.DefaultSelector()
        self._order = itertools.count()
        self._wake = WakeUp()
        self._selector.register(self._wake.reader, selectors.EVENT_READ, None)
        self._peers: dict[int, Connection] = {}
        self._leaving = False  # we said goodbye: peers' EOFs are expected
        self._gone: list[Connection] = []
        self._lost: set[int] = set()  # ranks whose connection is gone (sends to them: dropped)
        self._pairs = QuietPairs(self._peers, self._sent, self._lose, self._parse_staged)
        for peer_rank, sock in sockets.items():
            sock.setblocking(False)
            peer = Connection(peer_rank, sock, (arenas or {}).get(peer_rank))
            self._peers[peer_rank] = peer
            self._selector.register(sock, selectors.EVENT_READ, peer)

    # ---- sending -------------------------------------------------------------------------

    def send(
        self,
        peer: int,
        head: bytes,
        payload: memoryview,
        priority: int,
        token: object,
        age: int = 0,
    ) -> None:
        target = self._peers.get(peer)
        if target is None:
            if peer not in self._lost:
                raise KeyError(f"rank {peer} was never connected")
            self.sink.on_sent(token)  # it will never leave: reported as _lose reports its rest
            return
        idle = not target.queue and not target.inflight and not target.writing
        if idle and (target.arena_out is None or payload.nbytes < SHM_MIN_BYTES):
            self._send_now(target, head, payload, token, (-priority, age, 0))
            return
        out = Outgoing((-priority, age, next(self._order)), head, payload, token)
        heapq.heappush(target.queue, out)
        if not target.inflight and not target.writing:  # writing: poll() flushes when it may
            self._flush(target)

    def send_now(self, peer: int, head: bytes, payload: memoryview, priority: int) -> bool:
        target = self._peers.get(peer)
        if target is None or target.queue or target.inflight or target.writing or (
            target.arena_out is not None and payload.nbytes >= SHM_MIN_BYTES
        ):  # fmt: skip  # (not quiet, or gone: as send does it)
            return super().send_now(peer, head, payload, priority)
        return self._send_now(target, head, payload, None, (-priority, 0, 0))

    def _send_now(
        self,
        peer: Connection,
        head: bytes,
        payload: memoryview,
        token: object,
        order: tuple[int, int, int],
    ) -> bool:
        """A frame to an idle connection: straight into the socket, no queueing (the common
        case of a small operation); what does not fit is queued in flight as usual. Whether
        it left whole."""
        try:
            n: int | OSError = peer.sock.sendmsg([head, payload])
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as exc:
            n = exc
        return self._sent(peer, head, payload, token, order, n)

    def _sent(
        self, peer: Connection, head: bytes, payload: memoryview, token: object,
        order: tuple[int, int, int], n: int | OSError,
    ) -> bool:  # fmt: skip
        """After a frame's ``sendmsg`` to an idle connection wrote ``n`` bytes of it (or
        failed): what did not leave is queued in flight (or reported unsent: the connection
        is lost). Whether it left whole."""
        if isinstance(n, OSError):
            peer.inflight.append(Outgoing(order, head, payload, token))
            self._lose(peer, n)  # which reports it unsent
            return False
        if n == len(head) + payload.nbytes:
            self.sink.on_sent(token)
            return True
        peer.inflight.append(Outgoing(order, head, payload, token, n))
        self._want_write(peer, True)
        return False

    def _flush(self, peer: Connection) -> None:
        """Write queued frames until the socket is full; several small frames per sendmsg.

        At most _BURST_BYTES per call: then the loop reads what came in (a FLOW "hold", a
        CREDIT, an urgent frame) before writing more."""
        written = 0
        while True:
            if written >= _BURST_BYTES:
                self._want_write(peer, True)
                return
            if not peer.inflight:
                if not peer.queue:
                    self._want_write(peer, False)
                    if peer.half_close:
                        self._shut_write(peer)
                    return
                self._take_batch(peer)
                if not peer.inflight:  # waiting for arena space: the CREDIT frame resumes us
                    self._want_write(peer, False)
                    return
            buffers = [piece for out in peer.inflight for piece in out.remaining()]
            try:
                n = peer.sock.sendmsg(buffers)
            except (BlockingIOError, InterruptedError):
                self._want_write(peer, True)
                return
            except OSError as exc:
                self._lose(peer, exc)
                return
            self._advance(peer, n)
            written += n

    def _take_batch(self, peer: Connection) -> None:
        """Move the most urgent frames into flight: one large frame, or many small ones."""
        total = 0
        while peer.queue and len(peer.inflight) < _BATCH_FRAMES:
            if not to_arena(peer, peer.queue[0]):
                return  # the arena is full: wait for the reader's CREDIT
            if peer.inflight and total + peer.queue[0].size > _BATCH_BYTES:
                return
            out = heapq.heappop(peer.queue)
            peer.inflight.append(out)
            total += out.size

    def _advance(self, peer: Connection, n: int) -> None:
        while n:
            out = peer.inflight[0]
            took = min(n, out.size - out.sent)
            out.sent += took
            n -= took
            if out.sent == out.size:
                peer.inflight.popleft()
                self.sink.on_sent(out.token)
        while peer.inflight and peer.inflight[0].sent == peer.inflight[0].size:
            self.sink.on_sent(peer.inflight.popleft().token)  # empty frames: nothing to write

    def _want_write(self, peer: Connection, on: bool) -> None:
        if peer.writing != on and peer.rank in self._peers:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
            self._selector.modify(peer.sock, events, peer)
            peer.writing = on

    def _shut_write(self, peer: Connection) -> None:
        peer.half_close = False
        try:
            peer.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # already gone; EOF or an error on read will end it

    def send_goodbye(self, reason: bytes) -> None:
        self._leaving = True
        head = pack_header(GOODBYE, b"", 0, 0, 0, len(reason), Descriptor(0, 0, 0, 0, 0))
        for peer in list(self._peers.values()):
            out = Outgoing((-(1 << 62), 0, next(self._order)), head, memoryview(reason), None)
            heapq.heappush(peer.queue, out)
            peer.half_close = True
            if not peer.inflight:
                self._flush(peer)

    def release(self, peer_rank: int) -> None:
        peer = self._peers.get(peer_rank)
        if peer is None:
            return
        dropped, peer.queue = peer.queue, []
        peer.half_close = True
        if not peer.inflight:
            self._flush(peer)
        for out in dropped:
            self.sink.on_sent(out.token)

    def open_peers(self) -> int:
        return len(self._peers)

    def drop(self, token: object) -> None:
        for peer in self._peers.values():
            kept = [out for out in peer.queue if out.token is not token]
            if len(kept) != len(peer.queue):
                heapq.heapify(kept)
                peer.queue = kept
            for out in peer.inflight:
                if out.token is token:
                    out.payload = memoryview(bytes(out.payload))

    def withdraw(self, peer_rank: int) -> list[tuple[bytes, memoryview, object]]:
        queued = self._peers[peer_rank].queue if peer_rank in self._peers else []
        taken = sorted(out for out in queued if out.token is not None)
        queued[:] = [out for out in queued if out.token is None]
        heapq.heapify(queued)
        return [(out.head, out.payload, out.token) for out in taken]

    def quiet(self, peer: int, nbytes: int) -> bool:
        return self._pairs.quiet(peer, nbytes)

    def swap(
        self, peer: int, head: bytes, payload: memoryview, priority: int, seconds: float = 0.0,
        combining: Combining | None = None, incoming_first: bool = False,
    ) -> memoryview | None:  # fmt: skip
        """(See Transport.) In C where it can (pairs.py), else as ``Transport.swap`` does it."""
        found = self._pairs.swap(peer, head, payload, priority, seconds, combining, incoming_first)
        if found is NOT_HERE:
            return super().swap(peer, head, payload, priority, seconds)
        return found  # type: ignore[return-value]

    def swaps(
        self, steps: tuple[Swap, ...], head: bytes, payload: memoryview, priority: int,
        seconds: float = 0.0, combining: Combining | None = None,
    ) -> tuple[int, memoryview | None]:  # fmt: skip
        """(See Transport.) All in one call into C where it can (pairs.py), else ``swap`` by
        ``swap``."""
        done = self._pairs.swaps(steps, head, payload, priority, seconds, combining)
        if done is None:
            return super().swaps(steps, head, payload, priority, seconds, combining)
        return done

    def take_frame(
        self, peer: int, head: bytes, size: int, seconds: float = 0.0
    ) -> memoryview | None:
        return self._pairs.take_frame(peer, head, size, seconds)

    def divert(self, peer_rank: int) -> None:
        peer = self._peers.get(peer_rank)
        if peer is not None:
            peer.reader.divert()

    # ---- receiving -----------------------------------------------------------------------

    def _on_readable(self, peer: Connection) -> None:
        try:
            for _ in range(_READS_PER_EVENT):
                if not self._read_once(peer):
                    return
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, FrameError) as exc:
            self._lose(peer, exc)

    def _read_once(self, peer: Connection) -> bool:
        """One recv; returns False when the socket has nothing more (or the peer is gone)."""
        reader = peer.reader
        room = reader.room()
        n = peer.sock.recv_into(room)
        if n == 0:
            return self._eof(peer)
        if reader.payload is None:  # headers (and small payloads) through the staging buffer
            reader.received(n)
            self._parse_staged(peer)
            return n == len(room) and peer.rank in self._peers  # a short read: drained for now
        if reader.received(n):
            self._set_lowat(peer, 1)  # the next header wakes us at once
            self._deliver(peer)
            return True
        self._set_lowat(peer, min(len(room) - n, peer.lowat_cap))
        return False  # a short read means the socket is drained for now

    def _set_lowat(self, peer: Connection, nbytes: int) -> None:
        """Wake for this peer only once ``nbytes`` have arrived (SO_RCVLOWAT; an EOF or an
        error wakes at once). Used for the rest of a payload, which its sender writes whole:
        one wake-up per ~half a megabyte instead of one per ~64 KiB the network delivers,
        so a rank that computes meanwhile is interrupted a tenth as often."""
        nbytes = max(1, nbytes)
        if peer.lowat == nbytes:
            return
        try:
            peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
        except OSError:  # not supported here: wake for every byte, as without it
            peer.lowat_cap = 1
            return
        peer.lowat = nbytes

    def _parse_staged(self, peer: Connection) -> None:
        """Take every complete frame out of the staging buffer, and start the payload after."""
        reader = peer.reader
        while (header := reader.next_header()) is not None:
            if header.type == CREDIT:
                reader.skip()
                credited(peer, header.instance)
                if not peer.inflight:
                    self._flush(peer)
            elif header.flags & FLAG_SHM:
                credit = from_arena(peer, header, self.sink)
                if credit is not None:
                    self.send(peer.rank, credit, memoryview(b""), 1 << 62, None)
            else:
                self._start_payload(peer, header)

    def _start_payload(self, peer: Connection, header: Header) -> None:
        reader, size = peer.reader, header.payload_len
        if size and header.type == DATA:
            staged = reader.staged_payload(size)
            if staged is not None and self.sink.frame_view(peer.rank, header, staged):
                reader.skip(size)  # consumed where it lies
                return
        dest = self.sink.frame_buffer(peer.rank, header)
        if dest is None:
            dest = memoryview(bytearray(size))
        elif len(dest) != size:
            raise FrameError(f"rank {peer.rank} sent {size} bytes where {len(dest)} were expected")
        if reader.land(dest):
            self._deliver(peer)

    def _deliver(self, peer: Connection) -> None:
        header = peer.reader.header
        payload = peer.reader.finish()
        assert header is not None
        if header.type == GOODBYE:
            peer.said_goodbye = True
        self.sink.on_frame(peer.rank, header, payload)

    def _eof(self, peer: Connection) -> bool:
        """EOF is the end of a closing handshake (either side said goodbye), else a failure."""
        orderly = peer.said_goodbye or self._leaving
        if orderly and peer.reader.between_frames():
            for out in self._remove(peer):
                self.sink.on_sent(out.token)  # never leaving now: nobody waits for them
            return False
        raise ConnectionResetError(errno.ECONNRESET, "connection closed by peer")

    # ---- the loop ------------------------------------------------------------------------

    def poll(self, timeout: float | None, unread: Collection[int] = ()) -> None:
        if self._pairs.settle():  # (a look that found something else: news, so no waiting)
            timeout = 0.0
        for key, events in self._selector.select(timeout):
            peer = key.data
            if peer is None:
                self._wake.drain()
                continue
            if events & selectors.EVENT_WRITE and peer.rank in self._peers:
                self._flush(peer)
            readable = events & selectors.EVENT_READ and peer.rank not in unread
            if readable and peer.rank in self._peers:
                self._on_readable(peer)

    def wakeup(self) -> None:
        self._wake.wake()

    def _remove(self, peer: Connection) -> list[Outgoing]:
        """Forget ``peer``; return the frames that will now never leave."""
        if self._peers.pop(peer.rank, None) is None:
            return []
        self._selector.unregister(peer.sock)
        peer.sock.close()
        self._gone.append(peer)  # its arenas are unmapped at close(), never mid-frame
        self._lost.add(peer.rank)
        unsent = list(peer.inflight) + peer.queue
        peer.queue, peer.inflight = [], deque()
        return unsent

    def _lose(self, peer: Connection, error: BaseException) -> None:
        if peer.rank not in self._peers:
            return
        unsent = self._remove(peer)
        if peer.said_goodbye:
            error = ConnectionResetError(
                f"rank {peer.rank} reset the connection after its goodbye: {error}"
            )
        self.sink.on_peer_lost(peer.rank, error)
        for out in unsent:
            self.sink.on_sent(out.token)

    def close(self) -> None:
        for peer in list(self._peers.values()):
            self._selector.unregister(peer.sock)
            peer.sock.close()
        for peer in [*self._peers.values(), *self._gone]:
            for arena in (peer.arena_in, peer.arena_out):
                if arena is not None:
                    arena.close()
        self._peers.clear()
        self._selector.close()
        self._wake.close()
