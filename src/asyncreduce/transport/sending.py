"""The sending side of the TCP transport (tcp.py): every connection's queue, and its writes.

Theory of operation. A frame to an idle connection goes straight into the socket
(``send_idle``); otherwise it is queued, and a peer's queue is a heap on (-priority, age,
order): a frame of a more urgent operation overtakes queued ones at frame granularity, and
among equals the older operation's frames go first, so operations in flight together finish
one after another, as early as each can, instead of all at the end. ``flush`` moves the most
urgent frames into flight (one large frame, or many small ones) and writes them: headers and
payloads leave together in one ``sendmsg``, several small frames at a time, and at most
_BURST_BYTES to one peer before the loop reads what came in. A large payload to a same-host
peer goes into its arena as it is taken into flight (arena.py); a full arena stops the queue
until the reader's CREDIT. Every frame that has left, or never will, is reported to the
sink's ``on_sent`` once. What ends a connection (an error on write) is the transport's to
handle: ``lose``.
"""

from __future__ import annotations

import heapq
import itertools
import selectors
import socket
from collections.abc import Callable

from ..samehost.shm import SHM_MIN_BYTES
from .arena import to_arena
from .base import FrameSink
from .connection import Connection, Outgoing
from .frame import GOODBYE, Descriptor, pack_header

__all__ = ["Sender"]

_BATCH_FRAMES = 64  # at most this many frames per sendmsg (IOV_MAX is 1024)
_BATCH_BYTES = 1 << 20  # small frames are batched up to this size
_BURST_BYTES = 4 << 20  # written to one peer before incoming frames are read again


class Sender:
    """The queues and writes of one transport's connections (see the module docstring)."""

    def __init__(
        self, peers: dict[int, Connection], lost: set[int], selector: selectors.BaseSelector,
        sink: FrameSink, lose: Callable[[Connection, BaseException], None],
    ) -> None:  # fmt: skip
        """``peers``: the transport's open connections (its own dict); ``lost``: the ranks
        whose connection is gone (its own set); ``selector``: its loop's, where a connection
        waits to be writable; ``lose``: it ends a connection (and reports what never left)."""
        self._peers, self._lost, self._selector = peers, lost, selector
        self._sink = sink
        self._lose = lose
        self._order = itertools.count()
        self.leaving = False  # we said goodbye: peers' EOFs are expected

    def send(
        self,
        peer: int,
        head: bytes,
        payload: memoryview,
        priority: int,
        token: object,
        age: int = 0,
    ) -> None:
        """(See ``Transport.send``.)"""
        target = self._peers.get(peer)
        if target is None:
            if peer not in self._lost:
                raise KeyError(f"rank {peer} was never connected")
            self._sink.on_sent(token)  # it will never leave: reported as ``lose`` reports the rest
            return
        idle = not target.queue and not target.inflight and not target.writing
        if idle and (target.arena_out is None or payload.nbytes < SHM_MIN_BYTES):
            self.send_idle(target, head, payload, token, (-priority, age, 0))
            return
        out = Outgoing((-priority, age, next(self._order)), head, payload, token)
        heapq.heappush(target.queue, out)
        if not target.inflight and not target.writing:  # writing: poll() flushes when it may
            self.flush(target)

    def send_idle(
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
        return self.record_idle_send(peer, head, payload, token, order, n)

    def record_idle_send(
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
            self._sink.on_sent(token)
            return True
        peer.inflight.append(Outgoing(order, head, payload, token, n))
        self._want_write(peer, True)
        return False

    def flush(self, peer: Connection) -> None:
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
        """``n`` more bytes of the frames in flight have left: report those now whole."""
        while n:
            out = peer.inflight[0]
            took = min(n, out.size - out.sent)
            out.sent += took
            n -= took
            if out.sent == out.size:
                peer.inflight.popleft()
                self._sink.on_sent(out.token)
        while peer.inflight and peer.inflight[0].sent == peer.inflight[0].size:
            self._sink.on_sent(peer.inflight.popleft().token)  # empty frames: nothing to write

    def _want_write(self, peer: Connection, on: bool) -> None:
        """Whether the loop should wake when ``peer``'s socket is writable."""
        if peer.writing != on and peer.rank in self._peers:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
            self._selector.modify(peer.sock, events, peer)
            peer.writing = on

    def _shut_write(self, peer: Connection) -> None:
        """Half-close: everything queued has left."""
        peer.half_close = False
        try:
            peer.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # already gone; EOF or an error on read will end it

    def send_goodbye(self, reason: bytes) -> None:
        """(See ``Transport.send_goodbye``.) Ahead of everything queued."""
        self.leaving = True
        head = pack_header(GOODBYE, b"", 0, 0, 0, len(reason), Descriptor(0, 0, 0, 0, 0))
        for peer in list(self._peers.values()):
            out = Outgoing((-(1 << 62), 0, next(self._order)), head, memoryview(reason), None)
            heapq.heappush(peer.queue, out)
            peer.half_close = True
            if not peer.inflight:
                self.flush(peer)

    def release(self, peer_rank: int) -> None:
        """(See ``Transport.release``.)"""
        peer = self._peers.get(peer_rank)
        if peer is None:
            return
        dropped, peer.queue = peer.queue, []
        peer.half_close = True
        if not peer.inflight:
            self.flush(peer)
        for out in dropped:
            self._sink.on_sent(out.token)

    def drop(self, token: object) -> None:
        """(See ``Transport.drop``.)"""
        for peer in self._peers.values():
            kept = [out for out in peer.queue if out.token is not token]
            if len(kept) != len(peer.queue):
                heapq.heapify(kept)
                peer.queue = kept
            for out in peer.inflight:
                if out.token is token:
                    out.payload = memoryview(bytes(out.payload))

    def withdraw(self, peer_rank: int) -> list[tuple[bytes, memoryview, object]]:
        """(See ``Transport.withdraw``.)"""
        queued = self._peers[peer_rank].queue if peer_rank in self._peers else []
        taken = sorted(out for out in queued if out.token is not None)
        queued[:] = [out for out in queued if out.token is None]
        heapq.heapify(queued)
        return [(out.head, out.payload, out.token) for out in taken]
