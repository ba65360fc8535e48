"""One operation in the same-host lane, as the lane keeps it, and what the lane's two kinds of
operations (unnamed.py, named.py) ask of the lane that holds them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from ..buffers import Buffer
from ..flight import Record
from ..keys import Key
from ..protocol.posting import Posting
from ..request import Mover
from ..samehost.mailbox import HERE, header
from ..samehost.named import Found, found_for, key_words
from ..transport.frame import Descriptor

__all__ = ["LaneOp", "Shell"]

_NOT_LOOKED: Found = found_for(0)


class Shell(Mover, Protocol):
    """The lane, as its operations' kinds see it: their requests' mover, and when it moved."""

    moved_at: float
    rank: int


class LaneOp(Posting):
    """One small allreduce (or barrier) in the lane, unnamed or named: its core (``Posting``;
    its ``request`` set by ``Lane.post``, or where ``Lane.run_waiting`` needs one), and its slot
    (``header``: what the slot says, as the mailbox's words; ``deadline``: monotonic, 0 for
    none)."""

    __slots__ = ("seq", "header", "buf", "op", "deadline", "started", "record", "words", "slot",
                 "found")  # fmt: skip

    def __init__(
        self, key: Key, label: str, desc: Descriptor, buf: Buffer, op: str,
        result: Callable[[], Any], timeout: float | None, posted: float = 0.0,
    ) -> None:  # fmt: skip
        """``posted``: when it was posted (monotonic), where that was before now."""
        self.key, self.seq, self.label, self.desc = key, key[1], label, desc
        self.header = header(HERE, desc)
        self.buf, self.op, self.result = buf, op, result
        self.timeout = timeout
        self.started = posted or time.monotonic()
        self.deadline = 0.0 if timeout is None else self.started + timeout
        self.record: Record | None = None  # once watched (``Session.watch_outside``)
        if key[0]:  # a named one: found by key (named.py)
            self.words = key_words(*key)
            self.slot = -1
            self.found: Found = _NOT_LOOKED  # (``NamedOps.post`` gives it its own)
