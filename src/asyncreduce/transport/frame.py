"""The frame: what travels between ranks, and the checks it passes before anything trusts it.

Layout (little-endian), then ``name_len`` bytes of operation name, then ``payload_len`` bytes:

    magic "ARDC" | version u8 | type u8 | name_len u16 | step u32 | seg u32 | instance u64 |
    payload_len u64 | kind u8 | dtype u8 | reduce u8 | flags u8 | root u32 | count u64

``(name, instance)`` is the operation key; ``(step, seg)`` names the message inside the
operation; ``(kind, dtype, reduce, root, count)`` describes the operation so a receiver can
tell at once whether both sides posted the same thing. A DATA frame carries a piece of the
operation's buffer; an ERROR frame carries a UTF-8 message that fails the operation on the
receiver too; a GOODBYE frame (no key) says the sender is closing in good order, and why;
a CREDIT frame (no key; ``instance`` is a byte position) returns shared-memory arena space; a
HEARTBEAT frame (empty) says the sender is alive even when it has nothing to send; an ABORT
frame (no key) says the sender's communicator broke, and why, so the receiver's breaks too; an
INQUIRY frame (a key, no payload; ``seg`` says question, answer or "posted here") serves the
stall inspector and flow control; a FLOW frame (no key; ``instance`` 1) asks the receiver
to send from now on only the frames of operations the sender has posted (back-pressure), and
one with ``instance`` 2 ends that; an AGREE frame (no key; ``instance`` the membership's
epoch) carries one message of the agreement on who is alive (protocol/membership.py). A
DATA frame with the SHM flag has its payload in the sender's arena (see shm.py).
Every field is checked against its bounds by ``parse_header`` before use.
"""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from ..kernels.reduction import DTYPE_BY_CODE, REDUCTION_CODES

__all__ = [
    "DATA",
    "ERROR",
    "GOODBYE",
    "CREDIT",
    "HEARTBEAT",
    "ABORT",
    "INQUIRY",
    "FLOW",
    "AGREE",
    "FLAG_SHM",
    "with_flags",
    "with_step",
    "STEP_AT",
    "Descriptor",
    "FrameError",
    "Header",
    "HEADER",
    "MAX_NAME_BYTES",
    "MAX_PAYLOAD_BYTES",
    "MAX_ERROR_BYTES",
    "pack_header",
    "parse_header",
]

MAGIC: Final = b"ARDC"
VERSION: Final = 4  # 2: FLOW instance 2 (Resume); 3: the butterfly barrier; 4: AGREE; a HELLO
# carries it
DATA: Final = 1
ERROR: Final = 2
GOODBYE: Final = 3
CREDIT: Final = 4
HEARTBEAT: Final = 5  # "still here": sent to every peer about once a second
ABORT: Final = 6  # "my communicator broke, and so must yours": the reason is the payload
INQUIRY: Final = 7  # the stall inspector: "what do you know of this key?" and its answer
FLOW: Final = 8  # back-pressure: "send me only what I posted" (instance 1), "all again" (2)
AGREE: Final = 9  # the agreement on who is alive after a failure (instance: the epoch)
_UNKEYED: Final = (GOODBYE, CREDIT, HEARTBEAT, ABORT, FLOW, AGREE)
FLAG_SHM: Final = 1  # the payload is in the sender's shared-memory arena, not on the wire
_FLAGS_AT: Final = 35  # byte offset of the flags in a packed header
STEP_AT: Final = 8  # byte offset of the step (4 bytes, little-endian) in a packed header
HEADER: Final = struct.Struct("<4sBBHIIQQBBBBIQ")
MAX_NAME_BYTES: Final = 1024
MAX_PAYLOAD_BYTES: Final = 1 << 30
MAX_ERROR_BYTES: Final = 64 << 10
MAX_STEP: Final = 1 << 20
_KIND_CODES: Final = range(1, 11)  # algorithms.KINDS
_DTYPE_CODES: Final = frozenset(DTYPE_BY_CODE)
_REDUCE_CODES: Final = frozenset({0, *REDUCTION_CODES.values()})  # 0: none


class FrameError(Exception):
    """A frame that breaks the protocol: the connection it came on can no longer be trusted."""


