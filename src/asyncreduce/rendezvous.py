"""How ranks find each other: a small key-value store shared by every rank of a job.

Theory of operation
-------------------
Before any connection between ranks exists, each rank must learn where the others listen.
Rank 0 serves a :class:`TCPStore`; every rank (rank 0 included) holds one client connection
to it. :func:`gather` is the only collective built on the store: each rank publishes a value
under ``prefix/rank`` and waits for everyone else's. A :class:`FileStore` offers the same
through a directory that every rank sees, for jobs that cannot open a port on rank 0.

The TCP server is one daemon thread ("asyncreduce-store") running a ``selectors`` loop over
non-blocking sockets; it owns all the store's state, so it needs no locks. A ``get`` for a key
not yet set parks its connection on a waiters list until a ``set`` or ``add`` creates the key.
The client enforces deadlines with socket timeouts; when it gives up it closes that connection,
so a late answer is never read as the answer to another request. Clients are thread-safe: a
request and its response own one pooled connection, so a thread parked in ``get`` does not
hold up another thread's ``set`` on the same client.

Wire protocol (integers big-endian). Without a secret, a client opens with the 8 bytes
``ARSTORE1`` and the server echoes them. With a secret (see auth.py) the client opens with
``ARSTOREA`` instead; the server answers ``ARSTOREA`` and its nonce, and the HMAC
challenge-response runs before any frame is read (one extra round trip per connection). A
server that gets the other greeting than the one it expects answers with its own and hangs up,
so the client can say which side lacks the secret. The server reads at most 72 bytes from a
connection before its handshake is done, and drops one that has not finished it within
``_HANDSHAKE_SECONDS`` (at most ``_MAX_PENDING`` unfinished handshakes are kept: the oldest
goes first). Then every request and every response is a frame::

    u32 length | u8 tag | field* ,   field = u32 length | bytes

A request's tag is its command (SET key value, GET key, ADD key i64, CHECK key*, DELETE key);
a response's tag is 0 (ok, with the result fields) or 1 (error, with a message). The server
checks every length against a bound (keys 4096 bytes, values 64 MiB) before buffering it, and
drops a connection that breaks the protocol (the first event of each cause is logged at
WARNING, later ones at DEBUG); other connections are unaffected. Nothing received is ever
unpickled or evaluated: keys and values are opaque bytes.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import hashlib
import itertools
import logging
import os
import selectors
import socket
import struct
import threading
import time
import urllib.parse
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import TypeVar

from asyncreduce.auth import (
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
from asyncreduce.errors import BrokenError, ClosedError, UsageError

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "FileStore",
    "PrefixStore",
    "Store",
    "TCPStore",
    "gather",
    "store_from_env_or_args",
]

_log = logging.getLogger("asyncreduce.rendezvous")

MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 << 20

_MAGIC = b"ARSTORE1"  # the plain greeting (no secret)
_MAGIC_AUTH = b"ARSTOREA"  # the greeting of a client that authenticates
_CONTEXT = b"asyncreduce store v1"  # what the HMAC proofs of this protocol are bound to
_HANDSHAKE_BYTES = len(_MAGIC) + ANSWER_BYTES  # the most a server buffers before the handshake
_HANDSHAKE_SECONDS = 10.0  # an unfinished handshake is dropped after this long
_MAX_PENDING = 256  # unfinished handshakes kept at once; the oldest goes when one more arrives
_ACCEPT_PAUSE = 0.1  # seconds without accepting after accept() fails (e.g. out of descriptors)
_U32 = struct.Struct("!I")
_I64 = struct.Struct("!q")
_MAX_FRAME = 1 + 2 * _U32.size + MAX_KEY_BYTES + MAX_VALUE_BYTES
_MAX_FIELDS = 4096  # per frame; the client splits longer CHECK lists
_RECV_CHUNK = 256 * 1024
_MAX_BUFFERED = _U32.size + _MAX_FRAME + _RECV_CHUNK

_SET, _GET, _ADD, _CHECK, _DELETE = 1, 2, 3, 4, 5
_OK, _ERR = 0, 1

_S = TypeVar("_S", bound="Store")


class Store(abc.ABC):
    """A small key-value store shared by all ranks of a job. Keys are str, values bytes."""

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (replacing any old value) and wake its waiters."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Wait until ``key`` exists and return its value; ``TimeoutError`` after ``timeout``."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (missing = 0); return the new value."""

    @abc.abstractmethod
    def check(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists, without waiting."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release this store's resources; idempotent."""

    def _diagnosis(self) -> str:
        """What the store saw that may explain a rank missing a rendezvous ("" if nothing)."""
        return ""

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class PrefixStore(Store):
    """``store`` with every key under ``prefix``: several rendezvous in one shared store."""

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix = prefix
        self.store = store
        self.host = getattr(store, "host", None)  # where the store serves, for routing

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self.prefix + key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.store.get(self.prefix + key, timeout)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self.prefix + key, amount)

    def check(self, keys: Sequence[str]) -> list[bool]:
        return self.store.check([self.prefix + key for key in keys])

    def delete(self, key: str) -> None:
        self.store.delete(self.prefix + key)

    def close(self) -> None:
        """The shared store stays open: its owner closes it."""

    def _diagnosis(self) -> str:
        return self.store._diagnosis()


