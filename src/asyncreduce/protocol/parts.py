"""What the Session's mixins (around.py, controls.py) read and write of its state: the parts
it holds, declared once, which ``Session.__init__`` sets (session.py)."""

from __future__ import annotations

from ..algorithms import Array
from ..flight import FlightRecorder
from .commands import Command
from .flow import Flow
from .liveness import Liveness
from .matching import Matching
from .membership import Membership
from .operation import Operation, Settings
from .outside import Outside
from .stall import StallInspector
from .wire import Control

__all__ = ["SessionParts"]


class SessionParts:
    """The Session's state, as its mixins see it."""

    rank: int
    world_size: int
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
    # the membership (epochs.py): its number, ranks and keys' prefix, the agreement on the
    # next one once a failure started it, the peers whose connection is gone
    epoch: int
    members: frozenset[int]
    prefix: bytes
    agreement: Membership | None
    agree_retry_at: float
    lost_peers: set[int]
    from_next: list[tuple[int, Control]]  # the next membership's aborts and failures, early
    _now: float
