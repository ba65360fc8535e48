"""The direct run: a blocking small allreduce or barrier run to the end on its caller's
thread, over the partners' connections, where the engine is quiet (engine/core.py's module
docstring says when); anything else hands it to the loop where it stands.

A direct run holds the loop (ownership.py) for all of it, so the transport and the Session
still have one thread at a time. It reads only the streams of its partners, taking only the
frames whose headers are exactly the expected ones (``take_frame``; a look for one spins at
most ``TAKE_LOOK`` without the GIL), and over a power of two ranks the transport makes every
swap in one call (in C). It tells the Session afterwards what it heard and that it ran
(``heard_from``, ``ran``); an operation it gives up is adopted as an ordinary one.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any, Protocol

from ..algorithms import RunsDirectly, Send
from ..errors import BrokenError
from ..kernels.reduction import quiet_numpy
from ..protocol.operation import Operation, Settings, bytes_of
from ..protocol.session import Session
from ..protocol.wire import Key, data_head
from ..request import Request
from ..transport.base import ELSEWHERE, Transport
from ..transport.frame import Descriptor, with_step
from .ownership import Ownership

__all__ = ["DIRECT_LOOK", "DRIVE_SPIN", "DirectRun", "Host"]

DRIVE_SPIN = 2e-3  # how long a waiter drives the loop (or a direct run waits for a partner)
# after the last event it saw
DIRECT_LOOK = 20e-3  # a direct run only this soon after the loop last read every connection,
# so a frame from a rank that is no partner (an abort, a question, an early frame) waits at
# most about this long while a thread runs small allreduces (or barriers) back to back
SELF_LOOK = 5e-3  # a direct run reads every connection and ticks first if nobody did as late
NOTHING = memoryview(b"")  # the payload of a swap of empty messages (a barrier's)
TAKE_LOOK = 50e-6  # how long one look for a partner's frame may spin without the GIL (in C),
# so another thread's post or wait is noticed within it


class Host(Protocol):
    """What a direct run needs of the engine whose loop it borrows (Engine is one)."""

    rank: int
    session: Session
    transport: Transport
    looked: float  # when the loop last read every connection (monotonic)
    crash: BaseException | None  # a bug in a turn of the loop, if one happened

    def usable(self) -> bool:
        """Neither closing, nor crashed, nor a forked child's copy."""
        ...

    def post(self, op: Operation) -> Request[Any]:
        """Submit ``op`` to the loop, behind what is there; its request."""
        ...

    def take_over(self, op: Operation) -> Request[Any]:
        """Hand ``op`` to the Session where the run left it; its request."""
        ...

    def turn_here(self, sources: Collection[int]) -> bool:
        """A turn of the loop on this thread that leaves ``sources``' streams unread; False
        after a bug."""
        ...

    def crashed(self, exc: BaseException) -> None:
        """A bug on this thread: the engine thread fails everything."""
        ...


