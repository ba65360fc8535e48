"""TCPStore: the store rank 0 serves over TCP, used by every rank (rank 0 too) as a client.

Theory of operation. ``TCPStore(is_server=True)`` starts the server thread (server.py) and
then connects to it like any other rank (client.py), so every rank uses the store the same
way. Arguments are checked here (store.py), before anything goes on the wire (wire.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..auth import FROM_ENV, SecretArg, resolve_secret
from ..errors import BrokenError
from ..transport.listener import host_port
from .client import _Client
from .server import _StoreServer
from .store import (
    Store,
    _check_amount,
    _check_port,
    _check_timeout,
    _key_bytes,
    _value_bytes,
)
from .wire import _ADD, _CHECK, _DELETE, _GET, _I64, _MAX_FIELDS, _SET

__all__ = ["TCPStore"]


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
    checks_secret = True  # every connection proves the secret first, when there is one

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
        return f"<TCPStore {role} {host_port(self.host, self.port)} {auth}>"

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
        on_timeout = f"{what}: no answer from the store at {host_port(self.host, self.port)}"
        on_timeout += f" within {self._timeout:g} s"
        reply = self._client.request(op, fields, self._timeout, on_timeout)
        return _expect_reply(reply, answers, what)


def _expect_reply(reply: list[bytes], count: int, what: str) -> list[bytes]:
    if len(reply) != count:
        raise BrokenError(f"the store answered {what} with {len(reply)} fields, not {count}")
    return reply
