"""The mesh: one authenticated TCP connection between every pair of ranks, built once.

Theory of operation. ``connect_mesh`` runs on every rank at init: the rank listens, publishes
its address through the rendezvous store, connects to every lower rank and accepts every
higher one. Each connection opens with a HELLO (magic, version, rank, world size, job token)
that the acceptor checks and echoes; anything else is dropped. With a shared secret an HMAC
challenge-response comes first (the notes below, and auth.py). The sockets it returns are
handed to ``TcpTransport`` (tcp.py), which knows nothing of how they were made.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import struct
import time
from dataclasses import dataclass

from ..auth import (
    ANSWER_BYTES,
    FROM_ENV,
    NONCE_BYTES,
    PROOF_BYTES,
    REJECTED,
    ClientHandshake,
    RejectionLog,
    Secret,
    SecretArg,
    ServerHandshake,
    resolve_secret,
    warn_if_exposed,
)
from ..envvars import env_number
from ..errors import ranks_phrase
from .frame import VERSION
from .listener import (
    ADMIT,
    CHALLENGE,
    Greetings,
    Listener,
    answer_greeting,
    host_port,
    needs_secret,
    recv_exact,
    refusal_detail,
    unexpected_secret,
)

__all__ = ["HELLO", "connect_mesh"]

log = logging.getLogger("asyncreduce.transport")

HELLO = struct.Struct("<4sBII16s")
_HELLO_MAGIC = b"ARDH"
_SOCKET_BUFFER = 4 << 20
_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # linux/tcp.h
#: Bytes not yet sent that the kernel may hold per connection (ASYNCREDUCE_NOTSENT_KIB, 0: no
#: limit). Frames leave by priority only while they are ours: with SO_SNDBUF's 8 MiB in the
#: kernel, a layer's small urgent allreduce waited behind up to 67 ms of bulk per hop at 1 Gbit
#: (forward mode hid 80% of its communication at K=4, ratio 1.0; 99% with this, docs/scaling.md).
NOT_SENT_BYTES = 256 << 10

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
# handshakes at once under the rules of listener.py: each is dropped if not done within
# _HANDSHAKE_SECONDS, at most _MAX_PENDING unfinished ones are kept beyond the ranks it waits
# for, and the first drop of each cause is logged at WARNING, later ones at DEBUG.

_AUTH_GREETING = b"ARDHAUTH"  # a dialer that authenticates opens with this instead of a HELLO
_NO_AUTH = b"ARDHNONE"  # what an acceptor without a secret answers a dialer that authenticates
_CONTEXT = b"asyncreduce data v1"  # what the HMAC proofs of this protocol are bound to
_GREETINGS = Greetings(_AUTH_GREETING, _NO_AUTH, _CONTEXT, client="peer", server="rank")
_HANDSHAKE_SECONDS = 5.0
_MAX_PENDING = 128


def _tune(sock: socket.socket, lowat: int) -> None:
    """TCP_NODELAY, large buffers, and at most ``lowat`` bytes unsent in the kernel (0: no
    limit; see ``not_sent_bytes``)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
    if lowat:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, lowat)


def not_sent_bytes() -> int:
    """The kernel's share of a connection's unsent frames (``NOT_SENT_BYTES``, or
    ASYNCREDUCE_NOTSENT_KIB KiB; 0: as much as SO_SNDBUF holds)."""
    return env_number("ASYNCREDUCE_NOTSENT_KIB", NOT_SENT_BYTES >> 10, int, 0) << 10


def _hello(rank: int, world_size: int, token: bytes) -> bytes:
    return HELLO.pack(_HELLO_MAGIC, VERSION, rank, world_size, token)