# ---------------------------------------------------------------- argument checks


def _key_bytes(key: str) -> bytes:
    if not isinstance(key, str):
        raise UsageError(f"store keys are str, got {type(key).__name__}")
    raw = key.encode("utf-8")
    if len(raw) > MAX_KEY_BYTES:
        raise UsageError(f"store key is {len(raw)} bytes long; the limit is {MAX_KEY_BYTES}")
    return raw


def _value_bytes(value: bytes) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise UsageError(f"store values are bytes, got {type(value).__name__}")
    raw = bytes(value)
    if len(raw) > MAX_VALUE_BYTES:
        raise UsageError(f"store value is {len(raw)} bytes long; the limit is {MAX_VALUE_BYTES}")
    return raw


def _check_amount(amount: int) -> None:
    if not isinstance(amount, int) or isinstance(amount, bool):
        raise UsageError(f"add() takes an int amount, got {type(amount).__name__}")
    if not -(2**63) <= amount < 2**63:
        raise UsageError(f"add() amount {amount} does not fit in 64 signed bits")


def _check_timeout(timeout: float) -> None:
    if not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
        raise UsageError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")


def _check_port(port: int, *, allow_zero: bool) -> None:
    low = 0 if allow_zero else 1
    if not isinstance(port, int) or isinstance(port, bool) or not low <= port <= 65535:
        raise UsageError(f"port must be an int in {low}..65535, got {port!r}")


def _check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise UsageError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise UsageError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")


def _counter_plus(label: str, current: bytes, amount: int) -> int:
    """The counter stored as ``current`` (decimal ASCII) plus ``amount``."""
    try:
        return int(current) + amount
    except ValueError:
        raise UsageError(f"store key {label} holds {current[:40]!r}, not a counter") from None


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------- framing


class _ProtocolError(Exception):
    """Bytes from the socket that break the wire protocol."""


def _encode_frame(tag: int, fields: Sequence[bytes]) -> bytes:
    parts = [bytes([tag])]
    for field in fields:
        parts += [_U32.pack(len(field)), field]
    body = b"".join(parts)
    return _U32.pack(len(body)) + body


def _frame_length(header: bytes | bytearray) -> int:
    (length,) = _U32.unpack_from(header)
    if not 1 <= length <= _MAX_FRAME:
        raise _ProtocolError(f"frame length {length} outside 1..{_MAX_FRAME}")
    return int(length)


def _decode_fields(body: memoryview) -> list[bytes]:
    fields: list[bytes] = []
    pos = 0
    while pos < len(body):
        if len(fields) == _MAX_FIELDS:
            raise _ProtocolError(f"more than {_MAX_FIELDS} fields in one frame")
        if len(body) - pos < _U32.size:
            raise _ProtocolError("frame ends inside a field length")
        (length,) = _U32.unpack_from(body, pos)
        pos += _U32.size
        if length > len(body) - pos:
            raise _ProtocolError(f"field of {length} bytes overruns its frame")
        fields.append(bytes(body[pos : pos + length]))
        pos += length
    return fields


def _expect(fields: list[bytes], count: int, what: str) -> list[bytes]:
    if len(fields) != count:
        raise _ProtocolError(f"{what} takes {count} fields, got {len(fields)}")
    return fields


