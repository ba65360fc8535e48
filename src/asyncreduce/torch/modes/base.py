"""What a mode is: the hooks through which ``DataParallel`` asks it what to do.

Theory of operation. Every mode shares the same backward passes (data_parallel.py): buckets,
a post-accumulate-grad hook per parameter, one post of every bucket per synced pass. A mode
is the policy around that machinery, as a c10d communication hook is around DDP's reducer:
how parameters are grouped into buckets, whether a complete bucket is posted at once or at
the end of the pass, what happens when the pass ends (wait, or not), what ``step()`` does,
and what ``synchronize()`` still has to apply. ``Mode`` holds the hooks and what most modes
do; each mode overrides only what makes it that mode. Every hook is handed the wrapper's
``Reducer`` (reducer.py; c10d's ``state``): the buckets, the optimizer, the stats and the
mechanics of posting and waiting, as public fields and methods. A mode keeps no strong
reference to it, and never sees the wrapper. The two modes that apply updates after ``step()``
(forward, double_buffer) close a step with ``refuse_changed_gradients`` and ``make_pending``.

Hot path: ``posts_early`` is read once per parameter per synced backward;
``used_while_pending`` and ``before_post`` are called only for a bucket that still holds the
update of an earlier step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from ...errors import UsageError
from ..buckets import Bucket, Group, Update, size_groups
from ..optimizer import Hyper
from ..reducer import Reducer

__all__ = ["Mode", "make_pending", "refuse_changed_gradients"]


class Mode:
    """The hooks of a mode, with what most modes do (see the module docstring)."""

    name: ClassVar[str]
    averaged_in_backward: ClassVar[bool] = False  # p.grad is the average once backward returns
    posts_early: ClassVar[bool] = True  # post a bucket as soon as all its gradients are ready
    copies: ClassVar[int] = 1  # buffers per bucket

    def groups(self, module: nn.Module, params: list[nn.Parameter], bucket_bytes: int
               ) -> list[Group]:  # fmt: skip
        """The parameters of each bucket: runs up to ``bucket_bytes``."""
        return size_groups(params, bucket_bytes)

    def priority(self, index: int, count: int) -> int:
        """The allreduce priority of bucket ``index`` of ``count``: all the same."""
        return 0

    def install_hooks(self, reducer: Reducer) -> list[Any]:
        """Hooks of the mode's own, removed with the wrapper's: none."""
        return []

    def watch_forward(self, reducer: Reducer) -> Callable[[], None] | None:
        """Called before a forward; what it returns is called after it: nothing."""
        return None

    def used_while_pending(self, reducer: Reducer, param: torch.Tensor) -> None:
        """A gradient arrived for a bucket whose update of an earlier step is pending: fine."""

    def before_post(self, reducer: Reducer, bucket: Bucket) -> None:
        """A bucket whose update of an earlier step is pending is about to be sent: nothing."""

    def post(self, reducer: Reducer, bucket: Bucket) -> None:
        """Send ``bucket`` (its gradients are complete, or the pass ended); one whose update
        of an earlier step is pending goes through ``before_post`` first."""
        if bucket.update is not None:
            self.before_post(reducer, bucket)
        reducer.post(bucket)

    def end_pass(self, reducer: Reducer) -> None:
        """The end of a synced backward pass: every bucket not sent in it is sent now."""
        for bucket in reducer.unsent():
            self.post(reducer, bucket)

    def step(self, reducer: Reducer, closure: Callable[[], float] | None) -> Any:
        """``step()``'s work before the gradients are cleared; returns what ``step()`` does."""
        raise NotImplementedError

    def synchronize(self, reducer: Reducer) -> None:
        """Apply every pending update: none is left pending."""


def make_pending(reducer: Reducer, hyper: Hyper | None) -> list[Update | None]:
    """forward, double_buffer: ``step()`` closes the step, whose posts become the pending
    updates (with ``hyper``, the hyper-parameters to apply them with); returns the updates
    that were pending until now."""
    previous = [b.update for b in reducer.buckets]
    for b in reducer.buckets:
        b.update, b.inflight = b.inflight, None
        if b.update is not None:
            b.update.hyper = hyper
    return previous


def refuse_changed_gradients(reducer: Reducer) -> None:
    """forward, double_buffer, in ``step()``: a gradient changed since it was sent is an
    error, since the change would be lost."""
    for bucket in reducer.buckets:
        param = bucket.changed()
        if param is not None:
            raise UsageError(
                f"the gradient of {reducer.names[id(param)]!r} changed after backward sent it "
                f"(by clip_grad_norm_, zero_grad, an assignment, ...): mode={reducer.mode!r} "
                "sends each gradient as backward produces it, so the change would be lost. "
                "Use mode='backward' or 'blocking', where p.grad holds the average once "
                "backward() returns and may be changed before step()"
            )