def _check_hello(data: bytes, world_size: int, token: bytes) -> int:
    """The rank a HELLO claims, after checking that it comes from a rank of this job."""
    magic, version, rank, size, their_token = HELLO.unpack(data)
    if magic != _HELLO_MAGIC:
        raise ConnectionError("not an asyncreduce peer")
    if version != VERSION:
        raise ConnectionError(
            f"a peer speaks protocol version {version}, this rank {VERSION}: every rank must "
            "run the same asyncreduce"
        )
    if size != world_size or their_token != token or not 0 <= rank < world_size:
        raise ConnectionError(f"peer claims rank {rank} of {size} in another job")
    return int(rank)


@dataclass(frozen=True)
class _Job:
    """What every connection of one rank's mesh is made with, dialled or accepted."""

    rank: int
    world_size: int
    token: bytes
    deadline: float
    secret: Secret | None
    lowat: int  # see not_sent_bytes

    def hello(self) -> bytes:
        return _hello(self.rank, self.world_size, self.token)

    def peer_of(self, hello: bytes) -> int:
        """The rank a peer's HELLO claims, checked against this job."""
        return _check_hello(hello, self.world_size, self.token)


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
    # ASYNCREDUCE_NOTSENT_KIB read once, and refused before any connection exists
    job = _Job(rank, world_size, token, deadline, key, not_sent_bytes())
    host, port = listener.getsockname()[:2]
    warn_if_exposed(str(host), int(port), f"data listener of rank {rank}", key)
    socks: dict[int, socket.socket] = {}
    try:
        for peer in range(rank):
            socks[peer] = _dial(job, peer, addresses[peer])
        _Acceptor(job, listener).run(socks)
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    return socks


def _dial(job: _Job, peer: int, address: tuple[str, int]) -> socket.socket:
    """A connection to ``peer``, handshake done; retried while the peer refuses or hangs up."""
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            _tune(sock, job.lowat)
            sock.settimeout(max(0.001, job.deadline - time.monotonic()))
            sock.connect(address)
            if job.peer_of(_handshake_out(sock, job, peer, address)) != peer:
                raise ConnectionError(f"{host_port(*address)} is not rank {peer}")
            return sock
        except (ConnectionRefusedError, ConnectionResetError, TimeoutError) as exc:
            sock.close()
            retry = not isinstance(exc, TimeoutError) and time.monotonic() < job.deadline
            if not retry:
                why = f"rank {job.rank} could not connect to rank {peer} at {host_port(*address)}"
                raise TimeoutError(why) from exc
            time.sleep(0.05)
        except BaseException:
            sock.close()
            raise


def _handshake_out(sock: socket.socket, job: _Job, peer: int, address: tuple[str, int]) -> bytes:
    """The dialer's side of the handshake; returns the acceptor's HELLO, not yet checked."""
    who, me = f"rank {peer} at {host_port(*address)}", f"rank {job.rank}"
    deadline = job.deadline
    if job.secret is None:
        sock.sendall(job.hello())
        reply = recv_exact(sock, HELLO.size, deadline, who)
        if reply.startswith(_AUTH_GREETING):
            raise needs_secret(who, me)
        return reply
    sock.sendall(_AUTH_GREETING)
    greeting = recv_exact(sock, len(_AUTH_GREETING), deadline, who)
    if greeting == _NO_AUTH:
        raise unexpected_secret(who, me)
    if greeting != _AUTH_GREETING:
        raise ConnectionError(f"{who} is not an asyncreduce peer (it answered {greeting!r})")
    handshake = ClientHandshake(job.secret, _CONTEXT)
    answer = handshake.answer(recv_exact(sock, NONCE_BYTES, deadline, who))
    sock.sendall(answer + job.hello())
    handshake.check(recv_exact(sock, PROOF_BYTES, deadline, who), who)
    return recv_exact(sock, HELLO.size, deadline, who)


class _Incoming:
    """An accepted connection whose handshake is not done: what it sent so far."""

    __slots__ = ("sock", "peer", "inbuf", "auth")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()
        self.auth: ServerHandshake | None = None  # set once it asked to authenticate


