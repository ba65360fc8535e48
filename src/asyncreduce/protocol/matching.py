"""Matching by key: which operations are posted here, which frames wait for theirs, and what is
remembered of operations that ended (to judge the frames that come late for them).

A frame names its operation ``(name, instance)``. If that operation is posted here its payload
lands straight in the algorithm's buffer; otherwise the frame waits in the unexpected queue, in
a recycled buffer (``Spares``), until the operation is posted. The descriptors of completed
operations and the errors of failed ones are kept (bounded), so a frame that comes after its
operation ended is told apart from one that comes before it started.
"""

from __future__ import annotations

from collections import OrderedDict

from ..transport.frame import Descriptor, Header
from .operation import Operation, Spares
from .wire import DONE, FAILED, NOT_POSTED, PENDING, Key

__all__ = ["Matching", "Held"]

FORGET_AFTER = 4096  # how many ended keys are remembered, to judge their late frames
SPARE_BYTES = 64 << 20  # recycled buffers kept for frames that arrive before their operation

Held = tuple[int, Header, memoryview]  # (peer, header, payload) of a frame kept for later


class Matching:
    """Operations by key, the unexpected queue, and the memory of ended operations."""

    def __init__(self) -> None:
        self.ops: dict[Key, Operation] = {}
        self.unexpected: dict[Key, list[Held]] = {}
        self.unexpected_bytes = 0  # payload bytes in ``unexpected``
        self.failed: OrderedDict[Key, BaseException] = OrderedDict()
        self.done: OrderedDict[Key, Descriptor] = OrderedDict()
        self.spares = Spares(SPARE_BYTES)

    def live(self, op: Operation) -> bool:
        """Whether ``op`` is the operation posted under its key (not ended, not replaced)."""
        return self.ops.get(op.key) is op

    def keep(self, peer: int, header: Header, payload: memoryview) -> None:
        """Keep a frame for an operation not posted here (yet)."""
        self.unexpected.setdefault(header.key, []).append((peer, header, payload))
        self.unexpected_bytes += payload.nbytes

    def take_kept(self, key: Key) -> list[Held]:
        """The frames kept for ``key``, in arrival order; they are no longer counted."""
        held = self.unexpected.pop(key, None)
        if held is None:
            return []
        self.unexpected_bytes -= sum(p.nbytes for _, _, p in held)
        return held

    def completed(self, op: Operation) -> None:
        """``op`` completed: forget it, remember its descriptor (bounded)."""
        del self.ops[op.key]
        self.remember_done(op.key, op.desc)

    def remember_done(self, key: Key, desc: Descriptor) -> None:
        """``key`` completed (here, or around the session: ``Session.ran``); bounded."""
        self.done[key] = desc
        while len(self.done) > FORGET_AFTER:
            self.done.popitem(last=False)

    def failed_with(self, key: Key, error: BaseException) -> None:
        """``key`` failed: remember the error (bounded) and drop the frames kept for it."""
        self.failed[key] = error
        for _, _, payload in self.take_kept(key):
            self.spares.give(payload)
        while len(self.failed) > FORGET_AFTER:
            self.failed.popitem(last=False)

    def answer(self, key: Key) -> int:
        """What this rank knows of ``key``, for the stall inspector's question."""
        if key in self.ops:
            return PENDING
        if key in self.done:
            return DONE
        return FAILED if key in self.failed else NOT_POSTED
