"""What the protocol says on the wire: descriptors worded, and the control messages as types.

Everything that affects how a control message is written into a frame lives here. A frame's
header has generic fields (``name``/``instance``, ``step``, ``seg``, a payload); each control
message below is a small type, and the table below (kept by ``encode`` and ``decode``, the
only code that reads or writes these fields) says which frame type
carries it and which fields hold what. So a field means one thing per message, and the session
never reads ``seg`` or ``instance`` itself:

    message     frame type   key (name, instance)   seg              payload
    Beat        HEARTBEAT    -                      -                -
    Hold        FLOW         - (instance 1)         -                -
    Resume      FLOW         - (instance 2)         -                -
    PostNotice  INQUIRY      the operation          POSTED           -
    Ask         INQUIRY      the operation          ASK              -
    Answer      INQUIRY      the operation          the answer       -
    Failed      ERROR        the operation          the error class  the reason (UTF-8)
    Abort       ABORT        - (instance: epoch)    -                the reason (UTF-8)
    Agree       AGREE        - (instance: epoch)    -                membership.py's bytes

DATA frames are the algorithms' (``step``/``seg`` name a message inside the operation), and
GOODBYE is the transport's closing handshake; neither is a control message here.
"""

from __future__ import annotations

from typing import NamedTuple

from ..algorithms import CROSS_MEMORY, DTYPE_BY_CODE, KINDS, REDUCTION_CODES
from ..errors import BrokenError, MismatchError
from ..transport.frame import (
    ABORT,
    AGREE,
    DATA,
    ERROR,
    FLOW,
    HEARTBEAT,
    INQUIRY,
    MAX_ERROR_BYTES,
    Descriptor,
    Header,
    pack_header,
)

__all__ = [
    "ON_DEVICE", "Key", "data_head", "describe", "mismatch_hint", "payload_bytes",
    "ASK", "PENDING", "NOT_POSTED", "DONE", "FAILED", "POSTED", "ANSWERS",
    "Beat", "Hold", "Resume", "PostNotice", "Ask", "Answer", "Failed", "Abort", "Agree",
    "Control",
    "encode", "decode", "NO_DESC",
]  # fmt: skip

Key = tuple[bytes, int]
NO_DESC = Descriptor(0, 0, 0, 0, 0)

#: Added to a descriptor's dtype code for memory on a device (ordered backends: a CUDA tensor on
#: one rank against host memory on another is a mismatch, not two different engine calls).
ON_DEVICE = 64

# INQUIRY's ``seg``: a question, its answers, and flow control's "posted here".
ASK = 0
PENDING, NOT_POSTED, DONE, FAILED = 1, 2, 3, 4
POSTED = 5
ANSWERS = {PENDING: "pending", NOT_POSTED: "not posted", DONE: "done", FAILED: "failed"}

#: ERROR's ``seg``: the class the operation fails with on the receiver too.
ERROR_CLASSES: dict[int, type[Exception]] = {1: MismatchError, 2: TimeoutError, 3: BrokenError}
ERROR_CODES = {cls: code for code, cls in ERROR_CLASSES.items()}
BROKEN_CODE = ERROR_CODES[BrokenError]  # also: a rank that broke, not one operation that failed

_KIND_NAMES = {code: name for name, code in KINDS.items()}
_DTYPE_NAMES = {code: dtype.name for code, dtype in DTYPE_BY_CODE.items()}
_REDUCE_NAMES = {0: "", **{code: name for name, code in REDUCTION_CODES.items()}}


class Beat(NamedTuple):
    """ "Still here": sent to every peer once a beat, so silence means trouble."""


class Hold(NamedTuple):
    """ "I hold too much of yours: from now on send me only what I posted" (back-pressure)."""


class Resume(NamedTuple):
    """ "I hold little of yours again: send me everything as it comes" (ends a ``Hold``)."""


class PostNotice(NamedTuple):
    """ "I posted this operation: you may send me its frames" (to a peer told to hold)."""

    key: Key
    desc: Descriptor


class Ask(NamedTuple):
    """The stall inspector's question: "what do you know of this operation?"."""

    key: Key
    desc: Descriptor


class Answer(NamedTuple):
    """The answer to ``Ask``: one of PENDING, NOT_POSTED, DONE, FAILED."""

    key: Key
    desc: Descriptor
    answer: int


class Failed(NamedTuple):
    """ "This operation failed here; fail it the same way" (an ERROR frame)."""

    key: Key
    desc: Descriptor
    error: type[Exception]
    reason: str


class Abort(NamedTuple):
    """ "My communicator broke, so must yours" (of membership ``epoch``: one that arrives
    after the survivors agreed on the next is old news)."""

    reason: str
    epoch: int = 0


class Agree(NamedTuple):
    """One message of the agreement on who is alive after membership ``epoch`` failed
    (``data``: protocol/membership.py's bytes, decoded and checked there)."""

    epoch: int
    data: bytes