def _valid_key(key: bytes) -> bytes:
    if len(key) > MAX_KEY_BYTES:
        raise _ProtocolError(f"key of {len(key)} bytes (limit {MAX_KEY_BYTES})")
    return key


# ---------------------------------------------------------------- server


_GREETING, _ANSWER, _READY = "greeting", "answer", "ready"  # where a connection's handshake is


class _Conn:
    """One client connection, as the server thread sees it."""

    __slots__ = (
        "sock", "peer", "inbuf", "outbuf", "state", "auth", "deadline", "waiting_for", "events",
        "closed",
    )  # fmt: skip

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.state = _GREETING
        self.auth: ServerHandshake | None = None
        self.deadline = deadline  # for the handshake only
        self.waiting_for: bytes | None = None  # key of a parked GET
        self.events = selectors.EVENT_READ
        self.closed = False


class _StoreServer:
    """The selector loop behind ``TCPStore(is_server=True)``; all state lives in its thread."""

    def __init__(self, host: str, port: int, secret: Secret | None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            raise UsageError(
                f"cannot serve the store on {_address(host, port)}: {exc} "
                "(is MASTER_PORT used by another job? is MASTER_ADDR an address of this host?)"
            ) from exc
        self.port: int = self._listener.getsockname()[1]
        warn_if_exposed(host, self.port, "rendezvous store", secret)
        self._secret = secret
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._data: dict[bytes, bytes] = {}
        self._waiters: dict[bytes, list[_Conn]] = {}
        self._conns: set[_Conn] = set()
        self._pending: dict[_Conn, None] = {}  # handshake not finished; oldest first
        self._accept_paused_until: float | None = None
        self._ready: deque[_Conn] = deque()
        self._handlers: dict[int, Callable[[_Conn, list[bytes]], None]] = {
            _SET: self._do_set,
            _GET: self._do_get,
            _ADD: self._do_add,
            _CHECK: self._do_check,
            _DELETE: self._do_delete,
        }
        self._stopping = False
        self.rejections = RejectionLog(_log, "store server")
        self._thread = threading.Thread(target=self._run, name="asyncreduce-store", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; it closes the listener and every connection on its way out."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():
            _log.error("store server thread did not stop within 10 s")
        self._wake_w.close()

    # -- the loop

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._selector.select(self._next_timeout()):
                    self._dispatch(key.data, mask)
                while self._ready and not self._stopping:
                    self._serve(self._ready.popleft())
                self._on_clock()
        finally:
            self._close_everything()

    def _next_timeout(self) -> float | None:
        """Seconds until the next handshake deadline or accept resumption (None: no timer)."""
        times = [conn.deadline for conn in itertools.islice(self._pending, 1)]
        if self._accept_paused_until is not None:
            times.append(self._accept_paused_until)
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _on_clock(self) -> None:
        """Drop handshakes past their deadline; accept again after a pause."""
        now = time.monotonic()
        while self._pending:
            conn = next(iter(self._pending))
            if conn.deadline > now:
                break
            limit = f"not finished within {_HANDSHAKE_SECONDS:g} s"
            self._reject(conn, "handshake timed out", limit)
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self._selector.register(self._listener, selectors.EVENT_READ, "listen")

    def _dispatch(self, data: object, mask: int) -> None:
        try:
            if data == "wake":
                with contextlib.suppress(OSError):
                    self._wake_r.recv(64)
            elif data == "listen":
                self._accept()
            elif isinstance(data, _Conn):
                self._on_conn_event(data, mask)
        except Exception:  # never let one event kill the server thread
            _log.exception("store server: unexpected error (the server keeps running)")
            if isinstance(data, _Conn):
                self._drop(data)

    def _close_everything(self) -> None:
        for conn in list(self._conns):
            self._drop(conn)
        self._selector.close()
        self._listener.close()
        self._wake_r.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: pause rather than spin
                self.rejections.reject("accept failed", "a new client", str(exc))
                self._selector.unregister(self._listener)
                self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE
                return
            if len(self._pending) >= _MAX_PENDING:
                oldest = next(iter(self._pending))
                self._reject(oldest, "too many unfinished handshakes", "dropped the oldest")
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = _address(str(addr[0]), int(addr[1]))
            conn = _Conn(sock, peer, time.monotonic() + _HANDSHAKE_SECONDS)
            self._conns.add(conn)
            self._pending[conn] = None
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _on_conn_event(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
            if not conn.outbuf:
                self._ready.append(conn)  # resume reading requests
        if mask & selectors.EVENT_READ and not conn.closed:
            self._receive(conn)

    def _receive(self, conn: _Conn) -> None:
        # Before its handshake is done a connection gets a few bytes of buffer, not megabytes.
        room = _RECV_CHUNK if conn.state == _READY else _HANDSHAKE_BYTES - len(conn.inbuf)
        if room <= 0:
            self._violation(conn, "sent more than the handshake before it finished")
            return
        try:
            chunk = conn.sock.recv(room)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client left; that is its right, unless it was asked to prove itself
            if conn.state == _ANSWER:
                self._reject(conn, "no answer", "left before answering the challenge")
            self._drop(conn)
            return
        conn.inbuf += chunk
        if len(conn.inbuf) > _MAX_BUFFERED:
            self._violation(conn, f"{len(conn.inbuf)} bytes sent without waiting for answers")
            return
        self._serve(conn)

    def _serve(self, conn: _Conn) -> None:
        try:
            self._parse(conn)
        except _ProtocolError as exc:
            self._violation(conn, str(exc))

    def _parse(self, conn: _Conn) -> None:
        """Execute the complete requests in ``conn.inbuf``, one answer in flight at a time."""
        while not conn.closed and conn.waiting_for is None and not conn.outbuf:
            if conn.state != _READY:
                if not self._handshake(conn):
                    return
                continue
            if len(conn.inbuf) < _U32.size:
                return
            end = _U32.size + _frame_length(conn.inbuf)
            if len(conn.inbuf) < end:
                return
            body = memoryview(bytes(conn.inbuf[_U32.size : end]))
            del conn.inbuf[:end]
            handler = self._handlers.get(body[0])
            if handler is None:
                raise _ProtocolError(f"unknown command {body[0]}")
            handler(conn, _decode_fields(body[1:]))

    # -- the handshake (see the module docstring and auth.py)

    def _handshake(self, conn: _Conn) -> bool:
        """Take the next handshake step if its bytes are here; False if it must wait (or ended)."""
        if conn.state == _GREETING:
            if len(conn.inbuf) < len(_MAGIC):
                return False
            greeting = bytes(conn.inbuf[: len(_MAGIC)])
            del conn.inbuf[: len(_MAGIC)]
            self._on_greeting(conn, greeting)
            return not conn.closed
        if len(conn.inbuf) < ANSWER_BYTES:
            return False
        answer = bytes(conn.inbuf[:ANSWER_BYTES])
        del conn.inbuf[:ANSWER_BYTES]
        assert conn.auth is not None
        proof = conn.auth.check(answer)
        if proof is None:
            self._send(conn, REJECTED)
            self._reject(conn, "wrong or replayed secret", "its answer did not prove the secret")
            return False
        self._admit(conn, proof)
        return True

    def _on_greeting(self, conn: _Conn, greeting: bytes) -> None:
        if greeting == _MAGIC and self._secret is None:
            self._admit(conn, _MAGIC)
        elif greeting == _MAGIC_AUTH and self._secret is not None:
            conn.auth = ServerHandshake(self._secret, _CONTEXT)
            conn.state = _ANSWER
            self._send(conn, _MAGIC_AUTH + conn.auth.nonce)
        elif greeting == _MAGIC:  # tell the client we want a secret, then hang up
            self._send(conn, _MAGIC_AUTH + bytes(NONCE_BYTES))
            self._reject(conn, "no secret", "the client does not authenticate; this store does")
        elif greeting == _MAGIC_AUTH:  # tell the client we have no secret, then hang up
            self._send(conn, _MAGIC)
            self._reject(conn, "unexpected secret", "the client authenticates; this store has none")
        else:
            raise _ProtocolError(f"bad greeting {greeting!r}")

    def _admit(self, conn: _Conn, reply: bytes) -> None:
        conn.state = _READY
        conn.auth = None
        self._pending.pop(conn, None)
        self._send(conn, reply)

    def _violation(self, conn: _Conn, reason: str) -> None:
        self._reject(conn, "protocol error", reason)

    def _reject(self, conn: _Conn, cause: str, detail: str) -> None:
        """Drop ``conn``, logging the first drop of each cause at WARNING and the rest at DEBUG."""
        if not conn.closed:
            self.rejections.reject(cause, conn.peer, detail)
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._pending.pop(conn, None)
        if conn.waiting_for is not None:
            waiters = self._waiters.get(conn.waiting_for, [])
            with contextlib.suppress(ValueError):
                waiters.remove(conn)
            if not waiters:
                self._waiters.pop(conn.waiting_for, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()
        self._conns.discard(conn)

    # -- sending

    def _send(self, conn: _Conn, data: bytes) -> None:
        conn.outbuf += data
        self._flush(conn)

    def _reply(self, conn: _Conn, status: int, *fields: bytes) -> None:
        self._send(conn, _encode_frame(status, fields))

    def _flush(self, conn: _Conn) -> None:
        while conn.outbuf and not conn.closed:
            try:
                sent = conn.sock.send(conn.outbuf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(conn)
                return
            del conn.outbuf[:sent]
        if conn.closed:
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        if events != conn.events:
            self._selector.modify(conn.sock, events, conn)
            conn.events = events

    # -- commands

    def _store_value(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        for waiter in self._waiters.pop(key, []):
            waiter.waiting_for = None
            self._reply(waiter, _OK, value)
            self._ready.append(waiter)

    def _do_set(self, conn: _Conn, fields: list[bytes]) -> None:
        key, value = _expect(fields, 2, "SET")
        if len(value) > MAX_VALUE_BYTES:
            raise _ProtocolError(f"value of {len(value)} bytes (limit {MAX_VALUE_BYTES})")
        self._store_value(_valid_key(key), value)
        self._reply(conn, _OK)

    def _do_get(self, conn: _Conn, fields: list[bytes]) -> None:
        (key,) = _expect(fields, 1, "GET")
        value = self._data.get(_valid_key(key))
        if value is not None:
            self._reply(conn, _OK, value)
            return
        conn.waiting_for = key
        self._waiters.setdefault(key, []).append(conn)

    def _do_add(self, conn: _Conn, fields: list[bytes]) -> None:
        key, raw_amount = _expect(fields, 2, "ADD")
        if len(raw_amount) != _I64.size:
            raise _ProtocolError(f"ADD amount of {len(raw_amount)} bytes (expected 8)")
        (amount,) = _I64.unpack(raw_amount)
        label = repr(_valid_key(key).decode("utf-8", "replace"))
        try:
            new = str(_counter_plus(label, self._data.get(key, b"0"), amount)).encode("ascii")
        except UsageError as exc:
            self._reply(conn, _ERR, str(exc).encode("utf-8"))
            return
        self._store_value(key, new)
        self._reply(conn, _OK, new)

    def _do_check(self, conn: _Conn, fields: list[bytes]) -> None:
        present = bytes(1 if _valid_key(key) in self._data else 0 for key in fields)
        self._reply(conn, _OK, present)

    def _do_delete(self, conn: _Conn, fields: list[bytes]) -> None:
        (key,) = _expect(fields, 1, "DELETE")
        self._data.pop(_valid_key(key), None)
        self._reply(conn, _OK)


# ---------------------------------------------------------------- client


class _WrongPeer(Exception):
    """Something answered on the store's port, but not with our greeting."""


def _recv_exact(sock: socket.socket, count: int, deadline: float) -> bytes:
    buf = bytearray(count)
    view = memoryview(buf)
    got = 0
    while got < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(remaining)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the store closed the connection")
        got += n
    return bytes(buf)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(remaining)
    sock.sendall(data)


def _read_frame(sock: socket.socket, deadline: float) -> tuple[int, list[bytes]]:
    length = _frame_length(_recv_exact(sock, _U32.size, deadline))
    body = memoryview(_recv_exact(sock, length, deadline))
    return body[0], _decode_fields(body[1:])


def _greet(sock: socket.socket, deadline: float, secret: Secret | None, where: str) -> None:
    """Open a connection: the plain greeting, or the greeting and the challenge-response."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _send_all(sock, _MAGIC if secret is None else _MAGIC_AUTH, deadline)
    answer = _recv_exact(sock, len(_MAGIC), deadline)
    if answer == _MAGIC_AUTH and secret is None:
        raise AuthenticationError(
            f"the store at {where} requires authentication, but this rank has no secret: "
            "set ASYNCREDUCE_SECRET (or ASYNCREDUCE_SECRET_FILE) to the job's secret"
        )
    if answer == _MAGIC and secret is not None:
        raise AuthenticationError(
            f"the store at {where} does not authenticate, but this rank has a secret "
            "(ASYNCREDUCE_SECRET or ASYNCREDUCE_SECRET_FILE): set the same secret on every "
            "rank, or on none"
        )
    if answer not in (_MAGIC, _MAGIC_AUTH):
        raise _WrongPeer(answer)
    if secret is not None:
        handshake = ClientHandshake(secret, _CONTEXT)
        _send_all(sock, handshake.answer(_recv_exact(sock, NONCE_BYTES, deadline)), deadline)
        handshake.check(_recv_exact(sock, PROOF_BYTES, deadline), f"the store at {where}")


def _connect(host: str, port: int, timeout: float, secret: Secret | None) -> socket.socket:
    """A greeted (and authenticated) connection to the store, retrying until ``timeout``.

    Retries because the server may start later; an AuthenticationError is not retried.
    """
    deadline = time.monotonic() + timeout
    delay = 0.01
    last: OSError | None = None
    where = _address(host, port)
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            sock = socket.create_connection((host, port), timeout=min(remaining, 5.0))
        except OSError as exc:
            last = exc
        else:
            try:
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
        return _address(self._host, self._port)

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


def _loopback_for(host: str) -> str:
    """Where the server's own client connects: wildcard binds are reached on loopback."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


class TCPStore(Store):
    """A store served by one process (``is_server=True``, normally rank 0) over TCP.

    The server listens on ``(host, port)`` (``port=0`` picks a free port: read ``.port``) and
    also keeps a client connection to itself, so every rank uses the store the same way.
    A client retries connecting until ``timeout``, since the server may start later.
    ``timeout`` is also the default deadline of ``get`` and of every other request.

    ``secret`` (default: read ``ASYNCREDUCE_SECRET`` / ``ASYNCREDUCE_SECRET_FILE``) turns on
    authentication: every connection then proves the secret both ways before any request is
    read, and a server or client that disagrees about it fails with AuthenticationError.
    Without a secret the server warns when ``host`` is a wildcard (all interfaces).
    """

    port: int

    def __init__(
        self,
        host: str,
        port: int,
        *,
        is_server: bool,
        timeout: float = 30.0,
        secret: SecretArg = FROM_ENV,
    ) -> None:
        _check_timeout(timeout)
        _check_port(port, allow_zero=is_server)
        key = resolve_secret(secret)
        self.host = host
        self.authenticated = key is not None
        self._timeout = timeout
        self._server: _StoreServer | None = None
        if not is_server:
            self.port = port
            self._client = _Client(host, port, timeout, key)
            return
        self._server = _StoreServer(host, port, key)
        self.port = self._server.port
        try:
            self._client = _Client(_loopback_for(host), self.port, timeout, key)
        except BaseException:
            self._server.stop()
            raise

    def __repr__(self) -> str:
        role = "server" if self._server is not None else "client"
        auth = "authenticated" if self.authenticated else "unauthenticated"
        return f"<TCPStore {role} {_address(self.host, self.port)} {auth}>"

    def set(self, key: str, value: bytes) -> None:
        fields = [_key_bytes(key), _value_bytes(value)]
        self._call(_SET, fields, 0, f"store set {key!r}")

    def get(self, key: str, timeout: float | None = None) -> bytes:
        wait = self._timeout if timeout is None else timeout
        _check_timeout(wait)
        on_timeout = f"store get {key!r}: key not set within {wait:g} s"
        reply = self._client.request(_GET, [_key_bytes(key)], max(wait, 0.001), on_timeout)
        return _expect_reply(reply, 1, "GET")[0]

    def add(self, key: str, amount: int) -> int:
        _check_amount(amount)
        fields = [_key_bytes(key), _I64.pack(amount)]
        (total,) = self._call(_ADD, fields, 1, f"store add {key!r}")
        try:
            return int(total)
        except ValueError:
            raise BrokenError(f"the store answered add {key!r} with {total[:40]!r}") from None

    def check(self, keys: Sequence[str]) -> list[bool]:
        present: list[bool] = []
        raw = [_key_bytes(key) for key in keys]
        for start in range(0, len(raw), _MAX_FIELDS):
            chunk = raw[start : start + _MAX_FIELDS]
            (flags,) = self._call(_CHECK, chunk, 1, "store check")
            if len(flags) != len(chunk):
                raise BrokenError(f"the store answered {len(flags)} flags for {len(chunk)} keys")
            present += [flag == 1 for flag in flags]
        return present

    def delete(self, key: str) -> None:
        self._call(_DELETE, [_key_bytes(key)], 0, f"store delete {key!r}")

    def close(self) -> None:
        self._client.close()
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def _diagnosis(self) -> str:
        server = self._server
        summary = server.rejections.summary() if server is not None else ""
        return f"the store {summary}, see its warnings" if summary else ""

    def _call(self, op: int, fields: Sequence[bytes], answers: int, what: str) -> list[bytes]:
        on_timeout = f"{what}: no answer from the store at {_address(self.host, self.port)}"
        on_timeout += f" within {self._timeout:g} s"
        reply = self._client.request(op, fields, self._timeout, on_timeout)
        return _expect_reply(reply, answers, what)


def _expect_reply(reply: list[bytes], count: int, what: str) -> list[bytes]:
    if len(reply) != count:
        raise BrokenError(f"the store answered {what} with {len(reply)} fields, not {count}")
    return reply


# ---------------------------------------------------------------- file store


def _file_name(key: str) -> str:
    """A safe, unique file name for ``key`` (readable where the key allows it)."""
    raw = _key_bytes(key)
    name = "k_" + urllib.parse.quote(key, safe="")
    return name if len(name) <= 200 else "h_" + hashlib.sha256(raw).hexdigest()


def _read_file(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def _write_atomically(directory: str, path: str, data: bytes) -> None:
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class FileStore(Store):
    """A store in a directory that every rank sees (one file per key, written atomically).

    Use a fresh directory per job: keys left by an earlier job would be read as this job's.
    ``set``, ``add`` and ``delete`` hold an ``flock`` on ``<path>/.lock``, so they are atomic
    across processes; ``get`` polls with short sleeps until its deadline.
    """

    def __init__(self, path: str, *, timeout: float = 30.0) -> None:
        _check_timeout(timeout)
        self.path = os.path.abspath(path)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot use {path!r} as a file store: {exc}") from exc
        self._timeout = timeout
        self._closed = False

    def set(self, key: str, value: bytes) -> None:
        path, data = self._file(key), _value_bytes(value)
        with self._locked():
            _write_atomically(self.path, path, data)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        wait = self._timeout if timeout is None else timeout
        _check_timeout(wait)
        path = self._file(key)
        deadline = time.monotonic() + wait
        delay = 0.001
        while (data := _read_file(path)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"store get {key!r}: key not set within {wait:g} s (file store {self.path})"
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.05)
        return data

    def add(self, key: str, amount: int) -> int:
        _check_amount(amount)
        path = self._file(key)
        with self._locked():
            current = _read_file(path)
            total = _counter_plus(repr(key), b"0" if current is None else current, amount)
            _write_atomically(self.path, path, str(total).encode("ascii"))
        return total

    def check(self, keys: Sequence[str]) -> list[bool]:
        paths = [self._file(key) for key in keys]
        return [os.path.exists(path) for path in paths]

    def delete(self, key: str) -> None:
        path = self._file(key)
        with self._locked(), contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def close(self) -> None:
        self._closed = True

    def _file(self, key: str) -> str:
        if self._closed:
            raise ClosedError("the store was closed")
        return os.path.join(self.path, _file_name(key))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # A fresh descriptor per call: flock excludes other descriptors, threads included.
        fd = os.open(os.path.join(self.path, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


# ---------------------------------------------------------------- rendezvous


def _describe_ranks(ranks: Sequence[int]) -> str:
    """``[2]`` -> "rank 2"; ``[2, 3, 5, 6, 7]`` -> "ranks 2, 3, 5-7"."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts: list[str] = []
    for run in runs:
        parts += [f"{run[0]}-{run[-1]}"] if len(run) > 2 else [str(r) for r in run]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def gather(
    store: Store, prefix: str, rank: int, world_size: int, value: bytes, timeout: float,
    *, abort: str | None = None,
) -> list[bytes]:  # fmt: skip
    """Publish ``value`` under f"{prefix}/{rank}", wait for all ranks, return values in rank order.

    On deadline raise TimeoutError whose message names who is missing, e.g.
    "rendezvous 'addr': waited 30.0 s; ranks 2, 3 never joined (world_size=4)".
    ``abort``: a key that any rank may set to a reason, which makes every waiting rank raise
    UsageError with it within a second instead of waiting out the deadline.
    Each rendezvous needs its own ``prefix``: keys are never deleted, so a reused prefix
    would return the values of the earlier round.
    """
    _check_rank(rank, world_size)
    _check_timeout(timeout)
    deadline = time.monotonic() + timeout
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.set(keys[rank], value)
    try:
        return [_wait_for(store, key, deadline, abort) for key in keys]
    except TimeoutError:
        missing = [r for r, present in enumerate(store.check(keys)) if not present]
        if missing:
            hint = store._diagnosis()
            raise TimeoutError(
                f"rendezvous {prefix!r}: waited {timeout:.1f} s; "
                f"{_describe_ranks(missing)} never joined (world_size={world_size})"
                + (f"; {hint}" if hint else "")
            ) from None
    # Everyone arrived just as the deadline passed: the values are all there now.
    return [store.get(key, timeout=max(timeout, 1.0)) for key in keys]


def _wait_for(store: Store, key: str, deadline: float, abort: str | None) -> bytes:
    """``store.get`` until ``deadline``, looking at the ``abort`` key every second."""
    while True:
        left = max(deadline - time.monotonic(), 0.0)
        if abort is None:
            return store.get(key, timeout=left)
        try:
            return store.get(key, timeout=min(left, 1.0))
        except TimeoutError:
            if store.check([abort])[0]:
                raise UsageError(store.get(abort, 1.0).decode(errors="replace")) from None
            if left <= 1.0:
                raise


def store_from_env_or_args(
    rank: int,
    world_size: int,
    master_addr: str | None,
    master_port: int | None,
    init_method: str | None,
    timeout: float,
) -> Store:
    """The store of this job: ``init_method`` wins, else master_addr/master_port (rank 0 serves).

    ``init_method`` is 'tcp://HOST:PORT' or 'file:///PATH'.

    A ``master_addr`` or ``master_port`` left as None is read from the environment variables
    ``MASTER_ADDR`` and ``MASTER_PORT``. Missing information -> UsageError saying which
    variables to set. Rank 0 serves the store on exactly the address it is given.
    """
    _check_rank(rank, world_size)
    _check_timeout(timeout)
    if init_method is not None:
        return _store_from_url(init_method, rank, timeout)
    addr = master_addr if master_addr is not None else os.environ.get("MASTER_ADDR") or None
    port = master_port if master_port is not None else _port_from_env()
    missing = [name for name, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if v is None]
    if addr is None or port is None:
        raise UsageError(
            f"rendezvous needs to know where rank 0 serves the store: set {' and '.join(missing)} "
            "(or pass master_addr= and master_port=, or init_method='tcp://HOST:PORT' "
            "or 'file:///PATH')"
        )
    return TCPStore(addr, port, is_server=rank == 0, timeout=timeout)


def _port_from_env() -> int | None:
    text = os.environ.get("MASTER_PORT", "").strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise UsageError(f"MASTER_PORT must be a port number in 1..65535, got {text!r}")
    return int(text)


def _store_from_url(init_method: str, rank: int, timeout: float) -> Store:
    forms = (
        "the accepted forms are 'tcp://HOST:PORT' (rank 0 serves the store) and "
        "'file:///ABSOLUTE/PATH' (a directory every rank sees)"
    )
    parts = urllib.parse.urlsplit(init_method)
    if parts.scheme == "tcp":
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise UsageError(f"init_method {init_method!r} needs a host and a port; {forms}")
        return TCPStore(parts.hostname, port, is_server=rank == 0, timeout=timeout)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise UsageError(f"init_method {init_method!r} is not an absolute file URL; {forms}")
        return FileStore(urllib.parse.unquote(parts.path), timeout=timeout)
    raise UsageError(f"init_method {init_method!r} is not understood; {forms}")