class DirectRun:
    """Direct runs on one engine's loop; ``count``: how many ran to the end."""

    def __init__(
        self, host: Host, loop: Ownership, posts: deque[Any], settings: Settings
    ) -> None:  # fmt: skip
        """``posts``: the engine's entry queue (a run leaves the loop to any post in it)."""
        self._host, self._loop, self._posts, self._settings = host, loop, posts, settings
        self.count = 0

    def run(
        self, key: Key, label: str, desc: Descriptor, algo: RunsDirectly, priority: int,
        timeout: float | None, adopt: Callable[[], Operation],
    ) -> Request[Any] | None:  # fmt: skip
        """A small allreduce (or a barrier: ``RunsDirectly``) whose caller waits for it at
        once, run on the caller's thread to the end where the engine has nothing else to do
        (progress in the call, all of it):
        each frame straight into its socket and each peer's straight out of the stream into
        the fold; no request, no session event, nobody woken. None: done, the result is in
        place. Anything else makes it an ordinary operation, ``adopt()``, whose request is
        returned to wait on: work in the engine (it is posted behind it, as any other), no
        look at every connection for ``DIRECT_LOOK``, a partner's stream that holds something
        else first (another operation's frame, a beat, a goodbye, a frame that disagrees: the
        loop reads and judges it; this one is taken over where it stands), a frame that did not
        leave whole, a partner not there within ``DRIVE_SPIN`` (the loop watches it from then
        on, its deadline counted from the take-over), a close, another thread's post or wait."""
        settings, host, loop = self._settings, self._host, self._loop
        if not (settings.direct and settings.spin) or not host.usable():
            return host.post(adopt())
        posted = time.monotonic()
        end = posted + (DRIVE_SPIN if timeout is None else min(DRIVE_SPIN, timeout))
        loop.refuse_reentry(label)
        try:
            if loop.ask(None, end):
                return self._held(key, label, desc, algo, priority, posted, end, adopt)
        finally:
            loop.give_back(ran=True)
        return host.post(adopt())

    def _held(
        self, key: Key, label: str, desc: Descriptor, algo: RunsDirectly, priority: int,
        posted: float, end: float, adopt: Callable[[], Operation],
    ) -> Request[Any] | None:  # fmt: skip
        """``run_direct``, holding the loop (first a look at every connection and a tick, if
        nobody made one for ``SELF_LOOK``: this thread stays aside meanwhile:
        ``ownership.ASIDE_GRACE``)."""
        host = self._host
        transport, session = host.transport, host.session
        size = algo.message_bytes
        if posted - host.looked >= SELF_LOOK and not host.turn_here(algo.sources):
            return self._failed_here(adopt())
        quiet = not self._posts and posted - host.looked < DIRECT_LOOK
        quiet = quiet and session.quiet(key, posted)
        for peer in algo.partners:
            quiet = quiet and transport.quiet(peer, size)
        if not quiet:
            return host.post(adopt())  # (the loop takes it, behind what is there)
        heard: list[int] = []
        try:
            done = self._exchange(key, desc, algo, priority, end, heard)
            now = time.monotonic()
            session.heard_from(heard, now)
            if not done or session.broken is not None:  # (broken: a send found a peer gone)
                return host.take_over(adopt())
            session.ran(key, label, desc, priority, posted, now)
        except BaseException as exc:  # a bug: fail it; the engine thread fails the rest
            host.crashed(exc)
            return self._failed_here(adopt())
        self.count += 1
        return None

    def _failed_here(self, op: Operation) -> Request[Any]:
        """``op``'s request, failed by a bug of the loop on this thread."""
        host = self._host
        op.request.set_exception(BrokenError(f"{op.label}: rank {host.rank}: {host.crash!r}"))
        return op.request

    def _exchange(
        self, key: Key, desc: Descriptor, algo: RunsDirectly, priority: int, end: float,
        heard: list[int],
    ) -> bool:  # fmt: skip
        """Send what ``algo`` sends, take what it awaits off its partner's stream, until it is
        done (True), or until something else must happen first (False): another thread's
        post, wait or close, a frame that did not leave whole (the loop writes the rest), a
        stream that holds something else, ``end``. Its ``swaps`` first, all in one call into
        the transport (in C: send, look, combine, step after step), without a step of the
        algorithm between them."""
        swaps = algo.swaps
        if swaps is None:
            return quiet_numpy(self._steps, key, desc, algo, priority, end, heard, algo.start())
        combining = algo.combining
        into = NOTHING if combining is None else combining.into  # (None: empty messages)
        head = data_head(key, swaps[0].step, 0, into.nbytes, desc)
        done, view = self._host.transport.swaps(swaps, head, into, priority, TAKE_LOOK, combining)
        if done < len(swaps):
            heard += [peer for peer, _, _ in swaps[:done]]
            sends = algo.swapped(done)  # (the next step's message left)
            head = with_step(head, swaps[done].step)
            return quiet_numpy(self._steps, key, desc, algo, priority, end, heard, sends,
                               view, head)  # fmt: skip
        heard += algo.partners  # (each the partner of a swap)
        algo.swapped(done)
        return True

    def _steps(
        self, key: Key, desc: Descriptor, algo: RunsDirectly, priority: int, end: float,
        heard: list[int], sends: list[Send], view: memoryview | None = None, head: bytes = b"",
    ) -> bool:  # fmt: skip
        """``_exchange`` message by message, from ``sends``; ``head`` and ``view``: the awaited
        message's header and what a swap found of it (as ``take_frame``), if one looked."""
        transport, size = self._host.transport, algo.message_bytes
        heads: dict[int, bytes] = {}  # by step: what a partner sends is what this rank sends
        looked = bool(head)
        while True:
            for s in sends:
                payload = bytes_of(s.payload)
                head = heads[s.step] = data_head(key, s.step, s.seg, payload.nbytes, desc)
                if not transport.send_now(s.dst, head, payload, priority):
                    return False
            awaited = algo.awaited
            if awaited is None:
                return True
            peer, step = awaited
            if not looked:
                head = heads.get(step) or data_head(key, step, 0, size, desc)
                view = transport.take_frame(peer, head, size, TAKE_LOOK)
            looked = False
            while view is None:
                if self._posts or len(self._loop.drivers) > 1 or time.monotonic() >= end:
                    return False  # (another thread's operation, or its wait, must move too)
                os.sched_yield()
                view = transport.take_frame(peer, head, size, TAKE_LOOK)
            if view is ELSEWHERE:
                return False
            heard.append(peer)
            sends = algo.on_view(peer, step, 0, view)
