"""Shared-secret authentication of every connection: an HMAC-SHA256 challenge-response.

Theory of operation
-------------------
When the job has a secret (``ASYNCREDUCE_SECRET``, or ``ASYNCREDUCE_SECRET_FILE`` naming a
file only its owner may read), both ends of every store and data connection prove that they
know it before anything else on the connection is parsed. The client opens with a greeting
that says "I authenticate" (each protocol has its own: rendezvous/wire.py, transport/mesh.py;
the rules both servers follow are in transport/listener.py), then, all messages fixed-size::

    server -> client   greeting | nonce_s                       (32 random bytes)
    client -> server   HMAC(secret, context|client|nonce_s|nonce_c) | nonce_c
    server -> client   HMAC(secret, context|server|nonce_s|nonce_c)    or REJECTED

The server proves itself only after the client has, so it is never an oracle for strangers.
Both nonces are fresh per connection, so an answer recorded from one connection is useless
on another (a replay fails like a wrong secret). The role label stops a reflected answer, and
the context (one per protocol) stops an answer for one protocol being used on the other.
Proofs are compared with :func:`hmac.compare_digest`. The exchange costs the connection one
extra round trip; without a secret nothing of this happens.

Both sides must agree on whether authentication is on. A server that receives the plain
greeting while it has a secret (or the reverse) says so with its own greeting, and the client,
which can tell, raises :class:`AuthenticationError` saying which side lacks the secret.

The secret is held by :class:`Secret`, whose ``repr`` and ``str`` never show it; no message,
log line or exception here contains it. Servers report rejected peers through
:class:`RejectionLog`: the first rejection of each cause at WARNING, later ones at DEBUG.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Mapping
from typing import Final, Literal

from .errors import AuthenticationError, UsageError

__all__ = [
    "ANSWER_BYTES",
    "FROM_ENV",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "REJECTED",
    "AuthenticationError",
    "ClientHandshake",
    "RejectionLog",
    "Secret",
    "SecretArg",
    "ServerHandshake",
    "resolve_secret",
    "secret_from_env",
    "warn_if_exposed",
]

_log = logging.getLogger("asyncreduce.auth")

NONCE_BYTES: Final = 32
PROOF_BYTES: Final = hashlib.sha256().digest_size
ANSWER_BYTES: Final = PROOF_BYTES + NONCE_BYTES
REJECTED: Final = bytes(PROOF_BYTES)  # sent instead of the server's proof: "your proof was wrong"
_MAX_SECRET_FILE_BYTES: Final = 64 << 10
_HOW_TO_SET = (
    "set the same ASYNCREDUCE_SECRET (or ASYNCREDUCE_SECRET_FILE) on every rank of the job"
)


class Secret:
    """The job's shared secret. Used only as an HMAC key; ``repr`` and ``str`` hide it."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes | str) -> None:
        raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
        if not raw:
            raise UsageError(f"the shared secret is empty; {_HOW_TO_SET} (a non-empty value)")
        self._key = raw

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def proof(self, context: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
        """HMAC-SHA256 over fixed-size fields: what ``role`` sends to prove it knows the key."""
        message = b"%s\0%s\0%s%s" % (context, role, nonce_s, nonce_c)
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def tag(self, context: bytes, *fields: bytes) -> bytes:
        """HMAC-SHA256 over ``context`` and ``fields``, each field length-prefixed (so no two
        lists of fields give the same message): PROOF_BYTES that only a holder can make."""
        mac = hmac.new(self._key, context + b"\0", hashlib.sha256)
        for field in fields:
            mac.update(len(field).to_bytes(8, "big"))
            mac.update(field)
        return mac.digest()


class _FromEnv(enum.Enum):
    FROM_ENV = "read ASYNCREDUCE_SECRET / ASYNCREDUCE_SECRET_FILE"


FROM_ENV: Final = _FromEnv.FROM_ENV
SecretArg = Secret | None | Literal[_FromEnv.FROM_ENV]
"""What a ``secret=`` parameter takes: a Secret, None (no authentication), or FROM_ENV."""


def resolve_secret(secret: SecretArg) -> Secret | None:
    """The secret to use: ``FROM_ENV`` reads the environment (see :func:`secret_from_env`)."""
    if secret is FROM_ENV:
        return secret_from_env()
    if secret is not None and not isinstance(secret, Secret):
        raise UsageError(f"secret= takes a Secret, None or FROM_ENV, got {type(secret).__name__}")
    return secret


def secret_from_env(environ: Mapping[str, str] | None = None) -> Secret | None:
    """The secret named by ``ASYNCREDUCE_SECRET`` or ``ASYNCREDUCE_SECRET_FILE``; None if unset.

    The file must be readable by its owner only (mode 600 or stricter): a secret that other
    users can read is no secret, so a group- or world-accessible file is refused. Trailing
    whitespace (the newline an editor adds) is not part of the secret.
    """
    env = os.environ if environ is None else environ
    text, path = env.get("ASYNCREDUCE_SECRET", ""), env.get("ASYNCREDUCE_SECRET_FILE", "")
    if text and path:
        raise UsageError(
            "both ASYNCREDUCE_SECRET and ASYNCREDUCE_SECRET_FILE are set; set only one of them"
        )
    if path:
        return Secret(_read_secret_file(path))
    return Secret(text) if text else None


def _read_secret_file(path: str) -> bytes:
    """The contents of a secret file, after checking that only its owner may read it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(
            f"cannot read ASYNCREDUCE_SECRET_FILE {path!r}: {exc.strerror}; "
            "point it at a file that holds the job's secret"
        ) from None
    try:
        info = os.fstat(fd)  # the file we opened, not whatever the path names by now
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"ASYNCREDUCE_SECRET_FILE {path!r} is not a regular file")
        if info.st_mode & 0o077:
            raise UsageError(
                f"ASYNCREDUCE_SECRET_FILE {path!r} has mode {stat.S_IMODE(info.st_mode):04o}: "
                f"other users may read it; run 'chmod 600 {path}' so only its owner can"
            )
        data = os.read(fd, _MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_SECRET_FILE_BYTES:
        raise UsageError(f"ASYNCREDUCE_SECRET_FILE {path!r} is over 64 KiB; is it the right file?")
    data = data.rstrip()
    if not data:
        raise UsageError(f"ASYNCREDUCE_SECRET_FILE {path!r} is empty; write the secret into it")
    return data


class ServerHandshake:
    """The accepting side of one challenge-response (sans-IO: bytes in, bytes out)."""

    __slots__ = ("_secret", "_context", "nonce")

    def __init__(self, secret: Secret, context: bytes) -> None:
        self._secret = secret
        self._context = context
        self.nonce = secrets.token_bytes(NONCE_BYTES)  # sent after the greeting

    def check(self, answer: bytes | bytearray | memoryview) -> bytes | None:
        """The server's proof if ``answer`` (ANSWER_BYTES) proves the secret, else None."""
        if len(answer) != ANSWER_BYTES:
            return None
        proof, nonce_c = bytes(answer[:PROOF_BYTES]), bytes(answer[PROOF_BYTES:])
        wanted = self._secret.proof(self._context, b"client", self.nonce, nonce_c)
        if not hmac.compare_digest(proof, wanted):
            return None
        return self._secret.proof(self._context, b"server", self.nonce, nonce_c)


class ClientHandshake:
    """The connecting side of one challenge-response (sans-IO: bytes in, bytes out)."""

    __slots__ = ("_secret", "_context", "_nonce_s", "_nonce_c")

    def __init__(self, secret: Secret, context: bytes) -> None:
        self._secret = secret
        self._context = context
        self._nonce_s = b""
        self._nonce_c = secrets.token_bytes(NONCE_BYTES)

    def answer(self, nonce_s: bytes) -> bytes:
        """What to send for the server's ``nonce_s``: our proof, then our own nonce."""
        if len(nonce_s) != NONCE_BYTES:
            raise ValueError(f"a nonce is {NONCE_BYTES} bytes, got {len(nonce_s)}")
        self._nonce_s = nonce_s
        proof = self._secret.proof(self._context, b"client", nonce_s, self._nonce_c)
        return proof + self._nonce_c

    def check(self, reply: bytes, who: str) -> None:
        """Raise AuthenticationError unless ``reply`` proves that ``who`` knows the secret."""
        if hmac.compare_digest(reply, REJECTED):
            raise AuthenticationError(
                f"{who} rejected this rank's secret (authentication failed): {_HOW_TO_SET}"
            )
        wanted = self._secret.proof(self._context, b"server", self._nonce_s, self._nonce_c)
        if not hmac.compare_digest(reply, wanted):
            raise AuthenticationError(
                f"{who} did not prove that it knows the secret (authentication failed): "
                "is it a server of this job? " + _HOW_TO_SET
            )


class RejectionLog:
    """Peers a listener dropped, by cause: the first of each cause at WARNING, the rest at DEBUG.

    A flood of bad connections therefore costs one log line per cause, not one per connection;
    ``counts`` keeps the totals (e.g. to explain a rendezvous timeout).
    """

    def __init__(self, logger: logging.Logger, where: str) -> None:
        self._logger = logger
        self._where = where
        self.counts: dict[str, int] = {}

    def reject(self, cause: str, peer: str, detail: str = "") -> None:
        """Record that the connection from ``peer`` was dropped for ``cause``."""
        seen = self.counts.get(cause, 0)
        self.counts[cause] = seen + 1
        level = logging.DEBUG if seen else logging.WARNING
        note = "" if seen else " (more of this kind are logged at DEBUG level)"
        reason = f"{cause}: {detail}" if detail else cause
        self._logger.log(
            level, "%s: dropping connection from %s: %s%s", self._where, peer, reason, note
        )

    def summary(self) -> str:
        """E.g. "dropped 3 connections (no secret: 1, wrong or replayed secret: 2)"; or ""."""
        counts = dict(self.counts)  # a copy: another thread may be adding to it
        total = sum(counts.values())
        if not total:
            return ""
        causes = ", ".join(f"{cause}: {n}" for cause, n in sorted(counts.items()))
        return f"dropped {total} connection{'s' if total != 1 else ''} ({causes})"


_WILDCARDS: Final = frozenset({"", "0.0.0.0", "::", "::0"})


def warn_if_exposed(host: str, port: int, what: str, secret: Secret | None) -> None:
    """Warn loudly when ``what`` listens on every interface and no secret guards it."""
    if secret is None and host in _WILDCARDS:
        _log.warning(
            "SECURITY: the %s listens on all interfaces (%r, port %d) without a shared secret: "
            "anyone who can reach this port can join the job or feed it data. Set "
            "ASYNCREDUCE_SECRET (or ASYNCREDUCE_SECRET_FILE) on every rank, or listen on "
            "loopback or one private interface instead",
            what,
            host,
            port,
        )
