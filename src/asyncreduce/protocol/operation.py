"""One posted operation as the protocol drives it, the settings that tune the protocol, and the
recycled buffers that frames arriving before their operation land in.

An ``Operation`` is built by the posting thread (its key, descriptor, algorithm state machine
and request) and from then on touched only by the engine thread. ``unsent`` counts the frames
handed to the transport that have not left yet: an operation completes only when its algorithm
is done and ``unsent`` is 0, so the caller may reuse its buffer at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ..algorithms import Array, Collective
from ..envvars import env_number
from ..flight import Record
from .posting import Posting

__all__ = ["Operation", "Settings", "Spares", "bytes_of"]


@dataclass(eq=False)
class Operation(Posting):
    """One posted operation, as the engine drives it: its core (``Posting``), its algorithm
    and how far it is."""

    algo: Collective
    priority: int = 0
    unsent: int = 0
    deadline: float = field(default=0.0, init=False)
    age: int = field(default=0, init=False)  # start order here: older operations' frames first
    posted_at: float = field(default=0.0, init=False)  # wall clock, set by Engine.submit
    started: float = field(default=0.0, init=False)  # monotonic, for the stall inspector
    small: bool = field(default=False, init=False)  # latency-bound (see Engine._poll)
    ended: bool = field(default=False, init=False)  # its request was given its outcome
    dropped_for: int = field(default=-1, init=False)  # a departed rank it had a frame for
    record: Record | None = field(default=None, init=False)
    announce: bool = field(default=False, init=False)  # tell every peer it runs here (lane)


@dataclass(frozen=True)
class Settings:
    """How an engine watches over its peers; ``from_env`` reads the ASYNCREDUCE_* variables."""

    peer_timeout: float = 30.0  # a rank silent this long (no frame, no heartbeat) is dead
    stall_warning: float = 60.0  # warn about an operation pending this long (0: never)
    held_bytes: int = 1 << 30  # frames held for operations not posted here, before pausing
    flight_records: int = 1000  # operations the flight recorder keeps
    flight_dir: str | None = None  # where the flight record is written when the engine breaks
    spin: float = 250e-6  # busy-poll this long after a small operation's last event (0: never)
    direct: bool = True  # a blocking small allreduce may run on its caller's thread (run_direct)

    @classmethod
    def from_env(cls) -> Settings:
        """Read ASYNCREDUCE_PEER_TIMEOUT, _STALL_WARNING, _HELD_BYTES, _FLIGHT_RECORDS,
        _FLIGHT_DIR, _SPIN_US and _DIRECT (0: off); a value that is not a number is an error
        naming the variable."""
        return cls(
            peer_timeout=env_number("ASYNCREDUCE_PEER_TIMEOUT", cls.peer_timeout, float, 0.05),
            stall_warning=env_number("ASYNCREDUCE_STALL_WARNING", cls.stall_warning, float, 0),
            held_bytes=env_number("ASYNCREDUCE_HELD_BYTES", cls.held_bytes, int, 0),
            flight_records=env_number("ASYNCREDUCE_FLIGHT_RECORDS", cls.flight_records, int, 1),
            flight_dir=os.environ.get("ASYNCREDUCE_FLIGHT_DIR") or None,
            spin=env_number("ASYNCREDUCE_SPIN_US", cls.spin * 1e6, float, 0) / 1e6,
            direct=os.environ.get("ASYNCREDUCE_DIRECT", "1") != "0",
        )


class Spares:
    """Recycled payload buffers for frames that arrive before their operation is posted.

    Such frames are common when ranks run back-to-back operations; a fresh buffer per frame
    would cost a memset and page faults each time.
    """

    def __init__(self, limit: int) -> None:
        self._free: dict[int, list[memoryview]] = {}
        self._bytes = 0
        self._limit = limit

    def take(self, size: int) -> memoryview:
        free = self._free.get(size)
        if free:
            self._bytes -= size
            return free.pop()
        return bytes_of(np.empty(size, np.uint8))

    def give(self, buffer: memoryview) -> None:
        size = buffer.nbytes
        if size and self._bytes + size <= self._limit and not buffer.readonly:
            self._free.setdefault(size, []).append(buffer)
            self._bytes += size


def bytes_of(array: Array) -> memoryview:
    """The bytes of a contiguous array, writable where the array is."""
    return memoryview(array).cast("B")  # type: ignore[arg-type]
