"""Quiet pairs: the direct run's mode of the TCP transport (as Gloo's sync pair is a mode of
its pair), with which a caller's thread sends a frame straight into an idle connection and takes
its partner's straight off the stream, the exact header expected or nothing
(engine/direct.py).

A connection is ``quiet`` when nothing is queued for it or being written, its reader stands
between frames, and no frame a look began waits. ``take_frame`` looks in C where it was built
(``_stream_core.take``: one receive per look, into the reader's staging buffer, without the
GIL), else in Python (a MSG_PEEK, then the same bytes taken off with MSG_TRUNC). What a look
took that is not the frame stays staged for the transport's next ``poll`` to parse
(``settle``); a frame a look began and its taker gave up on goes back to the reader the same
way. ``swap`` and ``swaps`` make a send, a look and the fold in one call into C.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..envvars import native_allowed
from ..samehost.shm import SHM_MIN_BYTES
from .base import COMBINED, ELSEWHERE
from .connection import Connection
from .frame import STEP_AT, FrameError, with_step

if TYPE_CHECKING:
    from ..kernels.fold import Combining, Swap

try:
    from ._stream_core import COMBINED as COMBINED_HERE
    from ._stream_core import FRAME, NOTHING, PART, UNSENT
    from ._stream_core import MAX_HEAD as NATIVE_MAX_HEAD
    from ._stream_core import combines as native_combines
    from ._stream_core import swap as native_swap
    from ._stream_core import swaps as native_swaps
    from ._stream_core import take as native_take
except ImportError:  # not built (no C compiler at set-up): the Python look alone
    native_take = native_swap = native_swaps = native_combines = None  # type: ignore[assignment]
    NATIVE_MAX_HEAD = 0  # type: ignore[misc]

__all__ = ["NOT_HERE", "QuietPairs", "native_take_wanted"]

NOT_HERE = object()  # ``swap``: not in C here; the caller does it as ``Transport.swap`` does
_SwapPlan = tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]


def native_take_wanted() -> bool:
    """Whether ``take_frame`` looks in C (``_stream_core``): it was built, and
    ASYNCREDUCE_NATIVE is not 0. Each rank on its own: the bytes on the wire are the same."""
    return native_take is not None and native_allowed()


class QuietPairs:
    """The quiet-pair mode over one transport's connections (see the module docstring)."""

    def __init__(
        self, peers: dict[int, Connection], sent: Callable[..., bool],
        lose: Callable[[Connection, BaseException], None], parse: Callable[[Connection], None],
    ) -> None:  # fmt: skip
        """``peers``: the transport's open connections (its own dict); ``sent``: its record of
        a frame an idle connection's sendmsg wrote in part or not at all; ``lose``: it ends a
        connection; ``parse``: it parses what a connection's staging buffer holds."""
        self._peers, self._sent, self._lose, self._parse = peers, sent, lose, parse
        self._taken = memoryview(bytearray(0))  # where take_frame looks (grown as needed)
        self.native = native_take_wanted()
        self._unparsed: list[Connection] = []  # connections with bytes take_frame staged
        self._begun: tuple[Connection, int] | None = None  # the frame take_frame has begun
        self._swap_plans: dict[tuple[Swap, ...], _SwapPlan] = {}  # swaps: their peers,
        # steps and orders of operands, as _stream_core.swaps takes them

    def settle(self) -> bool:
        """Before the transport's poll reads: a begun frame back to its reader, and what
        looks staged parsed; whether there was any (news: the poll then does not wait)."""
        self._settle_begun()
        if not self._unparsed:
            return False
        self._parse_unparsed()
        return True

    def quiet(self, peer: int, nbytes: int) -> bool:
        target = self._peers.get(peer)
        return (
            target is not None and not (target.queue or target.inflight or target.writing)
            and target.reader.between_frames() and not target.said_goodbye
            and (self._begun is None or self._begun[0] is not target)
            and (target.arena_out is None or nbytes < SHM_MIN_BYTES)  # (else it is flagged)
        )  # fmt: skip

    def swap(
        self, peer: int, head: bytes, payload: memoryview, priority: int, seconds: float = 0.0,
        combining: Combining | None = None, incoming_first: bool = False,
    ) -> memoryview | object | None:  # fmt: skip
        """(See Transport; ``NOT_HERE``: as ``Transport.swap`` does it instead.) In C where it
        was built (``_stream_core.swap``): the send, the
        look and the combine in one call, without the GIL; else, or where the connection is
        not idle or a begun frame waits, as ``Transport.swap`` does it (no combine)."""
        found_room = self._room_in_c(peer, len(head) + payload.nbytes, payload.nbytes)
        if found_room is None:
            return NOT_HERE
        target, room = found_room
        if combining is not None and native_combines(combining.dtype, combining.op):
            found, sent, n = native_swap(target.fd, head, payload, room, seconds, *combining,
                                         incoming_first)  # fmt: skip
        else:
            found, sent, n = native_swap(target.fd, head, payload, room, seconds)
        return self._swapped(target, head, payload, priority, room, found, sent, n)

    def _room_in_c(self, peer: int, whole: int, size: int) -> tuple[Connection, memoryview] | None:
        """The connection to ``peer`` and the room a swap in C takes its frame of ``whole``
        bytes (``size`` of payload) into, where it may: built, the connection idle, no begun
        frame waiting, the frame not one for the arena and not larger than the staging
        buffer."""
        target = self._peers.get(peer)
        if target is None or native_swap is None or not self.native or (
            target.queue or target.inflight or target.writing or self._begun is not None
            or (target.arena_out is not None and size >= SHM_MIN_BYTES)
        ):  # fmt: skip
            return None
        room = target.reader.room()  # (between frames: all of the staging buffer)
        return (target, room) if whole <= len(room) else None

    def _swapped(
        self, target: Connection, head: bytes, payload: memoryview, priority: int,
        room: memoryview, found: int, sent: int, n: int,
    ) -> memoryview | None:  # fmt: skip
        """What a swap in C found, for ``swap``: its frame's rest queued where it did not
        leave whole, else as ``take_frame``."""
        if found == UNSENT:
            error = OSError(-sent, os.strerror(-sent)) if sent < 0 else sent
            rest = memoryview(bytes(payload))  # (what is queued: the buffer changes next)
            self._sent(target, head, rest, None, (-priority, 0, 0), error)
            return ELSEWHERE
        if found == COMBINED_HERE:  # (a frame of no token left: nothing to report)
            return COMBINED
        return self._took(target, head, len(head) + payload.nbytes, room, found, n)

    def swaps(
        self, steps: tuple[Swap, ...], head: bytes, payload: memoryview, priority: int,
        seconds: float = 0.0, combining: Combining | None = None,
    ) -> tuple[int, memoryview | None] | None:  # fmt: skip
        """(See Transport; None: not here, ``swap`` by ``swap`` instead.) All in one call into C
        (``_stream_core.swaps``) where it was built, no begun frame waits and every
        step's staging buffer holds the frame (else, or where C does not combine the
        type, ``swap`` by ``swap``); a step that did not end well is then settled as
        ``swap`` settles its own. Every peer is ``quiet`` (the caller's look): that is
        not looked at again."""
        if native_swaps is None or not self.native or not steps or (
            self._begun is not None or len(head) > NATIVE_MAX_HEAD
            or (combining is not None and not native_combines(combining.dtype, combining.op))
        ):  # fmt: skip
            return None
        plan = self._swap_plans.get(steps)
        if plan is None:  # (a communicator's swaps are few, the same tuples each time)
            peers, numbers, firsts = zip(*steps, strict=True)
            plan = self._swap_plans[steps] = (peers, numbers, firsts)
        whole, fds, rooms = len(head) + payload.nbytes, [], []
        for peer in plan[0]:
            target = self._peers[peer]
            room = target.reader.room()  # (between frames: all of the staging buffer)
            if whole > len(room):
                return None
            fds.append(target.fd)
            rooms.append(room)
        done, found, sent, n = native_swaps(
            tuple(fds),
            tuple(rooms),
            plan[1],
            plan[2],
            head,
            STEP_AT,
            payload,
            seconds,
            *(combining or ()),
        )
        if done == len(steps):
            return done, COMBINED
        peer, step, _ = steps[done]
        return done, self._swapped(self._peers[peer], with_step(head, step), payload, priority,
                                   rooms[done], found, sent, n)  # fmt: skip

    def take_frame(
        self, peer: int, head: bytes, size: int, seconds: float = 0.0
    ) -> memoryview | None:
        """(See Transport.) In C where it was built (``_stream_core.take``): one receive per
        look, into the reader's staging buffer, up to ``seconds`` without the GIL; else in
        Python, one look: a look at the stream (MSG_PEEK), then, if it is the frame, the same
        bytes taken off it with no second copy (MSG_TRUNC discards on TCP)."""
        target = self._peers.get(peer)
        if target is None:
            return ELSEWHERE
        whole = len(head) + size
        if self.native:
            room = target.reader.room()  # (between frames: all of the staging buffer)
            if whole <= len(room):
                return self._take_native(target, head, whole, room, seconds)
        return self._take_peeked(target, head, whole)

    def _take_native(
        self, target: Connection, head: bytes, whole: int, room: memoryview, seconds: float
    ) -> memoryview | None:
        offset = 0
        if self._begun is not None:
            if self._begun[0] is target:
                offset, self._begun = self._begun[1], None
            else:
                self._settle_begun()
        found, n = native_take(target.sock.fileno(), head, room, whole, seconds, offset)
        return self._took(target, head, whole, room, found, n)

    def _took(
        self, target: Connection, head: bytes, whole: int, room: memoryview, found: int, n: int
    ) -> memoryview | None:
        """What a look in C found, for ``take_frame``: see ``_stream_core.take``."""
        if found == FRAME:
            return room[len(head) : whole]
        if found == PART:  # (its first n bytes, which only this knows of: see quiet and poll)
            self._begun = (target, n)
            return None
        if found == NOTHING:
            return None
        if n:  # anything else, taken off the stream: the reader's, as if poll had read it,
            target.reader.received(n)  # and parsed by the next poll, after the caller posted
            self._unparsed.append(target)  # the operation (the loop takes it over first)
        if found < 0:  # (a reset: consumed here, so reported here, after what came before it)
            self._parse_unparsed()
            self._lose(target, OSError(-found, os.strerror(-found)))
        return ELSEWHERE  # (the end, or what was staged: poll reads and reports it)

    def _settle_begun(self) -> None:
        """A frame ``take_frame`` began and its taker gave up on: the reader goes on with it."""
        if self._begun is not None:
            (peer, n), self._begun = self._begun, None
            peer.reader.received(n)
            self._unparsed.append(peer)

    def _parse_unparsed(self) -> None:
        """Parse what ``take_frame`` staged but did not take."""
        unparsed, self._unparsed = self._unparsed, []
        for peer in unparsed:
            if peer.rank in self._peers:
                try:
                    self._parse(peer)
                except FrameError as exc:
                    self._lose(peer, exc)

    def _take_peeked(self, target: Connection, head: bytes, whole: int) -> memoryview | None:
        if len(self._taken) < whole:
            self._taken = memoryview(bytearray(whole))
        taken = self._taken
        try:
            n = target.sock.recv_into(taken, whole, socket.MSG_PEEK)
            seen = min(n, len(head))
            if n == 0 or taken[:seen] != head[:seen]:
                return ELSEWHERE  # (poll reads it, or the end, and reports that)
            if n < whole:
                return None
            if target.sock.recv_into(taken, whole, socket.MSG_TRUNC) != whole:  # (all there)
                raise ConnectionError("a frame seen whole was taken in part")
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:  # (a reset: the error is consumed here, so report it here)
            self._lose(target, exc)
            return ELSEWHERE
        return taken[len(head) : whole]
