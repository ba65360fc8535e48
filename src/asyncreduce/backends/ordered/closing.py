"""Closing the ordered engine: its thread's goodbye, and what is left when the thread ends.

Theory of operation. ``close()`` and ``abort()`` (engine.py) put the thread's last item on its
queue and wait for the thread, ``JOIN`` seconds at most (nothing it calls blocks). The thread
then says goodbye (``say_goodbye``). After ``abort`` the communicator breaks first (failure.py)
and each wait below is a short linger (0.5 s) instead of ``LINGER``. What is not agreed fails
with ``ClosedError`` (it stays offered, on scratch, for the peers). The engine calls still
running are let finish, for up to a linger: the peers need this rank in them; one still
running after that breaks the communicator, so the peers hear BREAK before GOODBYE. Then no
new round starts, and GOODBYE (with the reason, if this rank broke) goes to every peer, one
that said goodbye first included, since it waits for ours. Until every peer said goodbye too
(or another linger passed), the thread keeps answering rounds and running what they agree: a
peer may have agreed one of ours before it heard ours. Last, the sends drain (a linger at most).

However the thread ends (the goodbye, or a crash), ``fail_left`` fails every request still
pending and what was submitted but never taken, and ``release`` closes the adapter; calls still
in the engine are kept alive for good, since MPI may still read or write their memory.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from ...errors import BrokenError, ClosedError
from ...keys import Key
from ...protocol import broken_by
from .agreement import Agreement
from .calls import CallRunner
from .channel import GOODBYE, Channel
from .failure import Breaker
from .fusion import Call
from .posted import Adapter, Posted

__all__ = ["JOIN", "LINGER", "fail_left", "release", "say_goodbye"]

log = logging.getLogger("asyncreduce.ordered")
LINGER = 2.0
#: close() waits this long for the thread at most: its goodbye takes up to 3 lingers (calls,
#: peers' goodbyes, sends), and nothing it calls blocks; past it, close() returns anyway
JOIN = 3 * LINGER + 2.0
_ABORT_LINGER = 0.5
_POLL = 50e-6  # seconds between tests of the calls still running (the engine's least nap)
_REASON_BYTES = 4096
_ABANDONED: list[Any] = []  # calls still in the engine when their thread ended: kept alive


def say_goodbye(
    rank: int, abort: str | None, breaker: Breaker, runner: CallRunner, *,
    posted: dict[Key, Posted], calls: list[Call], agreement: Agreement, channel: Channel,
    peers: int, poll_channel: Callable[[], bool], tell_all: Callable[[int, bytes], None],
) -> None:  # fmt: skip
    """Let running calls finish (peers need this rank in them), then GOODBYE to every peer
    and read until each said goodbye too (or the linger passed): the module docstring.
    ``abort``: why abort() was called (None: close()); ``posted`` and ``calls``: the engine's
    operations not yet agreed and its calls in flight; ``peers``: how many there are;
    ``poll_channel``: read and act on what came; ``tell_all``: a message to every peer."""
    linger = _ABORT_LINGER if abort is not None else LINGER
    if abort is not None:
        breaker.break_communicator(BrokenError(f"rank {rank} aborted: {abort}"))
    for op in list(posted.values()):
        breaker.fail(op, ClosedError(f"{op.label}: the communicator was closed"))
    deadline = time.monotonic() + linger
    while calls and time.monotonic() < deadline:
        if not runner.poll():
            time.sleep(_POLL)
    if calls:  # still in the engine: the peers hear BREAK before GOODBYE
        breaker.break_communicator(BrokenError(
            f"rank {rank} closed with {calls[0].ops[0].label} still running"))  # fmt: skip
    broken = breaker.broken
    reason = f"it was broken: {broken}".encode()[:_REASON_BYTES] if broken else b""
    agreement.stop()  # no new round: peers stop reading from us at our GOODBYE
    tell_all(GOODBYE, reason)
    # Until every peer said goodbye too (or the linger passed), keep answering rounds and
    # running what they agree: a peer may have agreed one of ours before it heard ours.
    while time.monotonic() < deadline + linger and (len(breaker.departed) < peers or calls):
        if not (poll_channel() | runner.poll()):
            time.sleep(_POLL if calls else 1e-3)
    channel.drain_sends(linger)


def fail_left(submitted: queue.SimpleQueue[Posted | None], pending: list[Posted],
              cause: BaseException | None) -> None:  # fmt: skip
    """Fail every request still ``pending`` as the thread ends (a crash, a failed break), and
    what was ``submitted`` but never taken: with the break's ``cause``, else ClosedError."""
    cause = cause or ClosedError("the communicator was closed")
    left = []
    while True:
        try:
            item = submitted.get_nowait()
        except queue.Empty:
            break
        if item is not None:
            left.append(item)
    for op in [*left, *pending]:
        if not op.request.done():
            op.request.set_exception(broken_by(op, cause))


def release(adapter: Adapter | None, calls: list[Call]) -> None:
    """Keep ``calls`` (still in the engine) alive for good, and close the ``adapter``."""
    if calls:  # MPI may still read or write their memory: never free it
        _ABANDONED.extend(calls)
    if adapter is not None:
        try:
            adapter.close(pending=bool(calls))
        except Exception as exc:
            log.debug("closing the %s adapter: %s", adapter.name, exc)
