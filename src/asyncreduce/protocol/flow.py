"""Back-pressure: how a rank that holds too many frames for operations it has not posted slows
their sender down without pausing the connection.

Frames for operations not posted here are held, up to ``Settings.held_bytes``. Past that, this
rank sends the peer a ``Hold`` and then a ``PostNotice`` for each operation it has posted (and for
each one it posts later): from then on the peer keeps the frames of other operations in its own
memory (the caller's buffers, no copy) until this rank posts them, a rendezvous that costs a
round trip only where this rank is late anyway. The connection itself is never paused, so what
this rank waits for is never stuck behind what it cannot take: back-pressure slows a fast rank
down, it cannot deadlock. Once this rank holds no more than a quarter of the cap, it sends a
``Resume``: the peer sends what it kept back and everything as it comes again (a hold for
good would cost every later operation a ``PostNotice`` and the peer's wait for it, and keep the
small ones off the direct run, ``Session.quiet``).

Two sides, one class: ``holding_back`` (peers that told this rank to hold) with the keys they
posted since and the frames kept back for them, and ``told`` (peers this rank told to hold).
"""

from __future__ import annotations

from collections.abc import Callable

from .operation import Operation
from .wire import Key

__all__ = ["Flow", "KeptFrame"]

KeptFrame = tuple[Operation, bytes, memoryview]  # (operation, head, payload) not yet sent


class Flow:
    """The back-pressure state of one rank towards each peer."""

    def __init__(self, cap: int) -> None:
        self.cap = cap  # bytes of unexpected frames held before the sender is told to hold
        self.peak = 0  # the most bytes ever held at once (tests and diagnostics)
        self.told: set[int] = set()  # peers told to hold back frames we did not post
        self.holding_back: dict[int, set[Key]] = {}  # peers that told us: keys posted there since
        self.kept: dict[int, list[KeptFrame]] = {}  # frames held back for such peers

    def over_cap(self, peer: int, held: int) -> bool:
        """Holding ``held`` bytes after a frame from ``peer``: whether to tell it to hold now."""
        self.peak = max(self.peak, held)
        if held > self.cap and peer not in self.told:
            self.told.add(peer)
            return True
        return False

    def may_send(self, peer: int, key: Key) -> bool:
        """Whether a frame of ``key`` may go to ``peer`` now (not told to hold, or posted there)."""
        posted = self.holding_back.get(peer)
        return posted is None or key in posted

    def drained(self, held: int) -> list[int]:
        """Holding ``held`` bytes now: the peers told to hold that may send freely again
        (forgotten as told). At most a quarter of the cap: a hold ends well below where it
        began, so a rank near the cap does not say Hold and Resume at every frame."""
        if not self.told or held > self.cap // 4:
            return []
        peers = sorted(self.told)
        self.told.clear()
        return peers

    def resumed(self, peer: int, live: Callable[[Operation], bool]) -> list[KeptFrame]:
        """``peer`` ended its hold: the frames kept back for it, in their order, that may all
        go now (those of operations no longer ``live`` are forgotten)."""
        self.holding_back.pop(peer, None)
        return [frame for frame in self.kept.pop(peer, []) if live(frame[0])]

    def keep_back(self, peer: int, frame: KeptFrame) -> None:
        self.kept.setdefault(peer, []).append(frame)

    def start_holding(self, peer: int) -> bool:
        """``peer`` told us to hold; False if it had already (nothing to withdraw)."""
        if peer in self.holding_back:
            return False
        self.holding_back[peer] = set()
        return True

    def withdrawn(self, peer: int, frames: list[KeptFrame]) -> None:
        """Frames taken back from the transport's queue for ``peer``: they wait first."""
        self.kept[peer] = frames + self.kept.get(peer, [])

    def posted_there(
        self, peer: int, key: Key, live: Callable[[Operation], bool]
    ) -> list[KeptFrame]:
        """``peer`` posted ``key``: the frames kept back for it that may go now. Frames of
        operations no longer ``live`` (failed meanwhile) are forgotten."""
        posted = self.holding_back.get(peer)
        if posted is None:
            return []
        posted.add(key)
        ready: list[KeptFrame] = []
        kept: list[KeptFrame] = []
        for frame in self.kept.pop(peer, []):
            if live(frame[0]):
                (ready if frame[0].key == key else kept).append(frame)
        if kept:
            self.kept[peer] = kept
        return ready

    def forget(self, peer: int) -> list[KeptFrame]:
        """``peer`` said goodbye: the frames kept back for it, which will never be sent."""
        self.holding_back.pop(peer, None)
        return self.kept.pop(peer, [])

    def broken(self) -> None:
        """The session broke: every operation failed, so nothing kept back will be sent."""
        self.kept.clear()

    def ended(self, key: Key) -> None:
        """``key`` ended here: its 'posted there' marks are no longer needed."""
        for posted in self.holding_back.values():
            posted.discard(key)
