"""What the Engine's mixins (entry.py, turns.py) read and write of its state: the parts it
holds, declared once, which ``Engine.__init__`` sets (core.py)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from ..lane import Lane
from ..protocol.operation import Operation, Settings
from ..protocol.session import Session
from ..request import Request
from ..transport.base import Transport
from .lanes import LaneMover
from .ownership import Ownership
from .sink import Sink

__all__ = ["EngineParts", "ShrinkCall"]


class ShrinkCall:
    """A caller's wish to go on without the lost ranks of membership ``epoch`` (shrinks.py),
    queued among the posts."""

    __slots__ = ("epoch", "request")

    def __init__(self, epoch: int, request: Request[frozenset[int]]) -> None:
        self.epoch, self.request = epoch, request


class EngineParts:
    """The Engine's state, as its mixins see it (see the module docstring)."""

    rank: int
    settings: Settings
    session: Session
    transport: Transport
    lane: Lane | None
    crash: BaseException | None
    driven: int
    looked: float
    _lock: threading.Lock
    _submitted: deque[Operation | ShrinkCall | None]
    _shrinks: list[ShrinkCall]  # shrink calls waiting for their agreement (shrinks.py)
    _decided: dict[int, frozenset[int] | None]  # every membership agreed on, by epoch
    _aborting: str | None
    _closing: threading.Event
    _sleeping: bool
    _dozing: bool
    _loop: Ownership
    _sink: Sink
    _apply: Callable[..., None]
    _lanes: LaneMover
    _thread: threading.Thread
