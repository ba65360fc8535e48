"""The failure rules of an operation that runs outside the engine (the same-host lane's), as
one pure function: what the engine's Session decides for its own operations, decided here for
one that only the caller's thread and shared memory move.

In the order they are asked:
1. the communicator broke: the operation fails here with the error its key already failed with
   (a peer said so), else with a BrokenError chained to what broke it; nobody is told, since
   every peer breaks by itself;
2. it still needs a rank that said goodbye (that rank never published it: it closed its lane
   before its goodbye): it fails here with a BrokenError naming that rank. Every rank reads the
   same final slot after the same goodbye, so each ends it alike, with no word to the others (a
   word that broke them could fail an operation another rank already completed);
3. its deadline passed: a TimeoutError naming whom it still waits for, on every rank;
4. it waits for a peer that sent nothing for the peer timeout: a BrokenError naming that peer
   (the peer timeout's TimeoutError its cause), on every rank.

"Everywhere" means the Session fails it through ``fail_all``, so peers hear of it as of any
other failure. Nothing here reads a clock or memory: ``now`` comes in, and ``missing`` (which
ranks have not published the operation) is asked at most once, only when a rule needs it.

``Outside`` is such an executor as the Session sees it (``Session.watch_outside``, around.py):
what it holds, and each pending operation handed to a decision under the executor's lock, so
an operation cannot complete between its verdict and its end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from ..errors import BrokenError
from ..flight import Record
from ..keys import Key
from ..transport.frame import Descriptor
from .failure import broken_by, same_error, silent_for, timed_out

__all__ = ["Decide", "Outside", "Verdict", "Watched", "judge"]


class Watched(Protocol):
    """An operation outside the engine, as the Session watches it: its core, when it started
    and must end (monotonic; ``deadline`` 0 for none) and its flight record, once it has one."""

    key: Key
    label: str
    desc: Descriptor
    timeout: float | None
    started: float
    deadline: float
    record: Record | None


Decide = Callable[[Watched, Callable[[], set[int]]], "BaseException | None"]


class Outside(Protocol):
    """An executor of operations outside the engine (the same-host lane), as the Session
    watches it (see the module docstring)."""

    def holds(self, key: Key) -> bool:
        """Whether operation ``key`` is pending here (any thread may ask)."""
        ...

    def judge_each(self, decide: Decide) -> None:
        """Under the executor's lock, hand each pending operation to ``decide``, with how to ask
        which peers it still misses, and end with its error each one it returns an error for."""
        ...


class Verdict(NamedTuple):
    """How an operation outside the engine ends: ``error``, and whether its peers must be told
    (``everywhere``: through the Session) or each rank ends it by itself."""

    error: BaseException
    everywhere: bool


def judge(
    op: Any, rank: int, now: float, *, broken: BaseException | None,
    earlier: BaseException | None, departed: Mapping[int, str],
    missing: Callable[[], set[int]], silent: set[int], peer_timeout: float,
) -> Verdict | None:  # fmt: skip
    """How ``op`` (its ``label``, ``timeout``, and ``deadline``: monotonic, 0 for none) must
    end on ``rank`` at ``now``, or None while it may go on (the module docstring's rules).
    ``broken``: what broke the communicator; ``earlier``: the error ``op``'s key failed with
    already; ``departed``: the peers that said goodbye, and why, worded; ``silent``: the peers
    not heard from for ``peer_timeout``."""
    if broken is not None:
        error = same_error(earlier, str(earlier)) if earlier is not None else broken_by(op, broken)
        return Verdict(error, everywhere=False)
    late = bool(op.deadline) and now >= op.deadline
    if not (departed or late or silent):
        return None
    waiting = missing()
    gone = departed.keys() & waiting
    if gone:
        peer = min(gone)
        return Verdict(BrokenError(f"{op.label} still needed rank {peer}, but {departed[peer]}"),
                       everywhere=False)  # fmt: skip
    if late:
        return Verdict(timed_out(op, rank, waiting), everywhere=True)
    if waiting & silent:
        return Verdict(silent_for(op, rank, waiting & silent, peer_timeout), everywhere=True)
    return None
