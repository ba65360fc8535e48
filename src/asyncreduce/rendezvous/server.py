"""The TCP store's server: one daemon thread that owns every key, so it needs no locks.

Theory of operation. ``_StoreServer`` runs a ``selectors`` loop ("asyncreduce-store") over
non-blocking sockets. New connections go through the shared authenticated listener
(transport/listener.py): at most 72 bytes are read from one before its handshake is done, one
not done within ``_HANDSHAKE_SECONDS`` is dropped, and at most ``_MAX_PENDING`` unfinished
handshakes are kept (the oldest goes first). A ``get`` for a key not yet set parks its
connection on a waiters list until a ``set`` or ``add`` creates the key; each connection has
at most one answer in flight. A connection that breaks the protocol is dropped (the first
drop of each cause is logged at WARNING, later ones at DEBUG); the others are unaffected.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
from collections import deque
from collections.abc import Callable

from ..auth import (
    ANSWER_BYTES,
    REJECTED,
    RejectionLog,
    Secret,
    ServerHandshake,
    warn_if_exposed,
)
from ..errors import UsageError
from ..transport.listener import (
    ADMIT,
    CHALLENGE,
    Greetings,
    Listener,
    WakeUp,
    answer_greeting,
    host_port,
    refusal_detail,
)
from .store import MAX_VALUE_BYTES, _counter_plus
from .wire import (
    _ADD,
    _CHECK,
    _CONTEXT,
    _DELETE,
    _ERR,
    _GET,
    _HANDSHAKE_BYTES,
    _I64,
    _MAGIC,
    _MAGIC_AUTH,
    _MAX_BUFFERED,
    _OK,
    _RECV_CHUNK,
    _SET,
    _U32,
    _decode_fields,
    _encode_frame,
    _expect,
    _frame_length,
    _ProtocolError,
    _valid_key,
)

_GREETINGS = Greetings(_MAGIC_AUTH, _MAGIC, _CONTEXT, client="client", server="store")
_log = logging.getLogger("asyncreduce.rendezvous")  # one logger for the whole store

_HANDSHAKE_SECONDS = 10.0  # an unfinished handshake is dropped after this long
_MAX_PENDING = 256  # unfinished handshakes kept at once; the oldest goes when one more arrives


_GREETING, _ANSWER, _READY = "greeting", "answer", "ready"  # where a connection's handshake is


class _Conn:
    """One client connection, as the server thread sees it."""

    __slots__ = (
        "sock", "peer", "inbuf", "outbuf", "state", "auth", "waiting_for", "events", "closed",
    )  # fmt: skip

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.state = _GREETING
        self.auth: ServerHandshake | None = None
        self.waiting_for: bytes | None = None  # key of a parked GET
        self.events = selectors.EVENT_READ
        self.closed = False


class _StoreServer:
    """The selector loop behind ``TCPStore(is_server=True)``; all state lives in its thread."""

    def __init__(self, host: str, port: int, secret: Secret | None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            raise UsageError(
                f"cannot serve the store on {host_port(host, port)}: {exc} "
                "(is MASTER_PORT used by another job? is MASTER_ADDR an address of this host?)"
            ) from exc
        self.port: int = sock.getsockname()[1]
        warn_if_exposed(host, self.port, "rendezvous store", secret)
        self._secret = secret
        self.rejections = RejectionLog(_log, "store server")
        self._wake = WakeUp()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake.reader, selectors.EVENT_READ, "wake")
        self._listener = Listener(
            sock, self._selector, self.rejections, self._welcome, self._reject,
            handshake_seconds=_HANDSHAKE_SECONDS, max_pending=_MAX_PENDING,
        )  # fmt: skip
        self._data: dict[bytes, bytes] = {}
        self._waiters: dict[bytes, list[_Conn]] = {}
        self._conns: set[_Conn] = set()
        self._ready: deque[_Conn] = deque()
        self._handlers: dict[int, Callable[[_Conn, list[bytes]], None]] = {
            _SET: self._do_set,
            _GET: self._do_get,
            _ADD: self._do_add,
            _CHECK: self._do_check,
            _DELETE: self._do_delete,
        }
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="asyncreduce-store", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; it closes the listener and every connection on its way out."""
        self._stopping = True
        self._wake.wake()
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():
            _log.error("store server thread did not stop within 10 s")
        self._wake.close()

    # -- the loop

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._selector.select(self._listener.timeout()):
                    self._dispatch(key.data, mask)
                while self._ready and not self._stopping:
                    self._serve(self._ready.popleft())
                self._listener.on_clock()
        finally:
            self._close_everything()

    def _dispatch(self, data: object, mask: int) -> None:
        try:
            if data == "wake":
                self._wake.drain()
            elif data is self._listener:
                self._listener.accept()
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
        self._listener.sock.close()

    def _welcome(self, sock: socket.socket, peer: str) -> _Conn:
        """A new connection (the listener keeps its handshake within bounds)."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, peer)
        self._conns.add(conn)
        return conn

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
            self._refuse(conn, REJECTED, "wrong or replayed secret")
            return False
        self._admit(conn, proof)
        return True

    def _on_greeting(self, conn: _Conn, greeting: bytes) -> None:
        if greeting not in (_MAGIC, _MAGIC_AUTH):
            raise _ProtocolError(f"bad greeting {greeting!r}")
        verdict, reply, conn.auth = answer_greeting(
            _GREETINGS, greeting == _MAGIC_AUTH, self._secret
        )
        if verdict == ADMIT:
            self._admit(conn, _MAGIC)
        elif verdict == CHALLENGE:
            conn.state = _ANSWER
            self._send(conn, reply)
        else:  # tell the client which side lacks the secret, then hang up
            self._refuse(conn, reply, verdict)

    def _refuse(self, conn: _Conn, reply: bytes, cause: str) -> None:
        self._send(conn, reply)
        self._reject(conn, cause, refusal_detail(_GREETINGS, cause))

    def _admit(self, conn: _Conn, reply: bytes) -> None:
        conn.state = _READY
        conn.auth = None
        self._listener.finished(conn)
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
        self._listener.finished(conn)
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
