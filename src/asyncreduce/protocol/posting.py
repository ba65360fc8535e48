"""What every posted operation is, whichever way it goes (protocol/route.py): its key, label,
descriptor, request, result and timeout. Each executor's record extends it with what only it
needs: the engine's ``Operation`` (protocol/operation.py: the algorithm, the frames in flight),
the ordered engine's ``Posted`` (backends/ordered/posted.py: the caller's memory, fusion), the
lane's ``LaneOp`` (lane/op.py: its slot). Code that judges or records an operation, whoever runs
it (protocol/outside.py, flight.settle), reads only these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..keys import Key
from ..request import Request
from ..transport.frame import Descriptor

__all__ = ["Posting"]


@dataclass(eq=False, slots=True)
class Posting:
    """One posted operation's core (see the module docstring); ``timeout``: seconds, or None."""

    key: Key
    label: str
    desc: Descriptor
    request: Request[Any]
    result: Callable[[], Any]
    timeout: float | None
