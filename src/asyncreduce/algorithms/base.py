"""The sans-IO contract every collective algorithm follows.

A collective on one rank is a state machine with no sockets, threads or clocks:

* ``start()`` returns the first messages to send;
* for each arriving message the caller asks ``recv_buffer(src, step, seg, nbytes)`` where its
  payload must be written (often the final destination, so nothing is copied), writes it there,
  then calls ``on_message(src, step, seg, payload)``, which returns the next messages to send;
* ``work()`` does one unit of the rank's own work while ``has_work`` (most algorithms do all
  of theirs inside ``on_message`` and never have any);
* ``done`` is true once every expected message has been consumed and no work is left.

Messages are named by ``(src, step, seg)``; they may arrive in any order, across sources and
across steps, and each algorithm either does not care or holds early ones until their turn.
A buffer returned by ``recv_buffer`` for one source stays valid until ``on_message`` for that
message returns and the next ``recv_buffer`` for the same source is asked. A payload handed
out in a ``Send`` stays untouched by the algorithm until the operation is done; the caller
must not report completion before every send has left (the engine counts them).

An unexpected message (wrong source, step, segment or size, or a duplicate) raises
``ProtocolError``: the peers disagree about the operation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple, Protocol

import numpy as np
from numpy.typing import NDArray

from ..kernels.fold import Combining, Swap

__all__ = ["Send", "Collective", "PeerMemoryError", "ProtocolError", "RunsDirectly", "split",
           "segments", "SEGMENT_BYTES"]  # fmt: skip

#: Bytes per message of the pipelined algorithms: small enough that sending, receiving and
#: reducing overlap, large enough that per-message overhead stays small.
SEGMENT_BYTES = 2 << 20

Array = NDArray[np.generic]


class ProtocolError(Exception):
    """A message the algorithm did not expect: the ranks disagree about the operation."""


class PeerMemoryError(OSError):
    """A peer's buffer could not be read in place (it died, or announced memory it does not
    have): raised by a ``PeerMemory`` (samehost/cma.py), caught by the Session."""


class Send(NamedTuple):
    """One message to send: to rank ``dst``, named ``(step, seg)``, carrying ``payload``."""

    dst: int
    step: int
    seg: int
    payload: Array


class Collective(ABC):
    """One rank's side of one collective operation."""

    def __init__(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self._expected = 0
        self._received = 0

    @property
    def done(self) -> bool:
        return self._received == self._expected

    @property
    def has_work(self) -> bool:
        """Whether ``work`` has something to do now (see ``work``)."""
        return False

    def work(self) -> list[Send]:
        """Do one unit of this rank's own work (say, reduce one segment) and return what to
        send. An algorithm whose steps are heavy leaves them here instead of doing them in
        ``on_message``, so that the caller can do them in pieces, between messages, the most
        urgent operation's first; the caller calls it while ``has_work``."""
        return []

    @property
    def pending_sources(self) -> set[int]:
        """Ranks this algorithm still waits on (for error messages); may over-approximate."""
        return set() if self.done else set(range(self.world_size)) - {self.rank}

    @abstractmethod
    def start(self) -> list[Send]:
        """The first messages; called once."""

    @abstractmethod
    def recv_buffer(self, src: int, step: int, seg: int, nbytes: int) -> Array:
        """Where the payload of message (src, step, seg) goes; ProtocolError if unexpected."""

    @abstractmethod
    def on_message(self, src: int, step: int, seg: int, payload: Array) -> list[Send]:
        """Consume one message whose payload now lies in ``payload``; return what to send next."""

    def takes_view(self, src: int, step: int, seg: int) -> bool:
        """Whether message (src, step, seg) is better consumed straight from where it arrived
        (a shared-memory arena, the transport's receive staging) with ``on_view`` than copied
        into ``recv_buffer`` first."""
        return False

    def on_view(self, src: int, step: int, seg: int, view: memoryview) -> list[Send]:
        """Consume a message whose payload is readable in ``view`` only during this call."""
        target = self.recv_buffer(src, step, seg, view.nbytes)
        np.frombuffer(memoryview(target).cast("B"), np.uint8)[:] = np.frombuffer(view, np.uint8)  # type: ignore[arg-type]
        return self.on_message(src, step, seg, target)

    swaps: tuple[Swap, ...] | None = None  # (RunsDirectly: message by message, but where
    # an algorithm says otherwise)

    @property
    def algorithm(self) -> Collective:
        """(``RunsDirectly``) Itself."""
        return self

    @property
    def combining(self) -> Combining | None:
        raise ProtocolError(f"{type(self).__name__} has no swaps")

    def swapped(self, done: int) -> list[Send]:
        raise ProtocolError(f"{type(self).__name__} has no swaps")

    def _check_size(self, what: str, buffer: Array, nbytes: int) -> Array:
        if buffer.nbytes != nbytes:
            raise ProtocolError(f"{what}: expected {buffer.nbytes} bytes, got {nbytes}")
        return buffer


class RunsDirectly(Protocol):
    """An algorithm a caller may run itself, message by message, on its own thread
    (``Engine.run_direct``): every message it receives is one of ``message_bytes``, named as the
    message it sends in the same step (so the caller knows the frame to look for), and
    it says which one it needs next."""

    @property
    def partners(self) -> frozenset[int]:
        """Every rank it sends to or receives from."""

    @property
    def sources(self) -> frozenset[int]:
        """The ranks it receives from (whose streams the caller reads itself)."""

    @property
    def message_bytes(self) -> int:
        """What each message it sends or receives carries."""

    @property
    def awaited(self) -> tuple[int, int] | None:
        """(the rank, the step) of the message it needs next; None once done."""

    def start(self) -> list[Send]: ...

    def on_view(self, src: int, step: int, seg: int, view: memoryview) -> list[Send]: ...

    @property
    def swaps(self) -> tuple[Swap, ...] | None:
        """Where every step is a swap of the buffer with one partner, combined into it as it
        arrives (a power of two ranks of recursive doubling): those steps in order, which
        the caller may run itself (in C: ``Transport.swaps``) and then tell ``swapped``.
        None: message by message (``start``, ``awaited``, ``on_view``)."""

    @property
    def combining(self) -> Combining | None:
        """How each of ``swaps`` combines what it receives (only where there are swaps);
        None: its messages are empty, nothing to combine (a barrier)."""

    def swapped(self, done: int) -> list[Send]:
        """The first ``done`` of ``swaps`` ran, and the next one's message left (if any):
        what to send now; ``awaited`` and ``on_view`` go on from there (``algorithm``'s)."""

    @property
    def algorithm(self) -> Collective:
        """The algorithm an operation that the caller does not run to the end hands the
        engine: itself, or, for a stand-in that holds only what a direct run's swaps need
        (``DirectAllreduce``), the real one, made then."""


def split(count: int, parts: int) -> list[tuple[int, int]]:
    """Cut ``count`` elements into ``parts`` contiguous ranges, sizes differing by at most one."""
    base, extra = divmod(count, parts)
    bounds = []
    start = 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def segments(start: int, stop: int, segment_elems: int) -> list[tuple[int, int]]:
    """Cut [start, stop) into pieces of ``segment_elems``; an empty range is one empty segment,
    so every step of an algorithm sends at least one message (which carries the descriptor)."""
    if stop <= start:
        return [(start, start)]
    return [(s, min(s + segment_elems, stop)) for s in range(start, stop, segment_elems)]
