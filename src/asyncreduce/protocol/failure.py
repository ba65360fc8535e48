"""How failures are worded: the error an operation gets when the communicator broke under it,
and a fresh error of the same class for a later post of a key that failed already.

Failure is sticky and the same everywhere: the first failure breaks the session (session.py,
``fail_all``); every pending operation then fails with ``BrokenError`` chained to that cause,
and a peer told with a ``Failed`` message fails that operation with the class it names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import BrokenError, ClosedError, ranks_phrase

__all__ = [
    "broken_by",
    "closed_under",
    "same_error",
    "silent",
    "silent_for",
    "timed_out",
    "unheard",
]


def broken_by(op: Any, cause: BaseException) -> BrokenError:
    """The error of an operation (anything with a ``label``) that fails because the
    communicator broke: ``cause`` chained. The ordered engine's failures are worded alike."""
    error = BrokenError(f"{op.label} failed: the communicator is broken: {cause}")
    error.__cause__ = cause
    return error


def same_error(error: BaseException, message: str) -> BaseException:
    """A new exception of the same class as ``error`` with ``message``, chained to it."""
    new = type(error)(message)
    new.__cause__ = error
    return new


def closed_under(op: Any) -> ClosedError:
    """The error of an operation pending when its communicator was closed."""
    return ClosedError(f"{op.label}: the communicator was closed while it was pending")


def timed_out(op: Any, rank: int, waiting: set[int]) -> TimeoutError:
    """The error of an operation past its own timeout on ``rank``, still ``waiting`` for."""
    return TimeoutError(f"{op.label} did not complete within its timeout of {op.timeout} s on "
                        f"rank {rank} (still waiting for {ranks_phrase(waiting)})")  # fmt: skip


def silent(message: str, peer_timeout: float) -> BrokenError:
    """A peer went silent: a ``BrokenError`` with ``message`` (naming it), whose cause is the
    ``TimeoutError`` of the peer timeout. ``TimeoutError`` itself means only that a caller's
    own wait ran out (``timeout=``). The ordered engine's silence is worded alike."""
    error = BrokenError(message)
    error.__cause__ = TimeoutError(
        f"no frame, not even a heartbeat, within the peer timeout of {peer_timeout:g} s "
        "(ASYNCREDUCE_PEER_TIMEOUT)"
    )
    return error


def silent_for(op: Any, rank: int, silent_peers: set[int], peer_timeout: float) -> BrokenError:
    """The error of an operation on ``rank`` that waits for peers ``silent_peers`` this long."""
    return silent(f"{op.label} failed on rank {rank}: {unheard(silent_peers, peer_timeout)}",
                  peer_timeout)  # fmt: skip


def unheard(silent_peers: Iterable[int], peer_timeout: float) -> str:
    """What a silence failure says of peers ``silent_peers``, in both engines."""
    return (f"{ranks_phrase(silent_peers)} sent nothing for {peer_timeout:g} s, "
            "not even a heartbeat (stopped, or cut off?)")  # fmt: skip
