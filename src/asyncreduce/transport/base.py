"""What every transport offers the engine, and what the engine offers back.

A transport moves frames between ranks and nothing else: it knows no operations. The engine's
thread is the only caller of every method but ``wakeup`` (any thread may call that one), so a
transport needs no locks. Received frames are handed to a ``FrameSink``: the transport first
asks where the payload should go (so it can land straight in its final place), then reports
the complete frame. Frames to one peer leave in priority order (highest first, then in order
of sending) and never interleave below frame granularity; a peer that fails is reported once.
A peer that said GOODBYE and then closes is not a failure: closing is a handshake (GOODBYE,
half-close, read to EOF) so no byte in flight is lost and no connection is reset.
A transport may also let the thread that holds the loop move one small frame each way around
its queue and its reader (``quiet``, ``take_frame``: see ``Engine.run_direct``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import TYPE_CHECKING, Final, Protocol

from .frame import Header, with_step

if TYPE_CHECKING:
    from ..kernels.fold import Combining, Swap

__all__ = ["COMBINED", "ELSEWHERE", "FrameSink", "Transport"]

#: What ``take_frame`` returns when the stream holds something else first.
ELSEWHERE: Final = memoryview(b"")
#: What ``swap`` returns for a frame it took and combined as it was asked to.
COMBINED: Final = memoryview(bytearray(0))


class FrameSink(Protocol):
    def frame_buffer(self, peer: int, header: Header) -> memoryview | None:
        """A writable byte buffer of exactly ``header.payload_len`` bytes, or None for a new one."""

    def frame_view(self, peer: int, header: Header, view: memoryview) -> bool:
        """Consume a payload straight from where it lies (shared memory, or the transport's
        receive staging; valid only during the call); False asks for the usual path
        (``frame_buffer``, a copy, ``on_frame``)."""

    def on_frame(self, peer: int, header: Header, payload: memoryview) -> None:
        """A complete frame from ``peer``; ``payload`` is the buffer given by frame_buffer."""

    def on_sent(self, token: object) -> None:
        """The frame sent with ``token`` has left this process (its payload may be reused)."""

    def on_peer_lost(self, peer: int, error: BaseException) -> None:
        """The connection to ``peer`` is gone (closed, reset, or a frame broke the protocol)."""


class Transport(ABC):
    """Framed, ordered, prioritised messages to every other rank of one communicator."""

    @abstractmethod
    def send(
        self,
        peer: int,
        head: bytes,
        payload: memoryview,
        priority: int,
        token: object,
        age: int = 0,
    ) -> None:
        """Queue one frame (``head`` = header and name bytes) for ``peer``; never blocks.
        Frames leave by priority (highest first), then age (lowest first), then in order. To
        a peer whose connection is gone the frame is dropped and reported sent at once, like
        the frames queued when it went; KeyError for a rank that was never connected."""

    @abstractmethod
    def poll(self, timeout: float | None, unread: Collection[int] = ()) -> None:
        """Move bytes for up to ``timeout`` seconds, calling the sink; returns early on wakeup.
        What the ranks in ``unread`` sent stays where it is (a direct run takes it)."""

    @abstractmethod
    def wakeup(self) -> None:
        """Make a ``poll`` in progress return soon. Safe from any thread."""

    @abstractmethod
    def drop(self, token: object) -> None:
        """Stop using the buffers of the frames sent with ``token``: forget those not yet
        leaving, copy what remains of those half sent (the stream must stay whole)."""

    @abstractmethod
    def withdraw(self, peer: int) -> list[tuple[bytes, memoryview, object]]:
        """Take back the frames queued for ``peer`` that have not started to leave, except
        control frames (no token), in sending order: (head, payload, token). Their ``on_sent``
        will not come; whoever sends them again later gets it then."""

    @abstractmethod
    def divert(self, peer: int) -> None:
        """Receive the rest of the payload arriving from ``peer`` into a private buffer."""

    @abstractmethod
    def send_goodbye(self, reason: bytes) -> None:
        """Tell every peer this rank is closing (and why), then half-close each connection."""

    @abstractmethod
    def release(self, peer: int) -> None:
        """``peer`` said goodbye: drop what is queued for it (reported as sent) and half-close."""

    @abstractmethod
    def open_peers(self) -> int:
        """How many connections are still open (closing waits for this to reach zero)."""

    @abstractmethod
    def close(self) -> None:
        """Close every connection and descriptor this transport owns."""

    def quiet(self, peer: int, nbytes: int) -> bool:
        """Whether a frame of ``nbytes`` may go to ``peer`` straight into its connection and
        one come back through ``take_frame``: nothing is queued for it or being written, and
        nothing of its stream has been read but not yet settled. A transport that cannot do
        that says False, and every frame takes its queue and its reader."""
        return False

    def send_now(self, peer: int, head: bytes, payload: memoryview, priority: int) -> bool:
        """``send`` to a ``quiet`` peer, for a caller that goes on only if the frame left
        whole (``Engine.run_direct``): whether it did (what did not is queued and written as
        ``send``'s frames are)."""
        self.send(peer, head, payload, priority, None)
        return self.quiet(peer, 0)

    def swap(
        self, peer: int, head: bytes, payload: memoryview, priority: int, seconds: float = 0.0,
        combining: Combining | None = None, incoming_first: bool = False,
    ) -> memoryview | None:  # fmt: skip
        """A step of a symmetric exchange with a ``quiet`` peer: ``send_now`` this frame, then
        ``take_frame`` the peer's, which has the same ``head`` and size. ``ELSEWHERE`` also
        where this frame did not leave whole (what did not is copied and queued, as
        ``send_now``'s: ``payload`` may be the caller's buffer, which it changes next).
        ``COMBINED`` where the transport took the frame and combined its payload as
        ``combining`` says (in C, as it arrived; the peer's operand first where
        ``incoming_first``); one that cannot returns the payload."""
        if not self.send_now(peer, head, memoryview(bytes(payload)), priority):
            return ELSEWHERE  # (a copy: the caller's buffer changes once this returns)
        return self.take_frame(peer, head, payload.nbytes, seconds)

    def swaps(
        self, steps: tuple[Swap, ...], head: bytes, payload: memoryview, priority: int,
        seconds: float = 0.0, combining: Combining | None = None,
    ) -> tuple[int, memoryview | None]:  # fmt: skip
        """``swap`` for each of ``steps`` in a row, with its peer, its step in ``head`` (the
        first step's header; ``with_step``) and its order of operands, each only once the one
        before ended well (``COMBINED``; an empty message's frame taken where nothing
        combines): how many did, and what the next one returned (``COMBINED`` after them
        all). A transport that can makes them all in one call into C. Only for ``quiet``
        peers, as ``swap``: the caller looked, and nothing here looks again."""
        for done, (peer, step, incoming_first) in enumerate(steps):
            step_head = with_step(head, step) if done else head
            view = self.swap(peer, step_head, payload, priority, seconds, combining,
                             incoming_first)  # fmt: skip
            if view is not COMBINED and (combining or view is None or view is ELSEWHERE):
                return done, view
        return len(steps), COMBINED

    def take_frame(
        self, peer: int, head: bytes, size: int, seconds: float = 0.0
    ) -> memoryview | None:
        """The ``size``-byte payload of the next frame from ``peer`` if that frame is all here
        and its header and name are exactly ``head``, taken off the stream (readable until
        the next call); None while it is not all here (after looking for up to ``seconds``,
        where the transport can look without the GIL; once at least); ``ELSEWHERE`` if the
        stream holds anything else first (another frame, its end, an error), which ``poll``
        must read. Only for a ``quiet`` peer."""
        return ELSEWHERE