Control = Beat | Hold | Resume | PostNotice | Ask | Answer | Failed | Abort | Agree

_BEAT = pack_header(HEARTBEAT, b"", 0, 0, 0, 0, NO_DESC)
_HOLD = pack_header(FLOW, b"", 1, 0, 0, 0, NO_DESC)
_RESUME = pack_header(FLOW, b"", 2, 0, 0, 0, NO_DESC)


def _reason_bytes(reason: str) -> bytes:
    return reason.encode()[:MAX_ERROR_BYTES]


def encode(message: Control) -> tuple[bytes, bytes]:
    """The frame (header and name, payload) that carries ``message``."""
    if isinstance(message, Beat):
        return _BEAT, b""
    if isinstance(message, Hold):
        return _HOLD, b""
    if isinstance(message, Resume):
        return _RESUME, b""
    if isinstance(message, Abort):
        reason = _reason_bytes(message.reason)
        return pack_header(ABORT, b"", message.epoch, 0, 0, len(reason), NO_DESC), reason
    if isinstance(message, Agree):
        data = message.data
        return pack_header(AGREE, b"", message.epoch, 0, 0, len(data), NO_DESC), data
    (name, instance), desc = message.key, message.desc
    if isinstance(message, Failed):
        reason = _reason_bytes(message.reason)
        code = ERROR_CODES.get(message.error, BROKEN_CODE)
        return pack_header(ERROR, name, instance, 0, code, len(reason), desc), reason
    seg = POSTED if isinstance(message, PostNotice) else ASK if isinstance(message, Ask) else 0
    if isinstance(message, Answer):
        seg = message.answer
    return pack_header(INQUIRY, name, instance, 0, seg, 0, desc), b""


def decode(header: Header, payload: memoryview | bytes) -> Control | None:
    """The control message a checked frame carries; None for frames that carry none (DATA,
    GOODBYE) and for INQUIRY codes this rank does not know (ignored, as before)."""
    kind = header.type
    if kind == HEARTBEAT:
        return Beat()
    if kind == FLOW:
        return Hold() if header.instance == 1 else Resume() if header.instance == 2 else None
    if kind == ABORT:
        return Abort(bytes(payload).decode(errors="replace"), header.instance)
    if kind == AGREE:
        return Agree(header.instance, bytes(payload))
    if kind == ERROR:
        error = ERROR_CLASSES.get(header.seg, BrokenError)
        return Failed(header.key, header.desc, error, bytes(payload).decode(errors="replace"))
    if kind == INQUIRY:
        if header.seg == POSTED:
            return PostNotice(header.key, header.desc)
        if header.seg == ASK:
            return Ask(header.key, header.desc)
        return Answer(header.key, header.desc, header.seg) if header.seg in ANSWERS else None
    return None


def describe(desc: Descriptor) -> str:
    """``allreduce float32[1000] sum`` (what a rank posted, for error messages)."""
    parts = [_KIND_NAMES.get(desc.kind, f"kind {desc.kind}")]
    dtype = _DTYPE_NAMES.get(desc.dtype) or _DTYPE_NAMES.get(desc.dtype - ON_DEVICE)
    where = " on a GPU" if desc.dtype not in _DTYPE_NAMES and dtype else ""
    parts.append(f"{dtype or f'dtype {desc.dtype}'}[{desc.count}]{where}")
    if _REDUCE_NAMES.get(desc.reduce):
        parts.append(_REDUCE_NAMES[desc.reduce])
    if desc.kind == KINDS["broadcast"]:
        parts.append(f"root={desc.root}")
    elif desc.kind == KINDS["allreduce"] and desc.root == CROSS_MEMORY:
        parts.append("read by cross-memory attach")
    elif desc.kind == KINDS["allreduce"] and desc.root:
        parts.append(f"in shared window {desc.root}")
    return " ".join(parts)


def mismatch_hint(mine: Descriptor, theirs: Descriptor) -> str:
    """What to do about a mismatch where the only difference is where the buffers live."""
    allreduces = mine.kind == theirs.kind == KINDS["allreduce"]
    if allreduces and mine._replace(root=0) == theirs._replace(root=0):
        return (
            ": allocate that buffer with comm.shared_empty on every rank, or on none (a "
            "window's number must match too: call shared_empty in the same order everywhere)"
        )
    return ""


def data_head(key: Key, step: int, seg: int, nbytes: int, desc: Descriptor) -> bytes:
    """The header and name of one DATA frame of operation ``key``: what the session sends, and
    what a direct run (``Engine.run_direct``) sends and expects from its partners byte for byte."""
    return pack_header(DATA, key[0], key[1], step, seg, nbytes, desc)


def payload_bytes(desc: Descriptor) -> int:
    """The bytes of an operation's buffer, as its descriptor says."""
    dtype = DTYPE_BY_CODE.get(desc.dtype)
    return desc.count * (dtype.itemsize if dtype is not None else 1)
