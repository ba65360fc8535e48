"""An algorithm of a group of ranks, run over the connections of the whole communicator.

A group (``Communicator.group``) numbers its members 0..n-1; its algorithms are built for
that numbering and know nothing else. ``Translated`` wraps one so the engine, which speaks
the communicator's ranks, sees only those: a message to group rank ``i`` goes to
``members[i]``, and a message from a communicator rank is handed on as from its group rank
(from a rank outside the group it is a ``ProtocolError``: the ranks disagree about the group).
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import Array, Collective, ProtocolError, Send
from .shared import PeerBuffer, PeerMemory

__all__ = ["RenumberedMemory", "Translated"]


class Translated(Collective):
    """``inner`` (built for group ranks) seen with the communicator's ranks."""

    def __init__(self, inner: Collective, members: Sequence[int], rank: int,
                 world_size: int) -> None:  # fmt: skip
        super().__init__(rank, world_size)
        self.inner = inner
        self._members = tuple(members)
        self._index = {member: i for i, member in enumerate(self._members)}

    @property
    def done(self) -> bool:
        return self.inner.done

    @property
    def has_work(self) -> bool:
        return self.inner.has_work

    @property
    def pending_sources(self) -> set[int]:
        return {self._members[i] for i in self.inner.pending_sources}

    def start(self) -> list[Send]:
        return self._out(self.inner.start())

    def work(self) -> list[Send]:
        return self._out(self.inner.work())

    def recv_buffer(self, src: int, step: int, seg: int, nbytes: int) -> Array:
        return self.inner.recv_buffer(self._in(src), step, seg, nbytes)

    def on_message(self, src: int, step: int, seg: int, payload: Array) -> list[Send]:
        return self._out(self.inner.on_message(self._in(src), step, seg, payload))

    def takes_view(self, src: int, step: int, seg: int) -> bool:
        return self.inner.takes_view(self._in(src), step, seg)

    def on_view(self, src: int, step: int, seg: int, view: memoryview) -> list[Send]:
        return self._out(self.inner.on_view(self._in(src), step, seg, view))

    def _in(self, src: int) -> int:
        index = self._index.get(src)
        if index is None:
            raise ProtocolError(f"a message from rank {src}, which is not in this group")
        return index

    def _out(self, sends: list[Send]) -> list[Send]:
        return [s._replace(dst=self._members[s.dst]) for s in sends]


class RenumberedMemory:
    """The communicator's ``PeerMemory`` (cross-memory attach) seen with a group's ranks."""

    def __init__(self, inner: PeerMemory, members: Sequence[int]) -> None:
        self.inner = inner
        self._members = tuple(members)

    def buffer(self, peer: int, where: int, like: Array) -> PeerBuffer:
        return self.inner.buffer(self._members[peer], where, like)
