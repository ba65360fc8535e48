"""The mesh: one authenticated TCP connection between every pair of ranks, built once.

Theory of operation. ``connect_mesh`` runs on every rank at init: the rank listens, publishes
its address through the rendezvous store, connects to every lower rank and accepts every
higher one. Each connection opens with a HELLO (magic, version, rank, world size, job token)
that the acceptor checks and echoes; anything else is dropped. With a shared secret an HMAC
challenge-response comes first (the notes below, and auth.py). The sockets it returns are
handed to ``TcpTransport`` (tcp.py), which knows nothing of how they were made.
"""

from __future__ import annotations

import logging
import selectors
import socket
import struct
import time

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

__all__ = ["HELLO", "connect_mesh"]

log = logging.getLogger("asyncreduce.transport")

HELLO = struct.Struct("<4sBII16s")
_HELLO_MAGIC = b"ARDH"
_SOCKET_BUFFER = 4 << 20

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
