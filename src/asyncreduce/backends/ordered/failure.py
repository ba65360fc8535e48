"""Failure in the ordered engine: the BREAK message, and failed operations that stay offered.

Theory of operation. Failure is sticky: the first one breaks the communicator on this rank,
and a BREAK message (error class code, the key of the operation it is about, the reason) tells
every peer, which fails that operation with the same class (``MismatchError``,
``TimeoutError``, else ``BrokenError``) and breaks too.

A failed request does not take its operation back from the peers. Once this rank offered it
to the agreement, the peers may still agree it, and then they need this rank in the engine
call (MPI has no cancel for collectives). So a failed operation stays offered, a "zombie":
it is moved onto a scratch copy of its memory (``run_on_scratch``), which the caller's buffer
is free of from the moment its request failed, and runs there for the peers' sake.
"""

from __future__ import annotations

import logging
import struct
from typing import Any

import numpy as np

from ...errors import BrokenError
from ...keys import Key
from ...protocol.wire import BROKEN_CODE, ERROR_CLASSES, ERROR_CODES
from .posted import Posted

__all__ = ["break_error", "break_message", "read_break", "run_on_scratch"]

log = logging.getLogger("asyncreduce.ordered")
_BREAK_HEAD = struct.Struct("<BHQ")  # error class code, key name length, key instance
_REASON_BYTES = 4096


def break_message(error: BaseException, about: Key | None) -> bytes:
    """The BREAK body for ``error``, about operation ``about`` (None: no one operation)."""
    name, instance = about if about is not None else (b"", 0)
    code = ERROR_CODES.get(type(error), BROKEN_CODE)  # type: ignore[arg-type]
    return _BREAK_HEAD.pack(code, len(name), instance) + name + str(error).encode()[:_REASON_BYTES]


def read_break(peer: int, body: bytes) -> tuple[int, Key, str]:
    """(error class code, key, reason) of ``peer``'s BREAK; BrokenError if malformed."""
    if len(body) < _BREAK_HEAD.size:
        raise BrokenError(f"rank {peer} sent a BREAK message of {len(body)} bytes")
    code, size, instance = _BREAK_HEAD.unpack_from(body)
    name = body[_BREAK_HEAD.size : _BREAK_HEAD.size + size]
    reason = body[_BREAK_HEAD.size + size :].decode(errors="replace")
    return code, (name, instance), reason


def break_error(code: int, peer: int, label: str | None, reason: str) -> Exception:
    """The error this rank fails with when ``peer`` broke with ``code`` about ``label``."""
    cls = ERROR_CLASSES.get(code, BrokenError)
    return cls(f"{label or 'an operation'} failed on rank {peer}: {reason}"
               if code != BROKEN_CODE else f"rank {peer} broke: {reason}")  # fmt: skip


def run_on_scratch(op: Posted, rank: int) -> None:
    """Move ``op`` (failed, still offered) onto scratch copies of its memory."""
    try:
        op.flat = _scratch(op.flat, op.ready)
        op.sends = {p: _scratch(a) for p, a in (op.sends or {}).items()}
        op.recvs = {p: _scratch(a) for p, a in (op.recvs or {}).items()}
    except Exception as exc:  # (out of memory): then it cannot run for anybody
        log.error("rank %d: no scratch copy of %s: %s", rank, op.label, exc)


def _scratch(flat: Any, ready: Any = None) -> Any:
    """A copy of an operation's memory to run it on once its caller has been told it failed
    (a device tensor: copied after its producer's kernels, on this thread's stream)."""
    if isinstance(flat, np.ndarray):
        return flat.copy()
    if ready is not None:
        import torch

        torch.cuda.current_stream(flat.device).wait_event(ready)
    return flat.clone()
