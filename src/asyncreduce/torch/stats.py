"""How much of the communication the training thread did not wait for.

``comm_s`` is the wall time during which at least one of the wrapper's allreduces was in
flight (overlapping spans counted once). ``exposed_s`` is the time the training thread spent
in communication that nothing else could overlap: in blocking mode the whole of it, from the
first post of a step to its last wait; in the other modes the waits. So blocking reports 0
hidden, by construction, and ``hidden_share = 1 - exposed / comm`` for the rest.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from ..request import Request

__all__ = ["CommStats"]


class CommStats:
    """Exposed and busy communication time of one wrapper (``DataParallel.stats``)."""

    def __init__(self) -> None:
        self._busy = _BusyClock()
        self._exposed = 0.0
        self._depth = 0  # nested exposure (a blocking step's waits) is counted once

    @contextlib.contextmanager
    def exposed(self) -> Iterator[None]:
        """Time the training thread spends inside this block counts as exposed."""
        self._depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._exposed += time.perf_counter() - start

    def completed(self, request: Request[Any]) -> None:
        """``request`` (one of the wrapper's allreduces) is done: add its span."""
        self._busy.add(request)

    def snapshot(self) -> dict[str, float]:
        comm = self._busy.total
        hidden = 1.0 - self._exposed / comm if comm else 0.0
        return {
            "exposed_s": self._exposed,
            "comm_s": comm,
            "hidden_share": min(1.0, max(0.0, hidden)),
        }

    def reset(self) -> None:
        self._busy = _BusyClock()
        self._exposed = 0.0


class _BusyClock:
    """Wall time during which at least one allreduce was in flight (overlaps counted once).

    Spans are merged as they come, keeping only the last few unmerged, so a long training run
    holds a bounded list; a span that starts before everything kept is rare (it would have to
    be waited for far out of order) and only its overlap with merged time is counted twice.
    """

    _KEEP = 64

    def __init__(self) -> None:
        self._spans: list[tuple[float, float]] = []
        self._merged = 0.0  # time of spans folded away
        self._reach = float("-inf")  # end of the last folded span

    def add(self, request: Request[Any]) -> None:
        self._spans.append((request.posted_at, request.completed_at or time.perf_counter()))
        if len(self._spans) > 2 * self._KEEP:
            self._spans.sort()
            old, self._spans = self._spans[: -self._KEEP], self._spans[-self._KEEP :]
            self._merged, self._reach = _union(old, self._merged, self._reach)

    @property
    def total(self) -> float:
        return _union(sorted(self._spans), self._merged, self._reach)[0]


def _union(spans: list[tuple[float, float]], total: float, reach: float) -> tuple[float, float]:
    """Add the time covered by sorted ``spans`` beyond ``reach`` to ``total``."""
    for start, end in spans:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total, reach
