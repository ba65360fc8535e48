"""``backward`` and ``blocking``: every ``p.grad`` holds the average when ``backward()`` returns.

Theory of operation. The end of a synced backward pass (autograd's final callback) posts the
buckets the pass did not send, then waits for every bucket's allreduce and puts the averages
in ``p.grad``; ``step()`` is one step of the inner optimizer, so clipping, logging or checks
between ``backward()`` and ``step()`` see what DDP shows them, and ``step(closure)`` (LBFGS)
works. ``backward`` posts each bucket as soon as its gradients are complete, so communication
overlaps the rest of backward (the DDP way). ``blocking`` is the same with nothing
overlapped: every bucket is posted at the end of the pass, and the whole end of the pass
counts as exposed communication (the baseline the other modes are measured against).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..reducer import Reducer
from .base import Mode

__all__ = ["Backward", "Blocking"]


class Backward(Mode):
    """Wait at the end of backward for what backward already sent."""

    name = "backward"
    averaged_in_backward = True

    def end_pass(self, reducer: Reducer) -> None:
        super().end_pass(reducer)
        for bucket in reducer.buckets:
            update, bucket.inflight = bucket.inflight, None
            if update is not None:
                grads = reducer.gradients(bucket, update)
                for p, g in zip(bucket.params, grads, strict=True):
                    p.grad = g

    def step(self, reducer: Reducer, closure: Callable[[], float] | None) -> Any:
        return reducer.optimizer.step_inner(closure)


class Blocking(Backward):
    """Post everything at the end of backward and wait for it, all of it exposed."""

    name = "blocking"
    posts_early = False

    def end_pass(self, reducer: Reducer) -> None:
        with reducer.stats.exposed():
            super().end_pass(reducer)