class Descriptor(NamedTuple):
    """What every rank must agree on for one operation (wire codes). A tuple: it is built and
    compared for every frame, and a tuple does both in C."""

    kind: int
    dtype: int
    reduce: int
    root: int
    count: int  # type: ignore[assignment]  # (shadows tuple.count, which nobody calls)

    @classmethod
    def checked(cls, kind: int, dtype: int, reduce: int, root: int, count: int) -> Descriptor:
        """A descriptor of ints that fit the wire (a byte each for kind, dtype and reduce, 32
        bits of root, 64 of count: the frame header and the ordered engines' agreement pack
        them so), integer-likes made ints; TypeError or ValueError naming the field otherwise.
        Checked where an operation's descriptor is made, in the caller's thread: the packing
        comes later, on an engine's thread, where a field that was not an int (a torch
        tensor's ``size`` method for its count) once broke every rank with a struct.error."""
        fields: tuple[int, ...] = (kind, dtype, reduce, root, count)
        if not type(kind) is type(dtype) is type(reduce) is type(root) is type(count) is int:
            fields = tuple(_as_int(name, v) for name, v in zip(cls._fields, fields, strict=True))
        try:
            _FIELDS.pack(*fields)
        except struct.error:
            raise ValueError(_out_of_range(fields)) from None
        return cls(*fields)


_FIELDS: Final = struct.Struct("<BBBIQ")  # a descriptor's fields as the wire carries them


def _as_int(name: str, value: Any) -> int:
    """``value`` of descriptor field ``name`` as an int, or TypeError."""
    try:
        return int(operator.index(value))
    except TypeError:
        raise TypeError(f"an operation's descriptor has {name}={value!r}, not an integer "
                        "(a bug in asyncreduce: please report it)") from None  # fmt: skip


def _out_of_range(fields: tuple[int, ...]) -> str:
    """Which of a descriptor's int fields does not fit its width on the wire."""
    for name, value, code in zip(Descriptor._fields, fields, _FIELDS.format[1:], strict=True):
        bits = struct.calcsize(code) * 8
        if not 0 <= value < 1 << bits:
            return f"an operation's descriptor has {name}={value}, outside its {bits} bits"
    return f"an operation's descriptor {fields} does not fit the wire"  # (cannot happen)


@dataclass(slots=True)
class Header:
    type: int
    name: bytes
    instance: int
    step: int
    seg: int
    payload_len: int
    desc: Descriptor
    flags: int = 0

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.name, self.instance)


def pack_header(
    ftype: int, name: bytes, instance: int, step: int, seg: int, payload_len: int, desc: Descriptor
) -> bytes:
    """The header and name bytes of one frame."""
    fixed = HEADER.pack(
        MAGIC, VERSION, ftype, len(name), step, seg, instance, payload_len,
        desc.kind, desc.dtype, desc.reduce, 0, desc.root, desc.count,
    )  # fmt: skip
    return fixed + name


def parse_header(fixed: bytes | bytearray | memoryview) -> tuple[int, Header]:
    """Check the fixed part of a header; return (name_len, header with the name still empty)."""
    (magic, version, ftype, name_len, step, seg, instance, payload_len,
     kind, dtype, reduce, flags, root, count) = HEADER.unpack(fixed)  # fmt: skip
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}: not an asyncreduce peer")
    if version != VERSION:
        raise FrameError(f"protocol version {version}, this rank speaks {VERSION}")
    if ftype not in (DATA, ERROR, GOODBYE, CREDIT, HEARTBEAT, ABORT, INQUIRY, FLOW, AGREE):
        raise FrameError(f"unknown frame type {ftype}")
    if flags & ~FLAG_SHM or (flags and ftype != DATA):
        raise FrameError(f"unknown flags {flags:#x} on a frame of type {ftype}")
    if name_len > MAX_NAME_BYTES:
        raise FrameError(f"operation name of {name_len} bytes (at most {MAX_NAME_BYTES})")
    limit = MAX_PAYLOAD_BYTES if ftype == DATA else MAX_ERROR_BYTES
    if payload_len > limit:
        raise FrameError(f"payload of {payload_len} bytes (at most {limit})")
    if ftype in _UNKEYED:
        if name_len or (ftype in (CREDIT, HEARTBEAT, FLOW) and payload_len):
            raise FrameError(f"a frame of type {ftype} names no operation and carries no data")
        return 0, Header(ftype, b"", instance, 0, 0, payload_len, Descriptor(0, 0, 0, 0, 0))
    if ftype == INQUIRY and payload_len:
        raise FrameError("an INQUIRY frame carries no payload")
    if step >= MAX_STEP or seg >= MAX_STEP:
        raise FrameError(f"step {step} / segment {seg} out of range")
    if kind not in _KIND_CODES or dtype not in _DTYPE_CODES or reduce not in _REDUCE_CODES:
        raise FrameError(f"unknown operation codes kind={kind} dtype={dtype} reduce={reduce}")
    desc = Descriptor(kind, dtype, reduce, root, count)
    return name_len, Header(ftype, b"", instance, step, seg, payload_len, desc, flags)


def with_flags(head: bytes, flags: int) -> bytes:
    """A packed header (and name) with its flags byte replaced."""
    return head[:_FLAGS_AT] + bytes((flags,)) + head[_FLAGS_AT + 1 :]