class _Acceptor:
    """The accepting half of connect_mesh: every handshake at once, each under its deadline."""

    def __init__(self, job: _Job, listener: socket.socket) -> None:
        self.job = job
        self.deadline = job.deadline
        self.expected = set(range(job.rank + 1, job.world_size))
        self.rejections = RejectionLog(log, f"rank {job.rank}")
        self.selector = selectors.DefaultSelector()
        self.listener: Listener[_Incoming] | None = None
        if self.expected:
            self.listener = Listener(
                listener, self.selector, self.rejections, _Incoming, self._reject,
                handshake_seconds=_HANDSHAKE_SECONDS,
                max_pending=_MAX_PENDING + len(self.expected),
            )  # fmt: skip

    def run(self, socks: dict[int, socket.socket]) -> None:
        """Accept until every higher rank is in ``socks``; TimeoutError at the deadline."""
        try:
            while self.listener is not None and self.expected:
                for key, _ in self.selector.select(self._next_timeout(self.listener)):
                    if key.data is self.listener:
                        self.listener.accept(self.deadline)
                    else:
                        self._on_readable(key.data, socks)
                self.listener.on_clock()
        finally:
            for incoming in self.listener.unfinished() if self.listener else []:
                self._close(incoming)
            self.selector.close()

    def _next_timeout(self, listener: Listener[_Incoming]) -> float | None:
        if time.monotonic() >= self.deadline:
            summary = self.rejections.summary()
            raise TimeoutError(
                f"rank {self.job.rank}: {ranks_phrase(self.expected)} never connected"
                + (f"; this rank {summary}, see the warnings" if summary else "")
            )
        return listener.timeout(self.deadline)

    def _pending(self, incoming: _Incoming) -> bool:
        return self.listener is not None and self.listener.is_pending(incoming)

    def _need(self, incoming: _Incoming) -> int:
        """How many bytes the current handshake step takes (never more is read)."""
        if incoming.auth is not None:
            return ANSWER_BYTES + HELLO.size
        if len(incoming.inbuf) < len(_AUTH_GREETING) or incoming.inbuf == _AUTH_GREETING:
            return len(_AUTH_GREETING)
        return HELLO.size

    def _on_readable(self, incoming: _Incoming, socks: dict[int, socket.socket]) -> None:
        while self._pending(incoming):
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
            return
        verdict, reply, incoming.auth = answer_greeting(
            _GREETINGS, data == _AUTH_GREETING, self.job.secret
        )
        if verdict == ADMIT:  # no secret on either side: ``data`` is the HELLO
            self._welcome(incoming, data, b"", socks)
        elif verdict == CHALLENGE:
            self._send(incoming, reply)
        else:
            self._refuse(incoming, reply, verdict)

    def _welcome(
        self, incoming: _Incoming, hello: bytes, proof: bytes, socks: dict[int, socket.socket]
    ) -> None:
        """Keep the connection if its HELLO names a rank we wait for; answer with ours."""
        try:
            peer = self.job.peer_of(hello)
        except ConnectionError as exc:
            self._reject(incoming, "protocol error", str(exc))
            return
        if peer not in self.expected:
            self._reject(incoming, "unexpected rank", f"rank {peer} is not awaited here")
            return
        if not self._send(incoming, proof + self.job.hello()):
            return
        assert self.listener is not None
        self.listener.finished(incoming)
        self.selector.unregister(incoming.sock)
        incoming.sock.setblocking(True)
        _tune(incoming.sock, self.job.lowat)  # as dialled ones: without TCP_NODELAY, 40 ms stalls
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
        try:
            incoming.sock.send(reply)
        except OSError:
            pass  # it is being dropped anyway
        self._reject(incoming, cause, refusal_detail(_GREETINGS, cause))

    def _reject(self, incoming: _Incoming, cause: str, detail: str) -> None:
        self.rejections.reject(cause, incoming.peer, detail)
        self._close(incoming)

    def _close(self, incoming: _Incoming) -> None:
        if self._pending(incoming):
            assert self.listener is not None
            self.listener.finished(incoming)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(incoming.sock)
        incoming.sock.close()
