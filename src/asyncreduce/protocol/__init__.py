"""The protocol above the algorithms, sans-IO: no socket, no thread, no clock.

``Session`` (session.py) takes events and returns commands (commands.py); the engine thread
(engine/, one level up) feeds it and carries the commands out. wire.py maps the typed control
messages onto frame fields; matching.py, flow.py, liveness.py and stall.py hold one concept each.
"""

from .commands import Command
from .operation import Operation, Settings
from .session import Session, broken_by
from .wire import ON_DEVICE, describe

__all__ = ["Command", "ON_DEVICE", "Operation", "Session", "Settings", "broken_by", "describe"]
