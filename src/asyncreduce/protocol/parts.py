"""What the Session's mixins (around.py, controls.py) read and write of its state: the parts
it holds, declared once, which ``Session.__init__`` sets (session.py)."""

from __future__ import annotations

from ..algorithms import Array
from ..flight import FlightRecorder
from .commands import Command
from .flow import Flow
from .liveness import Liveness
from .matching import Matching
from .operation import Operation, Settings
from .outside import Outside
from .stall import StallInspector

__all__ = ["SessionParts"]


class SessionParts:
    """The Session's state, as its mixins see it."""

    rank: int
    settings: Settings
    flight: FlightRecorder
    commands: list[Command]
    matching: Matching
    flow: Flow
    liveness: Liveness[Operation]
    stall: StallInspector
    outside: Outside | None  # the executor outside the engine it watches (around.py)
    broken: BaseException | None
    stopping: bool
    working: set[Operation]
    _landing: dict[int, tuple[Operation, Array]]
    _now: float
