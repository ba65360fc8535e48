"""What the ordered engine is given and what it gives the engines under it.

Theory of operation. A ``Posted`` operation is what the communicator hands over (the caller's
memory itself, no algorithm: the engine under us has its own); an ``Adapter`` (mpi.py,
torchdist.py) turns one, or a fused group of them, into an engine call and hands back a
``Running`` call that the ordered engine's thread tests without blocking until it is done.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...algorithms import DType
from ...flight import Record
from ...protocol.posting import Posting
from .channel import Endpoint

__all__ = ["Adapter", "Posted", "Running"]


@dataclass(eq=False)
class Posted(Posting):
    """One operation as the caller posted it: its core (``Posting``) and what the engine call
    needs."""

    kind: str
    flat: Any  # the caller's memory: a flat numpy array, or a torch tensor on a device
    dtype: DType
    op: str | None
    root: int
    priority: int = 0
    sends: dict[int, Any] | None = None  # exchanges and point-to-point: {peer: flat array}
    recvs: dict[int, Any] | None = None
    tag: int | None = None  # point-to-point only
    ready: Any = None  # a CUDA event recorded on the producer's stream at post
    record: Record | None = field(default=None, init=False)
    started: float = field(default_factory=time.monotonic, init=False)

    @property
    def deadline(self) -> float:
        """When it fails with TimeoutError (monotonic seconds; never without a ``timeout``)."""
        return self.started + (math.inf if self.timeout is None else self.timeout)


class Running(Protocol):
    """An engine call in flight: ``done`` tests it without blocking and raises its failure."""

    def done(self) -> bool: ...


class Adapter(Protocol):
    """What an engine offers the ordered engine (mpi.py, torchdist.py)."""

    name: str
    endpoint: Endpoint

    def start(self, op: Posted, flat: Any) -> Running:
        """Issue ``op``'s call over ``flat`` (its memory, or a fused scratch of several)."""
        ...

    def close(self, pending: bool) -> None:
        """Release the engine's resources (``pending``: calls are still in it)."""
        ...
