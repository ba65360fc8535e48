"""TCP transport: one connection per pair of ranks, driven by one selector loop.

Theory of operation. ``connect_mesh`` builds the full mesh once: every rank listens, publishes
its address through the rendezvous store, connects to every lower rank and accepts every
higher one. Each connection opens with a HELLO (magic, version, rank, world size, job token)
that the acceptor checks and echoes; anything else is dropped. With a shared secret an HMAC
challenge-response comes first (see the notes above ``connect_mesh`` and auth.py).

``TcpTransport`` then owns the non-blocking sockets. A frame to an idle connection goes
straight into the socket; otherwise it is queued, and a peer's queue is a heap on
(-priority, age, order): a frame of a more urgent operation overtakes queued ones at frame
granularity, and among equals the older operation's frames go first, so operations in flight
together finish one after another, as early as each can, instead of all at the end. Headers
and payloads leave together in one ``sendmsg``, several small frames at a time. Receiving
reads headers through a small staging buffer (several small frames per ``recv``); a payload
that came whole with its header may be consumed right there (``frame_view``), else, once
the header is checked, the payload is received straight into the buffer the sink names,
usually its final place, waking only once a good part of the rest has arrived
(SO_RCVLOWAT). EOF, a reset, or a frame that breaks the protocol ends that connection and is
reported once.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import selectors
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass, field

from ..auth import (
    ANSWER_BYTES,
    FROM_ENV,
    NONCE_BYTES,
    PROOF_BYTES,
    REJECTED,
    AuthenticationError,
    ClientHandshake,
    RejectionLog,
    Secret,
    SecretArg,
    ServerHandshake,
    resolve_secret,
    warn_if_exposed,
)
from .base import FrameSink, Transport
from .frame import (
    CREDIT,
    DATA,
    FLAG_SHM,
    GOODBYE,
    HEADER,
    Descriptor,
    FrameError,
    Header,
    pack_header,
    parse_header,
    with_flags,
)
from .shm import SHM_MIN_BYTES, Arena, copy_bytes

__all__ = ["TcpTransport", "connect_mesh", "HELLO"]

log = logging.getLogger("asyncreduce.transport")

HELLO = struct.Struct("<4sBII16s")
_HELLO_MAGIC = b"ARDH"
_STAGE_BYTES = 64 << 10
_READS_PER_EVENT = 64
_SOCKET_BUFFER = 4 << 20
_BATCH_FRAMES = 64  # at most this many frames per sendmsg (IOV_MAX is 1024)
_BATCH_BYTES = 1 << 20  # small frames are batched up to this size
_BURST_BYTES = 4 << 20  # written to one peer before incoming frames are read again
_LOWAT_BYTES = 512 << 10  # the most of a payload's rest to wait for before waking (_set_lowat)


@dataclass(order=True)
class _Out:
    """One queued frame; ``sent`` bytes of head+payload have left already."""

    rank: tuple[int, int, int]  # (-priority, age, order): the heap's order
    head: bytes = field(compare=False)
    payload: memoryview = field(compare=False)
    token: object = field(compare=False)
    sent: int = field(default=0, compare=False)

    def remaining(self) -> list[memoryview | bytes]:
        h = len(self.head)
        if self.sent < h:
            return [self.head[self.sent :], self.payload]
        return [self.payload[self.sent - h :]]

    @property
    def size(self) -> int:
        return len(self.head) + len(self.payload)


class _Peer:
    """One connection: its send queue and where its receive state machine stands."""

    def __init__(self, rank: int, sock: socket.socket, arenas: tuple[Arena, Arena] | None) -> None:
        self.rank = rank
        self.sock = sock
        self.arena_out: Arena | None = arenas[0] if arenas else None  # we write, it reads
        self.arena_in: Arena | None = arenas[1] if arenas else None  # it writes, we read
        self.queue: list[_Out] = []  # a heap: most urgent first
        self.inflight: deque[_Out] = deque()  # taken from the queue, being written in order
        self.writing = False
        self.stage = bytearray(_STAGE_BYTES)
        self.stage_view = memoryview(self.stage)
        self.lo = 0  # staged bytes not yet parsed: stage[lo:hi]
        self.hi = 0
        self.header: Header | None = None
        self.name_len = 0
        self.payload: memoryview | None = None
        self.filled = 0
        self.lowat = 1  # the socket's SO_RCVLOWAT
        # wait for at most a quarter of the receive buffer the kernel granted (it caps SO_RCVBUF
        # at net.core.rmem_max): more could exceed what the window lets the sender send
        self.lowat_cap = min(_LOWAT_BYTES, _receive_buffer(sock) // 4)
        self.said_goodbye = False  # the peer is closing in good order: EOF is expected
        self.half_close = False  # shut our side once the queue is empty


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
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._peers: dict[int, _Peer] = {}
        self._leaving = False  # we said goodbye: peers' EOFs are expected
        self._gone: list[_Peer] = []
        for peer_rank, sock in sockets.items():
            sock.setblocking(False)
            peer = _Peer(peer_rank, sock, (arenas or {}).get(peer_rank))
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
            raise KeyError(f"rank {peer} is not connected")
        idle = not target.queue and not target.inflight and not target.writing
        if idle and (target.arena_out is None or payload.nbytes < SHM_MIN_BYTES):
            self._send_now(target, head, payload, token, (-priority, age, 0))
            return
        out = _Out((-priority, age, next(self._order)), head, payload, token)
        heapq.heappush(target.queue, out)
        if not target.inflight and not target.writing:  # writing: poll() flushes when it may
            self._flush(target)

    def _send_now(
        self,
        peer: _Peer,
        head: bytes,
        payload: memoryview,
        token: object,
        rank: tuple[int, int, int],
    ) -> None:
        """A frame to an idle connection: straight into the socket, no queueing (the common
        case of a small operation); what does not fit is queued in flight as usual."""
        try:
            n = peer.sock.sendmsg([head, payload])
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as exc:
            peer.inflight.append(_Out(rank, head, payload, token))
            self._lose(peer, exc)  # which reports it unsent
            return
        if n == len(head) + payload.nbytes:
            self.sink.on_sent(token)
            return
        peer.inflight.append(_Out(rank, head, payload, token, n))
        self._want_write(peer, True)

    def _flush(self, peer: _Peer) -> None:
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

    def _take_batch(self, peer: _Peer) -> None:
        """Move the most urgent frames into flight: one large frame, or many small ones."""
        total = 0
        while peer.queue and len(peer.inflight) < _BATCH_FRAMES:
            if not self._to_arena(peer, peer.queue[0]):
                return  # the arena is full: wait for the reader's CREDIT
            if peer.inflight and total + peer.queue[0].size > _BATCH_BYTES:
                return
            out = heapq.heappop(peer.queue)
            peer.inflight.append(out)
            total += out.size

    def _to_arena(self, peer: _Peer, out: _Out) -> bool:
        """Move a large payload for a same-host peer into its arena; False if no room yet."""
        arena = peer.arena_out
        size = out.payload.nbytes
        if arena is None or size < SHM_MIN_BYTES or not arena.fits(size) or out.sent:
            return True
        if not arena.write(out.payload):
            return False
        out.head = with_flags(out.head, FLAG_SHM)
        out.payload = memoryview(b"")
        return True

    def _advance(self, peer: _Peer, n: int) -> None:
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

    def _want_write(self, peer: _Peer, on: bool) -> None:
        if peer.writing != on and peer.rank in self._peers:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
            self._selector.modify(peer.sock, events, peer)
            peer.writing = on

    def _shut_write(self, peer: _Peer) -> None:
        peer.half_close = False
        try:
            peer.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # already gone; EOF or an error on read will end it

    def send_goodbye(self, reason: bytes) -> None:
        self._leaving = True
        head = pack_header(GOODBYE, b"", 0, 0, 0, len(reason), Descriptor(0, 0, 0, 0, 0))
        for peer in list(self._peers.values()):
            out = _Out((-(1 << 62), 0, next(self._order)), head, memoryview(reason), None)
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

    def divert(self, peer_rank: int) -> None:
        peer = self._peers.get(peer_rank)
        if peer is not None and peer.payload is not None:
            peer.payload = memoryview(bytearray(len(peer.payload)))

    # ---- receiving -----------------------------------------------------------------------

    def _on_readable(self, peer: _Peer) -> None:
        try:
            for _ in range(_READS_PER_EVENT):
                if not self._read_once(peer):
                    return
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, FrameError) as exc:
            self._lose(peer, exc)

    def _read_once(self, peer: _Peer) -> bool:
        """One recv; returns False when the socket has nothing more (or the peer is gone)."""
        if peer.payload is not None:
            wanted = len(peer.payload) - peer.filled
            n = peer.sock.recv_into(peer.payload[peer.filled :])
            if n == 0:
                return self._eof(peer)
            peer.filled += n
            if n == wanted:
                self._set_lowat(peer, 1)  # the next header wakes us at once
                self._deliver(peer)
                return True
            self._set_lowat(peer, min(wanted - n, peer.lowat_cap))
            return False  # a short read means the socket is drained for now
        if peer.lo == peer.hi:
            peer.lo = peer.hi = 0
        elif peer.hi == len(peer.stage):
            peer.stage[: peer.hi - peer.lo] = peer.stage[peer.lo : peer.hi]
            peer.hi -= peer.lo
            peer.lo = 0
        room = len(peer.stage) - peer.hi
        n = peer.sock.recv_into(peer.stage_view[peer.hi :])
        if n == 0:
            return self._eof(peer)
        peer.hi += n
        self._parse_staged(peer)
        return n == room and peer.rank in self._peers  # a short read: drained for now

    def _set_lowat(self, peer: _Peer, nbytes: int) -> None:
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

    def _parse_staged(self, peer: _Peer) -> None:
        """Take every complete header out of the staging buffer, and what payload follows it."""
        while peer.payload is None:
            available = peer.hi - peer.lo
            if peer.header is None:
                if available < HEADER.size:
                    return
                peer.name_len, peer.header = parse_header(
                    peer.stage_view[peer.lo : peer.lo + HEADER.size]
                )
                peer.lo += HEADER.size
                continue
            if peer.name_len:
                if available < peer.name_len:
                    return
                peer.header.name = bytes(peer.stage_view[peer.lo : peer.lo + peer.name_len])
                peer.lo += peer.name_len
                peer.name_len = 0
                continue
            if peer.header.type == CREDIT:
                self._on_credit(peer, peer.header.instance)
            elif peer.header.flags & FLAG_SHM:
                self._from_arena(peer)
            else:
                self._start_payload(peer)

    def _on_credit(self, peer: _Peer, position: int) -> None:
        peer.header = None
        if peer.arena_out is None:
            raise FrameError(f"rank {peer.rank} returned arena space it was never given")
        try:
            peer.arena_out.credit(position)
        except ValueError as exc:
            raise FrameError(f"rank {peer.rank}: {exc}") from None
        if not peer.inflight:
            self._flush(peer)

    def _from_arena(self, peer: _Peer) -> None:
        """A payload in the peer's arena: reduce straight from it, or copy it out; then credit."""
        header, arena = peer.header, peer.arena_in
        assert header is not None
        if arena is None or header.type != DATA or not arena.fits(header.payload_len):
            raise FrameError(f"rank {peer.rank} sent a shared-memory frame this rank cannot read")
        view = arena.read(header.payload_len)
        if self.sink.frame_view(peer.rank, header, view):
            peer.header = None
        else:
            dest = self.sink.frame_buffer(peer.rank, header) or memoryview(bytearray(len(view)))
            if len(dest) != len(view):
                raise FrameError(
                    f"rank {peer.rank} sent {len(view)} bytes where {len(dest)} were expected"
                )
            copy_bytes(dest, view)
            peer.payload = dest
            self._deliver(peer)
        view.release()
        if arena.credit_due():  # credit in batches
            arena.credited = arena.position
            credit = pack_header(CREDIT, b"", arena.position, 0, 0, 0, Descriptor(0, 0, 0, 0, 0))
            self.send(peer.rank, credit, memoryview(b""), 1 << 62, None)

    def _start_payload(self, peer: _Peer) -> None:
        assert peer.header is not None
        size = peer.header.payload_len
        if size and peer.hi - peer.lo >= size and peer.header.type == DATA:
            staged = peer.stage_view[peer.lo : peer.lo + size]
            if self.sink.frame_view(peer.rank, peer.header, staged):  # consumed where it lies
                peer.lo += size
                peer.header = None
                return
        dest = self.sink.frame_buffer(peer.rank, peer.header)
        if dest is None:
            dest = memoryview(bytearray(size))
        elif len(dest) != size:
            raise FrameError(f"rank {peer.rank} sent {size} bytes where {len(dest)} were expected")
        take = min(size, peer.hi - peer.lo)
        dest[:take] = peer.stage_view[peer.lo : peer.lo + take]
        peer.lo += take
        peer.payload, peer.filled = dest, take
        if take == size:
            self._deliver(peer)

    def _deliver(self, peer: _Peer) -> None:
        header, payload = peer.header, peer.payload
        assert header is not None and payload is not None
        peer.header, peer.payload, peer.filled = None, None, 0
        if header.type == GOODBYE:
            peer.said_goodbye = True
        self.sink.on_frame(peer.rank, header, payload)

    def _eof(self, peer: _Peer) -> bool:
        """EOF is the end of a closing handshake (either side said goodbye), else a failure."""
        orderly = peer.said_goodbye or self._leaving
        if orderly and peer.header is None and peer.lo == peer.hi:
            for out in self._remove(peer):
                self.sink.on_sent(out.token)  # never leaving now: nobody waits for them
            return False
        raise ConnectionResetError(errno.ECONNRESET, "connection closed by peer")

    # ---- the loop ------------------------------------------------------------------------

    def poll(self, timeout: float | None) -> None:
        for key, events in self._selector.select(timeout):
            peer = key.data
            if peer is None:
                self._drain_wakeups()
                continue
            if events & selectors.EVENT_WRITE and peer.rank in self._peers:
                self._flush(peer)
            if events & selectors.EVENT_READ and peer.rank in self._peers:
                self._on_readable(peer)

    def wakeup(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already pending, or closing

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _remove(self, peer: _Peer) -> list[_Out]:
        """Forget ``peer``; return the frames that will now never leave."""
        if self._peers.pop(peer.rank, None) is None:
            return []
        self._selector.unregister(peer.sock)
        peer.sock.close()
        self._gone.append(peer)  # its arenas are unmapped at close(), never mid-frame
        unsent = list(peer.inflight) + peer.queue
        peer.queue, peer.inflight = [], deque()
        return unsent

    def _lose(self, peer: _Peer, error: BaseException) -> None:
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
        self._wake_r.close()
        self._wake_w.close()


# ---- building the mesh ---------------------------------------------------------------------
#
# The handshake, every message fixed-size and every wait under a deadline:
#
#   without a secret   dialer -> HELLO                   acceptor -> HELLO
#   with a secret      dialer -> "ARDHAUTH"              acceptor -> "ARDHAUTH" | nonce_s
#                      dialer -> answer | HELLO          acceptor -> proof | HELLO
#
# (answer and proof as in auth.py: one extra round trip.) The acceptor reads the dialer's HELLO
# only once the answer has proved the secret. An acceptor that gets the other greeting than the
# one it expects answers with its own ("ARDHAUTH", or "ARDHNONE" when it has no secret) and
# hangs up, so the dialer can say which side lacks the secret. The acceptor runs any number of
# handshakes at once (a silent or slow connection holds up nobody), drops each one that is not
# done within _HANDSHAKE_SECONDS, keeps at most _MAX_PENDING unfinished ones beyond the ranks
# it waits for, and logs the first drop of each cause at WARNING, later ones at DEBUG.

_AUTH_GREETING = b"ARDHAUTH"  # a dialer that authenticates opens with this instead of a HELLO
_NO_AUTH = b"ARDHNONE"  # an acceptor without a secret answers an authenticating dialer so
_CONTEXT = b"asyncreduce data v1"  # what the HMAC proofs of this protocol are bound to
_HANDSHAKE_SECONDS = 5.0
_MAX_PENDING = 128


def _receive_buffer(sock: socket.socket) -> int:
    """The receive buffer the kernel granted this socket (0 if it will not say)."""
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
    except OSError:
        return 0


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes (a small, fixed handshake size) before ``deadline``."""
    data = b""
    while len(data) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the handshake did not finish in time")
        sock.settimeout(remaining)
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("closed during handshake")
        data += chunk
    return data


def _hello(rank: int, world_size: int, token: bytes) -> bytes:
    return HELLO.pack(_HELLO_MAGIC, 1, rank, world_size, token)


def _check_hello(data: bytes, world_size: int, token: bytes) -> int:
    """The rank a HELLO claims, after checking that it comes from a rank of this job."""
    magic, version, rank, size, their_token = HELLO.unpack(data)
    if magic != _HELLO_MAGIC or version != 1:
        raise ConnectionError("not an asyncreduce peer")
    if size != world_size or their_token != token or not 0 <= rank < world_size:
        raise ConnectionError(f"peer claims rank {rank} of {size} in another job")
    return int(rank)


def connect_mesh(
    rank: int,
    world_size: int,
    listener: socket.socket,
    addresses: list[tuple[str, int]],
    token: bytes,
    deadline: float,
    *,
    secret: SecretArg = FROM_ENV,
) -> dict[int, socket.socket]:
    """Connect to every lower rank, accept every higher one; return {peer rank: socket}.

    ``listener`` is this rank's listening socket, already published as ``addresses[rank]``.
    ``secret`` (default: from ASYNCREDUCE_SECRET / ASYNCREDUCE_SECRET_FILE) makes every
    connection prove it both ways first; a peer that disagrees about the secret makes the
    dialer raise AuthenticationError and is dropped by the acceptor. Raises TimeoutError
    naming the ranks that never connected (and why connections were dropped, if any were).
    """
    key = resolve_secret(secret)
    host, port = listener.getsockname()[:2]
    warn_if_exposed(str(host), int(port), f"data listener of rank {rank}", key)
    socks: dict[int, socket.socket] = {}
    try:
        for peer in range(rank):
            socks[peer] = _dial(rank, world_size, peer, addresses[peer], token, deadline, key)
        _Acceptor(rank, world_size, listener, token, deadline, key).run(socks)
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    return socks


def _dial(
    rank: int,
    world_size: int,
    peer: int,
    address: tuple[str, int],
    token: bytes,
    deadline: float,
    secret: Secret | None,
) -> socket.socket:
    """A connection to ``peer``, handshake done; retried while the peer refuses or hangs up."""
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            _tune(sock)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.connect(address)
            hello = _handshake_out(sock, rank, world_size, peer, address, token, deadline, secret)
            if _check_hello(hello, world_size, token) != peer:
                raise ConnectionError(f"{address} is not rank {peer}")
            return sock
        except (ConnectionRefusedError, ConnectionResetError) as exc:
            sock.close()
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"rank {rank} could not connect to rank {peer} at {address}"
                ) from exc
            time.sleep(0.05)
        except TimeoutError as exc:
            sock.close()
            raise TimeoutError(
                f"rank {rank} could not connect to rank {peer} at {address}"
            ) from exc
        except BaseException:
            sock.close()
            raise


def _handshake_out(
    sock: socket.socket,
    rank: int,
    world_size: int,
    peer: int,
    address: tuple[str, int],
    token: bytes,
    deadline: float,
    secret: Secret | None,
) -> bytes:
    """The dialer's side of the handshake; returns the acceptor's HELLO, not yet checked."""
    who = f"rank {peer} at {address[0]}:{address[1]}"
    if secret is None:
        sock.sendall(_hello(rank, world_size, token))
        reply = _recv_exact(sock, HELLO.size, deadline)
        if reply.startswith(_AUTH_GREETING):
            raise AuthenticationError(
                f"{who} requires authentication, but rank {rank} has no secret: set "
                "ASYNCREDUCE_SECRET (or ASYNCREDUCE_SECRET_FILE) to the job's secret"
            )
        return reply
    sock.sendall(_AUTH_GREETING)
    greeting = _recv_exact(sock, len(_AUTH_GREETING), deadline)
    if greeting == _NO_AUTH:
        raise AuthenticationError(
            f"{who} does not authenticate, but rank {rank} has a secret (ASYNCREDUCE_SECRET "
            "or ASYNCREDUCE_SECRET_FILE): set the same secret on every rank, or on none"
        )
    if greeting != _AUTH_GREETING:
        raise ConnectionError(f"{who} is not an asyncreduce peer (it answered {greeting!r})")
    handshake = ClientHandshake(secret, _CONTEXT)
    answer = handshake.answer(_recv_exact(sock, NONCE_BYTES, deadline))
    sock.sendall(answer + _hello(rank, world_size, token))
    handshake.check(_recv_exact(sock, PROOF_BYTES, deadline), who)
    return _recv_exact(sock, HELLO.size, deadline)


class _Incoming:
    """An accepted connection whose handshake is not done: what it sent so far, its deadline."""

    __slots__ = ("sock", "peer", "deadline", "inbuf", "auth")

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.inbuf = bytearray()
        self.auth: ServerHandshake | None = None  # set once it asked to authenticate


class _Acceptor:
    """The accepting half of connect_mesh: every handshake at once, each under its deadline."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        listener: socket.socket,
        token: bytes,
        deadline: float,
        secret: Secret | None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.listener = listener
        self.token = token
        self.deadline = deadline
        self.secret = secret
        self.expected = set(range(rank + 1, world_size))
        self.pending: dict[socket.socket, _Incoming] = {}  # oldest first
        self.max_pending = _MAX_PENDING + len(self.expected)
        self.rejections = RejectionLog(log, f"rank {rank}")
        self.selector = selectors.DefaultSelector()

    def run(self, socks: dict[int, socket.socket]) -> None:
        """Accept until every higher rank is in ``socks``; TimeoutError at the deadline."""
        try:
            if self.expected:
                self.listener.setblocking(False)
                self.selector.register(self.listener, selectors.EVENT_READ, None)
            while self.expected:
                for key, _ in self.selector.select(self._next_timeout()):
                    if key.data is None:
                        self._accept()
                    else:
                        self._on_readable(key.data, socks)
                self._expire()
        finally:
            for incoming in list(self.pending.values()):
                self._close(incoming)
            self.selector.close()

    def _next_timeout(self) -> float:
        now = time.monotonic()
        if now >= self.deadline:
            missing = ", ".join(map(str, sorted(self.expected)))
            summary = self.rejections.summary()
            raise TimeoutError(
                f"rank {self.rank}: ranks {missing} never connected"
                + (f"; this rank {summary}, see the warnings" if summary else "")
            )
        oldest = next(iter(self.pending.values()), None)
        return min(self.deadline, oldest.deadline if oldest else self.deadline) - now

    def _expire(self) -> None:
        now = time.monotonic()
        while self.pending:
            oldest = next(iter(self.pending.values()))
            if oldest.deadline > now:
                return
            self._reject(oldest, "handshake timed out", f"not done within {_HANDSHAKE_SECONDS:g} s")

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of descriptors: free one, or pause; never spin
                self.rejections.reject("accept failed", "a new peer", str(exc))
                if self.pending:
                    self._reject(next(iter(self.pending.values())), "accept failed", "made room")
                else:
                    time.sleep(0.05)
                return
            if len(self.pending) >= self.max_pending:
                oldest = next(iter(self.pending.values()))
                self._reject(oldest, "too many unfinished handshakes", "dropped the oldest")
            incoming = _Incoming(
                sock,
                f"{addr[0]}:{addr[1]}",
                min(self.deadline, time.monotonic() + _HANDSHAKE_SECONDS),
            )
            sock.setblocking(False)
            self.pending[sock] = incoming
            self.selector.register(sock, selectors.EVENT_READ, incoming)

    def _need(self, incoming: _Incoming) -> int:
        """How many bytes the current handshake step takes (never more is read)."""
        if incoming.auth is not None:
            return ANSWER_BYTES + HELLO.size
        if len(incoming.inbuf) < len(_AUTH_GREETING) or incoming.inbuf == _AUTH_GREETING:
            return len(_AUTH_GREETING)
        return HELLO.size

    def _on_readable(self, incoming: _Incoming, socks: dict[int, socket.socket]) -> None:
        while incoming.sock in self.pending:
            try:
                chunk = incoming.sock.recv(self._need(incoming) - len(incoming.inbuf))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._reject(incoming, "connection failed", str(exc))
                return
            if not chunk:
                cause = "no answer" if incoming.auth is not None else "closed during handshake"
                self._reject(incoming, cause, "the peer hung up")
                return
            incoming.inbuf += chunk
            if len(incoming.inbuf) == self._need(incoming):
                self._step(incoming, socks)

    def _step(self, incoming: _Incoming, socks: dict[int, socket.socket]) -> None:
        """Act on a complete message: a greeting, a plain HELLO, or an answer and HELLO."""
        data = bytes(incoming.inbuf)
        incoming.inbuf.clear()
        if incoming.auth is not None:
            proof = incoming.auth.check(data[:ANSWER_BYTES])
            if proof is None:
                self._refuse(incoming, REJECTED, "wrong or replayed secret")
            else:
                self._welcome(incoming, data[ANSWER_BYTES:], proof, socks)
        elif data == _AUTH_GREETING and self.secret is not None:
            incoming.auth = ServerHandshake(self.secret, _CONTEXT)
            self._send(incoming, _AUTH_GREETING + incoming.auth.nonce)
        elif data == _AUTH_GREETING:
            self._refuse(incoming, _NO_AUTH, "unexpected secret")
        elif self.secret is not None:
            self._refuse(incoming, _AUTH_GREETING + bytes(NONCE_BYTES), "no secret")
        else:
            self._welcome(incoming, data, b"", socks)

    def _welcome(
        self, incoming: _Incoming, hello: bytes, proof: bytes, socks: dict[int, socket.socket]
    ) -> None:
        """Keep the connection if its HELLO names a rank we wait for; answer with ours."""
        try:
            peer = _check_hello(hello, self.world_size, self.token)
        except ConnectionError as exc:
            self._reject(incoming, "protocol error", str(exc))
            return
        if peer not in self.expected:
            self._reject(incoming, "unexpected rank", f"rank {peer} is not awaited here")
            return
        if not self._send(incoming, proof + _hello(self.rank, self.world_size, self.token)):
            return
        self.pending.pop(incoming.sock)
        self.selector.unregister(incoming.sock)
        incoming.sock.setblocking(True)
        _tune(incoming.sock)  # as the dialer's side: without TCP_NODELAY, 40 ms stalls
        self.expected.discard(peer)
        socks[peer] = incoming.sock

    def _send(self, incoming: _Incoming, data: bytes) -> bool:
        """Send a handshake message whole (it fits any socket buffer); False if it failed."""
        try:
            sent = incoming.sock.send(data)
        except OSError as exc:
            self._reject(incoming, "connection failed", str(exc))
            return False
        if sent != len(data):
            self._reject(incoming, "connection failed", "the peer does not read")
            return False
        return True

    def _refuse(self, incoming: _Incoming, reply: bytes, cause: str) -> None:
        """Tell the peer why (it can tell its user which side lacks the secret), then drop it."""
        details = {
            "wrong or replayed secret": "its answer did not prove the secret",
            "unexpected secret": "the peer authenticates; this rank has no secret",
            "no secret": "the peer does not authenticate; this rank does",
        }
        try:
            incoming.sock.send(reply)
        except OSError:
            pass  # it is being dropped anyway
        self._reject(incoming, cause, details[cause])

    def _reject(self, incoming: _Incoming, cause: str, detail: str) -> None:
        self.rejections.reject(cause, incoming.peer, detail)
        self._close(incoming)

    def _close(self, incoming: _Incoming) -> None:
        if self.pending.pop(incoming.sock, None) is not None:
            self.selector.unregister(incoming.sock)
        incoming.sock.close()
