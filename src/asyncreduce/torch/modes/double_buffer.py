"""``double_buffer``: each step applies the previous step's gradients (one step stale).

Theory of operation. Every bucket has two buffers and the steps alternate between them, so
this step's allreduces travel in one while the previous step's averages are still read from
the other. Nothing waits in backward: ``step()`` makes this step's posts the pending updates,
clears the gradients, and applies the updates pending until now in one step of the inner
optimizer (waiting for what has not arrived yet). Communication thus overlaps a whole step,
at the price of one step of staleness, and ``p.grad`` still holds this rank's own gradient
after backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..buckets import Update
from ..reducer import Reducer
from .base import Mode, make_pending, refuse_changed_gradients

__all__ = ["DoubleBuffer"]


class DoubleBuffer(Mode):
    """Apply the previous step's updates in ``step()`` while this step's travel."""

    name = "double_buffer"
    copies = 2

    def step(self, reducer: Reducer, closure: Callable[[], float] | None) -> Any:
        refuse_changed_gradients(reducer)
        previous = make_pending(reducer, None)
        reducer.clear_gradients()
        _apply_all(reducer, previous)  # the previous step's gradients: one step stale
        return None

    def synchronize(self, reducer: Reducer) -> None:
        pending = [b.update for b in reducer.buckets]
        for b in reducer.buckets:
            b.update = None
        _apply_all(reducer, pending)


def _apply_all(reducer: Reducer, updates: list[Update | None]) -> None:
    """One optimizer step over these updates (the gradients cleared before)."""
    if not any(u is not None for u in updates):
        return
    for bucket, update in zip(reducer.buckets, updates, strict=True):
        if update is not None:
            for p, g in zip(bucket.params, reducer.gradients(bucket, update), strict=True):
                p.grad = g
    reducer.optimizer.step_inner()
    reducer.clear_gradients()
