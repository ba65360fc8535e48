"""The authenticated listener: how a server admits connections it cannot trust yet.

Theory of operation. Two servers accept connections from the network: the rendezvous store
(rendezvous/server.py) and every rank's data listener while the mesh is built (mesh.py). Both
follow the same rules, and this module is where they are enforced:

* A connection opens with a greeting: a client that authenticates sends its protocol's
  ``auth`` greeting, any other opening means it does not. ``answer_greeting`` is the table of
  what a server says back: a challenge (auth.py) when both sides authenticate, admission when
  neither does, and otherwise the server's own greeting followed by a hang-up, so the client
  can tell which side lacks the secret (``needs_secret`` / ``unexpected_secret`` word the
  client's AuthenticationError the same way for both protocols).
* ``Listener`` keeps the handshakes that are not done yet in bounds: each must finish within
  ``handshake_seconds`` of its accept, at most ``max_pending`` are kept at once (one more
  drops the oldest), and a failing ``accept`` (out of descriptors) drops the oldest one and
  pauses accepting for ``_ACCEPT_PAUSE`` instead of spinning. Every drop goes to the
  protocol's ``reject`` (which logs it through auth.RejectionLog and closes the socket).
  A silent or slow connection thus holds up nobody, and a flood costs bounded memory.
* Every blocking read of a handshake has a deadline (``recv_exact``), and a thread's selector
  loop is woken from another thread by one byte on a socket pair (``WakeUp``).
* On this host the other end of a connection must belong to this user: loopback (and this
  host's own address) is open to every user of the host, and without a secret nothing else
  tells a rank from another user's process on a port it took first. ``owner.other_user``
  asks the kernel who owns the other end, once per connection; the listener drops a
  connection of another user, or one whose socket no process holds any more (cause "another
  user"), and a client refuses a server of another user (``owner.check_peer_user``). Across
  hosts nobody can tell: only a secret helps there.

The numbers (how long, how many) are each protocol's own; the rules are these.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..auth import NONCE_BYTES, AuthenticationError, RejectionLog, Secret, ServerHandshake
from .owner import other_user

__all__ = [
    "ADMIT",
    "CHALLENGE",
    "Greetings",
    "Listener",
    "WakeUp",
    "answer_greeting",
    "host_port",
    "needs_secret",
    "recv_exact",
    "refusal_detail",
    "unexpected_secret",
]

_ACCEPT_PAUSE = 0.1  # seconds without accepting after accept() fails (e.g. out of descriptors)
_HOW_TO_SET = "ASYNCREDUCE_SECRET (or ASYNCREDUCE_SECRET_FILE)"

ADMIT, CHALLENGE = "admit", "challenge"  # answer_greeting's verdicts besides a refusal


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---- greetings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Greetings:
    """One protocol's greetings. ``auth``: what a client that authenticates opens with, and
    what the server's challenge starts with; ``no_auth``: what a server without a secret
    answers such a client; ``context``: what the protocol's HMAC proofs are bound to;
    ``client`` and ``server``: what the refusal details call the two sides."""

    auth: bytes
    no_auth: bytes
    context: bytes
    client: str
    server: str


def answer_greeting(
    greetings: Greetings, authenticates: bool, secret: Secret | None
) -> tuple[str, bytes, ServerHandshake | None]:
    """(verdict, reply, handshake) for a client's greeting. The verdict is ADMIT (nothing to
    send yet; the protocol answers as it admits), CHALLENGE (send ``reply``, then check the
    client's answer with ``handshake``), or the cause of a refusal (send ``reply``, then drop
    the connection)."""
    if authenticates and secret is not None:
        handshake = ServerHandshake(secret, greetings.context)
        return CHALLENGE, greetings.auth + handshake.nonce, handshake
    if authenticates:
        return "unexpected secret", greetings.no_auth, None
    if secret is not None:
        return "no secret", greetings.auth + bytes(NONCE_BYTES), None
    return ADMIT, b"", None


def refusal_detail(greetings: Greetings, cause: str) -> str:
    """What the log says about a refused handshake (the cause is its headline)."""
    client, server = greetings.client, greetings.server
    return {
        "wrong or replayed secret": "its answer did not prove the secret",
        "unexpected secret": f"the {client} authenticates; this {server} has no secret",
        "no secret": f"the {client} does not authenticate; this {server} does",
    }[cause]


def needs_secret(who: str, me: str) -> AuthenticationError:
    """The client's error when ``who`` authenticates and ``me`` has no secret."""
    return AuthenticationError(
        f"{who} requires authentication, but {me} has no secret: set {_HOW_TO_SET} to the "
        "job's secret"
    )


def unexpected_secret(who: str, me: str) -> AuthenticationError:
    """The client's error when ``me`` has a secret and ``who`` does not authenticate."""
    return AuthenticationError(
        f"{who} does not authenticate, but {me} has a secret (ASYNCREDUCE_SECRET or "
        "ASYNCREDUCE_SECRET_FILE): set the same secret on every rank, or on none"
    )


