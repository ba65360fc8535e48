"""The reducer: all a mode may use of the wrapper it serves, as one named object.

Theory of operation. ``DataParallel`` (data_parallel.py) owns one ``Reducer`` and hands it to
every hook of its mode (modes/), as DDP hands its reducer's ``state`` to a communication hook.
The reducer holds this rank's side of the gradient exchange: the buckets and where each
bucket's allreduce stands (buckets.py), the communicator, the one optimizer, the counters that
name a pass and a step, and the seconds spent waiting (stats.py). Its methods are the
mechanics every mode shares: ``post`` packs a bucket and sends it, ``gradients`` waits for an
update and hands out the averages, ``clear_gradients`` empties ``p.grad``. What is policy
(when to post, when to wait, what ``step()`` does) is the mode's; the reducer knows no mode,
so the modes import it and it imports none of them, nor the wrapper.

Fields are public and documented below; a mode reads them and writes only the buckets'
``inflight`` and ``update`` (and appends its own hooks to ``hooks``). The wrapper writes the
counters: ``generation`` when a step closes, ``passes`` through ``open_pass``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..comm import Communicator
from ..request import Request
from ..trace import Timeline
from .buckets import Bucket, Update
from .optimizer import DataParallelOptimizer
from .stats import CommStats

__all__ = ["Reducer"]


@dataclass(eq=False)
class Reducer:
    """The state a mode works on, and the mechanics it shares (see the module docstring).

    A reducer keeps no reference to its wrapper, so hooks that hold it (weakly, as they must
    not keep the model alive) never keep the wrapper alive either.
    """

    module: nn.Module  # the wrapped module
    optimizer: DataParallelOptimizer  # the one optimizer over every parameter
    mode: str  # the mode's name, for messages
    comm: Communicator  # every bucket's allreduce goes over it
    params: list[nn.Parameter]  # the trainable parameters, in registration order
    names: dict[int, str]  # id(parameter) -> its name in the module
    buckets: list[Bucket]  # the same on every rank, in the order the mode grouped them
    hooks: list[Any] = field(default_factory=list)  # every hook, removed with the wrapper's
    timeline: Timeline | None = None  # where waits and allreduces are recorded, if anywhere
    stats: CommStats = field(default_factory=CommStats)  # exposed and total comm seconds
    generation: int = 0  # steps closed so far (double_buffer alternates buffers by it)
    passes: int = 0  # synced backward passes so far (``Bucket.posted_pass`` counts in it)
    bucket_of: dict[int, Bucket] = field(init=False)  # id(parameter) -> its bucket

    def __post_init__(self) -> None:
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}

    def open_pass(self) -> None:
        """A synced backward pass begins: a new pass number, no bucket complete yet."""
        self.passes += 1
        for bucket in self.buckets:
            bucket.ready.clear()  # a backward that raised may have left some

    def unsent(self) -> Iterator[Bucket]:
        """The buckets not sent in this pass, each checked as it is reached."""
        return (bucket for bucket in self.buckets if bucket.posted_pass != self.passes)

    def post(self, bucket: Bucket) -> None:
        """Pack the bucket's gradients (zeros, flag 0, where None) and send them. Its update of
        an earlier step, if any, must have been dealt with (``Mode.post`` sees to that)."""
        if bucket.inflight is not None:  # an earlier pass of this step: superseded
            self.gradients(bucket, bucket.inflight)  # its buffer is reused: wait for it
        flat, flags = bucket.flat(self.generation), bucket.flags(self.generation)
        lacking = bucket.pack(flat, flags)
        request: Request[Any]
        if bucket.stager is None:
            request = self.comm.iallreduce(flat, "sum", name=bucket.name, priority=bucket.priority)
        else:
            host = bucket.host(self.generation)
            request = bucket.stager.iallreduce(
                flat, host, "sum", name=bucket.name, priority=bucket.priority
            )
        bucket.inflight = Update(request, flat, flags=flags if lacking else None)
        bucket.posted_pass = self.passes
        bucket.ready.clear()

    def gradients(self, bucket: Bucket, update: Update) -> list[torch.Tensor | None]:
        """The update's averaged gradients, waiting for its allreduce (timed as exposed)."""
        request = update.request
        if update.grads is None and request is not None:
            with self.stats.exposed():
                started = time.perf_counter()
                request.wait()
                ended = time.perf_counter()
            self.stats.completed(request)
            if self.timeline is not None:
                self.timeline.add(f"wait {bucket.name}", "train", started, ended)
                end = request.completed_at or ended
                self.timeline.add(f"allreduce {bucket.name}", "comm", request.posted_at, end)
        return update.gradients(bucket, self.comm.world_size)

    def clear_gradients(self) -> None:
        """Set every trainable parameter's gradient to None."""
        for p in self.params:
            p.grad = None
