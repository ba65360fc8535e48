"""gather: the one collective built on the store, and how it names the ranks that never came.

Theory of operation. Each rank publishes a value under ``prefix/rank`` and waits for every
other rank's, in rank order, under one deadline. At the deadline it asks the store which keys
are missing, so the TimeoutError names who never joined ("ranks 2, 3, 5-7") and adds what the
store saw (e.g. connections it rejected). An ``abort`` key lets any rank end every wait early.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..errors import UsageError
from .store import Store, _check_rank, _check_timeout

__all__ = ["gather"]


def _describe_ranks(ranks: Sequence[int]) -> str:
    """``[2]`` -> "rank 2"; ``[2, 3, 5, 6, 7]`` -> "ranks 2, 3, 5-7"."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts: list[str] = []
    for run in runs:
        parts += [f"{run[0]}-{run[-1]}"] if len(run) > 2 else [str(r) for r in run]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def gather(
    store: Store, prefix: str, rank: int, world_size: int, value: bytes, timeout: float,
    *, abort: str | None = None,
) -> list[bytes]:  # fmt: skip
    """Publish ``value`` under f"{prefix}/{rank}", wait for all ranks, return values in rank order.

    On deadline raise TimeoutError whose message names who is missing, e.g.
    "rendezvous 'addr': waited 30.0 s; ranks 2, 3 never joined (world_size=4)".
    ``abort``: a key that any rank may set to a reason, which makes every waiting rank raise
    UsageError with it within a second instead of waiting out the deadline.
    Each rendezvous needs its own ``prefix``: keys are never deleted, so a reused prefix
    would return the values of the earlier round.
    """
    _check_rank(rank, world_size)
    _check_timeout(timeout)
    deadline = time.monotonic() + timeout
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.set(keys[rank], value)
    try:
        return [_wait_for(store, key, deadline, abort) for key in keys]
    except TimeoutError:
        missing = [r for r, present in enumerate(store.check(keys)) if not present]
        if missing:
            hint = store._diagnosis()
            raise TimeoutError(
                f"rendezvous {prefix!r}: waited {timeout:.1f} s; "
                f"{_describe_ranks(missing)} never joined (world_size={world_size})"
                + (f"; {hint}" if hint else "")
            ) from None
    # Everyone arrived just as the deadline passed: the values are all there now.
    return [store.get(key, timeout=max(timeout, 1.0)) for key in keys]


def _wait_for(store: Store, key: str, deadline: float, abort: str | None) -> bytes:
    """``store.get`` until ``deadline``, looking at the ``abort`` key every second."""
    while True:
        left = max(deadline - time.monotonic(), 0.0)
        if abort is None:
            return store.get(key, timeout=left)
        try:
            return store.get(key, timeout=min(left, 1.0))
        except TimeoutError:
            if store.check([abort])[0]:
                raise UsageError(store.get(abort, 1.0).decode(errors="replace")) from None
            if left <= 1.0:
                raise