def with_step(head: bytes, step: int) -> bytes:
    """A packed header (and name) with its step replaced."""
    return head[:STEP_AT] + step.to_bytes(4, "little") + head[STEP_AT + 4 :]


class FrameReader:
    """One connection's incoming byte stream cut into frames, with no socket (h11's
    ReceiveBuffer): its owner receives into ``room()``, says how much came with
    ``received(n)``, and takes frames out.

    Headers are read through a small staging buffer, several small frames per receive.
    ``next_header()`` returns each complete header (its name read, every field checked by
    ``parse_header``), and the owner settles it before asking for the next: ``skip(n)`` when
    no payload follows on the wire (n = 0: a CREDIT, a shared-memory frame) or when the staged
    payload was consumed where it lies (``staged_payload()``, n = its size); or ``land(dest)``,
    which copies what is staged of the payload into ``dest`` and makes ``room()`` the rest of
    ``dest``, so the rest is received straight into its final place, with no copy. ``land``
    and ``received`` return True once the payload is whole; ``finish()`` then hands back
    the payload (``header`` is the frame's until then) and the reader waits for the next one.
    Nothing here allocates per frame beyond the views the caller consumes.
    """

    __slots__ = ("_stage", "_view", "_lo", "_hi", "header", "_name_len", "payload", "filled")

    def __init__(self, stage_bytes: int) -> None:
        self._stage = bytearray(stage_bytes)
        self._view = memoryview(self._stage)
        self._lo = 0  # staged bytes not yet parsed: _stage[_lo:_hi]
        self._hi = 0
        self.header: Header | None = None  # the frame being read, once its fixed part is in
        self._name_len = 0  # bytes of its name still to come
        self.payload: memoryview | None = None  # where its payload lands (set by land)
        self.filled = 0  # bytes of payload landed so far

    def room(self) -> memoryview:
        """Where the next received bytes go: the rest of the payload being landed, else the
        free end of the staging buffer (made contiguous first when it ran full)."""
        if self.payload is not None:
            return self.payload[self.filled :]
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi == len(self._stage):
            self._stage[: self._hi - self._lo] = self._stage[self._lo : self._hi]
            self._hi -= self._lo
            self._lo = 0
        return self._view[self._hi :] if self._hi else self._view  # (no slice: the most)

    def received(self, nbytes: int) -> bool:
        """``nbytes`` went into ``room()``; True if they completed the payload (``finish``)."""
        if self.payload is not None:
            self.filled += nbytes
            return self.filled == len(self.payload)
        self._hi += nbytes
        return False

    def next_header(self) -> Header | None:
        """The current frame's header once it and its name are staged; None while more bytes
        are needed or its payload is being landed. It stays current until settled."""
        header = self.header
        if header is None:
            if self._hi - self._lo < HEADER.size:
                return None
            self._name_len, header = parse_header(self._view[self._lo : self._lo + HEADER.size])
            self._lo += HEADER.size
            self.header = header
        elif self.payload is not None:
            return None
        if self._name_len:
            if self._hi - self._lo < self._name_len:
                return None
            header.name = bytes(self._view[self._lo : self._lo + self._name_len])
            self._lo += self._name_len
            self._name_len = 0
        return header

    def staged_payload(self, size: int) -> memoryview | None:
        """The current frame's ``size``-byte payload where it lies in the staging buffer, if it
        is all staged (valid until the next ``room()``), else None."""
        if self._hi - self._lo < size:
            return None
        return self._view[self._lo : self._lo + size]

    def skip(self, nbytes: int = 0) -> None:
        """Settle the current frame: ``nbytes`` of staged payload were consumed where they lie."""
        self._lo += nbytes
        self.header = None

    def land(self, dest: memoryview) -> bool:
        """Settle the current frame's payload into ``dest`` (exactly its size); True if all of
        it was staged already."""
        take = min(len(dest), self._hi - self._lo)
        dest[:take] = self._view[self._lo : self._lo + take]
        self._lo += take
        self.payload, self.filled = dest, take
        return take == len(dest)

    def finish(self) -> memoryview:
        """The whole payload of the current frame (read ``header`` first); the reader moves on
        to the next header. (No tuple: nothing is allocated per frame.)"""
        payload = self.payload
        assert payload is not None
        self.header, self.payload, self.filled = None, None, 0
        return payload

    def divert(self) -> None:
        """Land the rest of the current payload in a private buffer instead of ``dest``."""
        if self.payload is not None:
            self.payload = memoryview(bytearray(len(self.payload)))

    def between_frames(self) -> bool:
        """No frame begun and nothing staged: the stream may end here in good order."""
        return self.header is None and self._lo == self._hi
