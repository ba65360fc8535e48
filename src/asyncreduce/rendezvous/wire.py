"""The TCP store's wire format: greetings, then length-prefixed frames of length-prefixed fields.

Theory of operation. Integers are big-endian. Without a secret, a client opens with the 8
bytes ``ARSTORE1`` and the server echoes them. With a secret (see auth.py) the client opens
with ``ARSTOREA`` instead; the server answers ``ARSTOREA`` and its nonce, and the HMAC
challenge-response runs before any frame is read (one extra round trip per connection). A
server that gets the other greeting than the one it expects answers with its own and hangs
up, so the client can say which side lacks the secret (transport/listener.py). Then every
request and every response is a frame::

    u32 length | u8 tag | field* ,   field = u32 length | bytes

A request's tag is its command (SET key value, GET key, ADD key i64, CHECK key*, DELETE key);
a response's tag is 0 (ok, with the result fields) or 1 (error, with a message). Every length
is checked against its bound (keys 4096 bytes, values 64 MiB, 4096 fields) before anything is
buffered or trusted. Nothing received is ever unpickled or evaluated: keys and values are
opaque bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from ..auth import ANSWER_BYTES
from .store import MAX_KEY_BYTES, MAX_VALUE_BYTES

_MAGIC = b"ARSTORE1"  # the plain greeting (no secret)
_MAGIC_AUTH = b"ARSTOREA"  # the greeting of a client that authenticates
_CONTEXT = b"asyncreduce store v1"  # what the HMAC proofs of this protocol are bound to
_HANDSHAKE_BYTES = len(_MAGIC) + ANSWER_BYTES  # the most a server buffers before the handshake
_U32 = struct.Struct("!I")
_I64 = struct.Struct("!q")
_MAX_FRAME = 1 + 2 * _U32.size + MAX_KEY_BYTES + MAX_VALUE_BYTES
_MAX_FIELDS = 4096  # per frame; the client splits longer CHECK lists
_RECV_CHUNK = 256 * 1024
_MAX_BUFFERED = _U32.size + _MAX_FRAME + _RECV_CHUNK

_SET, _GET, _ADD, _CHECK, _DELETE = 1, 2, 3, 4, 5
_OK, _ERR = 0, 1


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
