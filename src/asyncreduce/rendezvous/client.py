"""The TCP store's client: pooled connections, thread-safe, every wait under a deadline.

Theory of operation. Each request and its response own one connection for their duration,
taken from a pool of idle ones (a new connection when none is idle), so a thread parked in
``get`` never holds up another thread's ``set`` on the same client. Deadlines are socket
timeouts; a request that gives up closes its connection, so a late answer is never read as the
answer to another request. A lost connection breaks the client (BrokenError from then on).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence

from ..auth import NONCE_BYTES, PROOF_BYTES, ClientHandshake, Secret
from ..errors import BrokenError, ClosedError, UsageError
from ..transport.listener import host_port, needs_secret, recv_exact, unexpected_secret
from ..transport.owner import check_peer_user
from .wire import (
    _CONTEXT,
    _ERR,
    _MAGIC,
    _MAGIC_AUTH,
    _OK,
    _U32,
    _decode_fields,
    _encode_frame,
    _frame_length,
    _ProtocolError,
)

_STORE = "the store"  # who closed the connection, in messages


class _WrongPeer(Exception):
    """Something answered on the store's port, but not with our greeting."""


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(remaining)
    sock.sendall(data)


def _read_frame(sock: socket.socket, deadline: float) -> tuple[int, list[bytes]]:
    length = _frame_length(recv_exact(sock, _U32.size, deadline, _STORE))
    body = memoryview(recv_exact(sock, length, deadline, _STORE))
    return body[0], _decode_fields(body[1:])


def _greet(sock: socket.socket, deadline: float, secret: Secret | None, where: str) -> None:
    """Open a connection: the plain greeting, or the greeting and the challenge-response."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _send_all(sock, _MAGIC if secret is None else _MAGIC_AUTH, deadline)
    answer = recv_exact(sock, len(_MAGIC), deadline, _STORE)
    if answer == _MAGIC_AUTH and secret is None:
        raise needs_secret(f"the store at {where}", "this rank")
    if answer == _MAGIC and secret is not None:
        raise unexpected_secret(f"the store at {where}", "this rank")
    if answer not in (_MAGIC, _MAGIC_AUTH):
        raise _WrongPeer(answer)
    if secret is not None:
        handshake = ClientHandshake(secret, _CONTEXT)
        _send_all(sock, handshake.answer(recv_exact(sock, NONCE_BYTES, deadline, _STORE)), deadline)
        handshake.check(recv_exact(sock, PROOF_BYTES, deadline, _STORE), f"the store at {where}")


def _connect(host: str, port: int, timeout: float, secret: Secret | None) -> socket.socket:
    """A greeted (and authenticated) connection to the store, retrying until ``timeout``.

    Retries because the server may start later; an AuthenticationError is not retried, nor
    a server of another user of this host (UsageError naming its uid: transport/listener.py).
    """
    deadline = time.monotonic() + timeout
    delay = 0.01
    last: OSError | None = None
    where = host_port(host, port)
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            sock = socket.create_connection((host, port), timeout=min(remaining, 5.0))
        except OSError as exc:
            last = exc
        else:
            try:
                check_peer_user(sock, f"the store at {where}")  # before a byte is sent to it
                _greet(sock, deadline, secret, where)
                return sock
            except _WrongPeer as exc:
                sock.close()
                raise UsageError(
                    f"the service at {where} is not an asyncreduce store "
                    f"(it answered {exc.args[0]!r}); is MASTER_PORT right?"
                ) from None
            except OSError as exc:
                sock.close()
                last = exc
            except BaseException:
                sock.close()
                raise
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(delay * 2, 0.5)
    raise TimeoutError(
        f"could not reach the store at {where} within {timeout:g} s "
        "(is rank 0 running? is MASTER_ADDR/MASTER_PORT right?)"
    ) from last


class _Client:
    """Connections to the store server, thread-safe.

    Each request and its response own one connection for their duration, taken from a pool
    of idle ones (a new connection when none is idle), so a thread parked in ``get`` never
    holds up another thread's ``set`` on the same client.
    """

    def __init__(self, host: str, port: int, timeout: float, secret: Secret | None) -> None:
        self._host = host
        self._port = port
        self._timeout = timeout
        self._secret = secret
        self._lock = threading.Lock()  # guards the pool and the flags below
        self._idle: list[socket.socket] = [_connect(host, port, timeout, secret)]
        self._busy: set[socket.socket] = set()
        self._broken: BaseException | None = None
        self._closed = False

    def request(
        self, op: int, fields: Sequence[bytes], timeout: float, on_timeout: str
    ) -> list[bytes]:
        frame = _encode_frame(op, fields)
        sock = self._checkout()
        deadline = time.monotonic() + timeout
        try:
            _send_all(sock, frame, deadline)
            status, reply = _read_frame(sock, deadline)
        except TimeoutError:
            self._retire(sock)  # a late answer must not meet the next request
            raise TimeoutError(on_timeout) from None
        except (OSError, _ProtocolError) as exc:
            self._retire(sock)
            raise self._failure(exc) from exc
        self._checkin(sock)
        if status == _ERR:
            raise UsageError(b"".join(reply).decode("utf-8", "replace"))
        if status != _OK:
            raise BrokenError(f"the store at {self._where()} answered with status {status}")
        return reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for sock in idle:
            sock.close()
        for sock in busy:  # wake the thread blocked on it; that thread closes it
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _where(self) -> str:
        return host_port(self._host, self._port)

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedError("the store was closed")
        if self._broken is not None:
            raise BrokenError(f"the connection to the store at {self._where()} was lost")

    def _checkout(self) -> socket.socket:
        with self._lock:
            self._check_usable()
            if self._idle:
                sock = self._idle.pop()
                self._busy.add(sock)
                return sock
        sock = _connect(self._host, self._port, self._timeout, self._secret)
        with self._lock:
            if self._closed:
                sock.close()
                raise ClosedError("the store was closed")
            self._busy.add(sock)
        return sock

    def _checkin(self, sock: socket.socket) -> None:
        with self._lock:
            self._busy.discard(sock)
            if self._closed or self._broken is not None:
                sock.close()
            else:
                self._idle.append(sock)

    def _retire(self, sock: socket.socket) -> None:
        with self._lock:
            self._busy.discard(sock)
        sock.close()

    def _failure(self, exc: BaseException) -> Exception:
        with self._lock:
            if self._closed:
                return ClosedError("the store was closed")
            self._broken = exc
        return BrokenError(f"lost the connection to the store at {self._where()}: {exc}")
