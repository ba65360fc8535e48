"""The engine's part in going on without lost ranks (``asyncreduce.shrink``): a caller's wish,
queued like a post (``shrink``: any thread, even while the communicator is broken), is handed
to the session on the loop's thread (protocol/epochs.py), and answered once the agreement on
who is alive decided: with the survivors, or with BrokenError where this rank was excluded.

Every decision is remembered by its epoch, so a caller that asks after its peers' agreement
already moved this rank on (it took part as soon as their messages came) is answered at once.

A mixin of ``Engine`` (core.py), which holds the state declared in parts.py.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..errors import BrokenError, ClosedError
from .parts import EngineParts, ShrinkCall

__all__ = ["ShrinkCall", "Shrinks"]


class Shrinks(EngineParts):
    """Shrink calls, from any thread to their answer (see the module docstring)."""

    if TYPE_CHECKING:  # entry.py's

        def wake(self) -> None: ...

    def shrink(self, call: ShrinkCall) -> None:
        """Queue ``call`` for the loop's thread; ClosedError if the communicator is closed."""
        with self._lock:
            if self._closing.is_set():
                raise ClosedError(f"{call.request.label}: the communicator is closed")
            self._submitted.append(call)
            sleeping = self._sleeping
        if sleeping:
            self.transport.wakeup()
        else:
            self.wake()

    def _begin_shrink(self, call: ShrinkCall) -> None:
        """On the loop's thread: answer from a decision already made, or start (or join) the
        agreement and wait for it."""
        if call.epoch + 1 in self._decided:
            self._answer(call, self._decided[call.epoch + 1])
            return
        session = self.session
        if session.epoch != call.epoch:
            where = f"rank {self.rank} is in membership {session.epoch}, not {call.epoch}"
            call.request.set_exception(BrokenError(where))
            return
        self._shrinks.append(call)
        session.shrink(time.monotonic())
        self._apply()

    def _agreed(self, epoch: int, survivors: frozenset[int] | None) -> None:
        """The session's AGREED command: remember it, answer whoever waits for it."""
        self._decided[epoch] = survivors
        waiting = [call for call in self._shrinks if call.epoch + 1 == epoch]
        self._shrinks = [call for call in self._shrinks if call.epoch + 1 != epoch]
        for call in waiting:
            self._answer(call, survivors)

    def _answer(self, call: ShrinkCall, survivors: frozenset[int] | None) -> None:
        if survivors is None:
            call.request.set_exception(BrokenError(
                f"rank {self.rank} was excluded by the other ranks' agreement on who is alive "
                f"(membership {call.epoch + 1}): it was lost to them (stopped, cut off or too "
                "slow); start it again to rejoin"))  # fmt: skip
        else:
            call.request.set_result(survivors)

    def _fail_shrinks(self, error: BaseException) -> None:
        """A close: whoever waits for an agreement gets ``error``."""
        for call in self._shrinks:
            call.request.set_exception(error)
        self._shrinks = []

