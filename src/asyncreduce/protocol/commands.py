"""What the session asks of the world: the commands the engine thread carries out.

The session never touches a socket, a thread or a clock. Each event it takes appends commands
to one list (``Session.commands``), which the engine applies, in order, once the event's call
has returned. A command is a plain tuple whose first item names it, cheap to build for every
frame:

    (SEND, peer, head, payload, priority, token, age)   queue a frame (token None: control)
    (DROP, token)                  stop using the buffers of the frames sent with ``token``
    (DIVERT, peer)                 land the rest of the payload arriving from ``peer`` privately
    (WITHDRAW, peer)               take back ``peer``'s queued frames; hand them to ``withdrawn``
    (RELEASE, peer)                ``peer`` said goodbye: drop what is queued for it, half-close
    (FINISH, op, value, error)     give the operation's request its outcome
    (BROKE, error)                 the communicator broke: write the flight record if asked to
"""

from __future__ import annotations

from typing import Any

__all__ = ["SEND", "DROP", "DIVERT", "WITHDRAW", "RELEASE", "FINISH", "BROKE", "Command"]

SEND, DROP, DIVERT, WITHDRAW, RELEASE, FINISH, BROKE = range(7)
CONTROL_PRIORITY = 1 << 30  # control frames overtake every operation's data

Command = tuple[Any, ...]