def recv_exact(sock: socket.socket, count: int, deadline: float, who: str) -> bytes:
    """Exactly ``count`` bytes from a blocking socket before ``deadline`` (TimeoutError), or
    ConnectionResetError if ``who`` closes the connection first."""
    buf = bytearray(count)
    view = memoryview(buf)
    got = 0
    while got < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no answer from {who} in time")
        sock.settimeout(remaining)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError(f"{who} closed the connection")
        got += n
    return bytes(buf)


# ---- admitting connections ---------------------------------------------------------------------

C = TypeVar("C", bound=Hashable)


class Listener(Generic[C]):
    """Accepts on ``sock`` (registered in ``selector`` with the Listener as its data) and keeps
    the handshakes not yet done within their limits (see the module docstring).

    ``welcome(sock, peer)`` makes the protocol's object for a new connection, which the
    Listener registers for reading; ``reject(conn, cause, detail)`` drops one. The protocol
    calls ``finished(conn)`` once a handshake is done (or the connection gone otherwise).
    """

    def __init__(
        self,
        sock: socket.socket,
        selector: selectors.BaseSelector,
        rejections: RejectionLog,
        welcome: Callable[[socket.socket, str], C],
        reject: Callable[[C, str, str], None],
        *,
        handshake_seconds: float,
        max_pending: int,
    ) -> None:
        self.sock = sock
        self.selector = selector
        self.rejections = rejections
        self.handshake_seconds = handshake_seconds
        self.max_pending = max_pending
        self._welcome = welcome
        self._reject = reject
        self._pending: dict[C, float] = {}  # handshake not done -> its deadline; oldest first
        self._paused_until: float | None = None
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, self)

    def accept(self, until: float = float("inf")) -> None:
        """Accept every connection waiting; none gets a deadline past ``until``."""
        while self._paused_until is None:
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of descriptors: free one, pause; never spin
                self._on_accept_failed(exc)
                return
            peer = host_port(str(addr[0]), int(addr[1]))
            other = other_user(sock, held=True)
            if other is not None:
                self.rejections.reject("another user", peer, f"its end belongs to {other}")
                sock.close()
                continue
            if len(self._pending) >= self.max_pending:
                self._reject(self.oldest(), "too many unfinished handshakes", "dropped the oldest")
            sock.setblocking(False)
            conn = self._welcome(sock, peer)
            deadline = min(until, time.monotonic() + self.handshake_seconds)
            self._pending[conn] = deadline
            self.selector.register(sock, selectors.EVENT_READ, conn)

    def _on_accept_failed(self, exc: OSError) -> None:
        self.rejections.reject("accept failed", "a new connection", str(exc))
        if self._pending:
            self._reject(self.oldest(), "accept failed", "made room")
        self.selector.unregister(self.sock)
        self._paused_until = time.monotonic() + _ACCEPT_PAUSE

    def oldest(self) -> C:
        return next(iter(self._pending))

    def is_pending(self, conn: C) -> bool:
        return conn in self._pending

    def finished(self, conn: C) -> None:
        """``conn``'s handshake is done (or it is gone): its deadline no longer applies."""
        self._pending.pop(conn, None)

    def unfinished(self) -> list[C]:
        return list(self._pending)

    def timeout(self, until: float | None = None) -> float | None:
        """Seconds until the next deadline (a handshake's, the end of a pause, or ``until``);
        None when there is none."""
        oldest = next(iter(self._pending.values()), None)
        times = [] if oldest is None else [oldest]
        if self._paused_until is not None:
            times.append(self._paused_until)
        if until is not None:
            times.append(until)
        return max(0.0, min(times) - time.monotonic()) if times else None

    def on_clock(self) -> None:
        """Drop the handshakes past their deadline; accept again after a pause."""
        now = time.monotonic()
        while self._pending:
            conn, deadline = next(iter(self._pending.items()))
            if deadline > now:
                break
            self._pending.pop(conn)
            self._reject(
                conn, "handshake timed out", f"not done within {self.handshake_seconds:g} s"
            )
        if self._paused_until is not None and now >= self._paused_until:
            self._paused_until = None
            self.selector.register(self.sock, selectors.EVENT_READ, self)


class WakeUp:
    """One byte on a socket pair: makes a selector loop in another thread return soon."""

    def __init__(self) -> None:
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)

    def wake(self) -> None:
        """Safe from any thread; a wake-up already pending (a full pair) is enough."""
        try:
            self._writer.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already pending, or closing

    def drain(self) -> None:
        """Take every pending wake-up (the loop's thread, when the reader is readable)."""
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while self.reader.recv(4096):
                pass

    def close(self) -> None:
        self.reader.close()
        self._writer.close()
