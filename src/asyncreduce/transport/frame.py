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
to send from now on only the frames of operations the sender has posted (back-pressure). A
DATA frame with the SHM flag has its payload in the sender's arena (see shm.py).
Every field is checked against its bounds by ``parse_header`` before use.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final, NamedTuple

__all__ = [
    "DATA",
    "ERROR",
    "GOODBYE",
    "CREDIT",
    "HEARTBEAT",
    "ABORT",
    "INQUIRY",
    "FLOW",
    "FLAG_SHM",
    "with_flags",
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
VERSION: Final = 1
DATA: Final = 1
ERROR: Final = 2
GOODBYE: Final = 3
CREDIT: Final = 4
HEARTBEAT: Final = 5  # "still here": sent to every peer about once a second
ABORT: Final = 6  # "my communicator broke, and so must yours": the reason is the payload
INQUIRY: Final = 7  # the stall inspector: "what do you know of this key?" and its answer
FLOW: Final = 8  # back-pressure: "from now on, send me only what I posted" (instance 1)
_UNKEYED: Final = (GOODBYE, CREDIT, HEARTBEAT, ABORT, FLOW)
FLAG_SHM: Final = 1  # the payload is in the sender's shared-memory arena, not on the wire
_FLAGS_AT: Final = 35  # byte offset of the flags in a packed header
HEADER: Final = struct.Struct("<4sBBHIIQQBBBBIQ")
MAX_NAME_BYTES: Final = 1024
MAX_PAYLOAD_BYTES: Final = 1 << 30
MAX_ERROR_BYTES: Final = 64 << 10
MAX_STEP: Final = 1 << 20
_KIND_CODES: Final = range(1, 11)  # algorithms.KINDS
_DTYPE_CODES: Final = range(1, 13)  # algorithms.DTYPES
_REDUCE_CODES: Final = range(0, 9)  # 0: none, else algorithms.REDUCTION_CODES


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
    if ftype not in (DATA, ERROR, GOODBYE, CREDIT, HEARTBEAT, ABORT, INQUIRY, FLOW):
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
