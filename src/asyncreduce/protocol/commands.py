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
    (CLAIM, key, remember)         a peer runs named ``key`` on the engine: the same-host lane
                                   hands it over if it holds it (``remember``: or once posted)
    (AGREED, epoch, survivors)     the agreement on who is alive decided membership ``epoch``:
                                   its ranks, or None where this rank was excluded (epochs.py)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Literal

if TYPE_CHECKING:
    from .operation import Operation

__all__ = [
    "SEND", "DROP", "DIVERT", "WITHDRAW", "RELEASE", "FINISH", "BROKE", "CLAIM", "AGREED",
    "Command",
]  # fmt: skip

SEND: Final = 0
DROP: Final = 1
DIVERT: Final = 2
WITHDRAW: Final = 3
RELEASE: Final = 4
FINISH: Final = 5
BROKE: Final = 6
CLAIM: Final = 7
AGREED: Final = 8
CONTROL_PRIORITY = 1 << 30  # control frames overtake every operation's data

# Each command's type, so the engine unpacks it checked (``command[0] == SEND`` narrows the
# union); at run time they are the plain tuples above.
Send = tuple[Literal[0], int, bytes, memoryview, int, "Operation | None", int]
Drop = tuple[Literal[1], "Operation"]
Divert = tuple[Literal[2], int]
Withdraw = tuple[Literal[3], int]
Release = tuple[Literal[4], int]
Finish = tuple[Literal[5], "Operation", Any, "BaseException | None"]
Broke = tuple[Literal[6], BaseException]
Claim = tuple[Literal[7], tuple[bytes, int], bool]
Agreed = tuple[Literal[8], int, "frozenset[int] | None"]
Command = Send | Drop | Divert | Withdraw | Release | Finish | Broke | Claim | Agreed
