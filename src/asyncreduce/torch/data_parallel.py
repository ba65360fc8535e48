"""Data-parallel training that overlaps gradient allreduce with computation.

Theory of operation. Parameters are grouped into buckets (buckets.py): one per layer in
``forward`` mode, runs of parameters up to ``bucket_bytes`` otherwise. Every synced backward
pass (one outside ``no_sync()``) sends every bucket exactly once, so every rank posts the same
operations however its graph looked:

* A post-accumulate-grad hook marks a parameter ready once its gradient is complete (after
  every use: a parameter used many times, as in an LSTM or tied weights, is sent once). The
  first hook of a pass queues autograd's final callback, which runs when ``backward()`` is
  about to return. Except in ``blocking`` mode, a bucket is packed and ``iallreduce``-d (sum,
  named after the bucket) as soon as all its parameters are ready; the final callback posts
  the buckets this rank's graph did not complete (unused parameters send zeros, flag 0).
* What then happens is the mode (modes/), a policy object the wrapper composes at a few
  hooks; each hook is handed the wrapper's ``Reducer`` (reducer.py: the buckets, the
  optimizer, the stats, posting and waiting), never the wrapper. ``blocking`` and
  ``backward`` wait in the final callback, so every ``p.grad`` holds the average when
  ``backward()`` returns (the DDP way). ``forward`` and ``double_buffer`` wait for nothing
  (``step()`` closes the step) and apply the updates later: each layer's in its forward
  pre-hook, or all of them one step stale. In those two modes ``p.grad`` still holds this
  rank's own gradient after backward, and changing it before ``step()`` is an error (what
  was sent would differ).
* Accumulation: gradients accumulate in ``p.grad`` as usual. Each synced pass sends the whole
  accumulated gradient; a later pass of the same step supersedes an earlier one (its result is
  waited for and dropped). Since averaging is linear this gives what DDP gives: the sum over
  passes of the averages. Inside ``no_sync()`` nothing is sent.
* ``optimizer`` (optimizer.py) is the one torch optimizer over every parameter; ``step()`` of
  the wrapper and of ``model.optimizer`` are the same call. Buffers follow DDP (replicas.py);
  the updates still pending go into a checkpoint through ``wrapper_state_dict`` (checkpoint.py).

Devices. A bucket holds parameters of one device and dtype: CPU buckets are reduced in place,
CUDA buckets through a pinned host twin (buckets.py, staging.py); every wait is a request
``wait()``, which orders this thread's current stream after the copy back.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable

from ..comm import Communicator
from ..errors import ClosedError, UsageError
from ..trace import Timeline
from .buckets import Bucket, build_buckets
from .checkpoint import load_pending_state, pending_state
from .join import Joining
from .modes import MODES, mode_for
from .optimizer import DataParallelOptimizer
from .reducer import Reducer
from .replicas import BufferSync, broadcast_tensors, check_same_everywhere
from .staging import stager_for

__all__ = ["DataParallel", "MODES"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
_NEEDS_ALL_GRADIENTS = (torch.optim.LBFGS,)  # re-evaluates the whole model in step()
_WRAPPED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[DataParallel]] = (
    weakref.WeakKeyDictionary()
)


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training over ``comm`` (see the module docstring).

    ``optimizer`` is a factory, ``lambda params: torch.optim.SGD(params, lr=0.1)``, called once
    with ``list(module.parameters())``; the optimizer it makes is ``model.optimizer``.
    ``broadcast_buffers``: as DDP's, rank 0's buffers on every rank at construction and
    before each forward that follows a training forward; False leaves each rank's buffers
    alone. ``timeline``: record forward, backward, every allreduce and every wait into it.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        optimizer: OptimizerFactory,
        mode: str = "forward",
        bucket_bytes: int = 4 << 20,
        timeline: Timeline | None = None,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__()
        _check_arguments(module, mode, optimizer)
        self.module = module
        self.mode = mode
        self._mode = mode_for(mode)  # what the mode does at each hook (modes/)
        self._comm = comm
        self._sync = True
        self._pass_open = False  # a synced pass is running: its final callback is queued
        self._passes = 0  # synced passes in this step
        self._forward_end = 0.0
        self._closed = False
        self._joining = Joining(self)
        named = list(module.named_parameters())  # frozen ones too: DDP syncs those as well
        params = [p for _, p in named if p.requires_grad]
        for device in {p.device for p in params}:
            stager_for(comm, device)  # a device we cannot communicate from fails here, clearly
        self._prefix = _next_prefix(comm)  # wrappers are built in the same order on every rank
        check_same_everywhere(comm, named, "parameter")
        broadcast_tensors(comm, [p for _, p in named], f"{self._prefix}.init")
        self._buffer_sync = BufferSync(comm, module, self._prefix, broadcast_buffers)
        if broadcast_buffers:
            check_same_everywhere(comm, list(module.named_buffers()), "buffer")
            broadcast_tensors(comm, self._buffer_sync.buffers(), f"{self._prefix}.buffers-init")
        groups = self._mode.groups(module, params, bucket_bytes)
        priorities = [self._mode.priority(i, len(groups)) for i in range(len(groups))]
        buckets = build_buckets(comm, self._prefix, groups, priorities, self._mode.copies)
        self.optimizer = DataParallelOptimizer(
            _made(optimizer(list(module.parameters()))),
            weakref.WeakMethod(self._step),
            deferred=not self._mode.averaged_in_backward,
        )
        if not self._mode.averaged_in_backward and isinstance(
            self.optimizer.inner, _NEEDS_ALL_GRADIENTS
        ):
            raise UsageError(
                f"{type(self.optimizer.inner).__name__} needs all gradients at once, so it "
                f"cannot step layer by layer in mode={mode!r}; use mode='backward'"
            )
        self._reducer = Reducer(
            module=module,
            optimizer=self.optimizer,
            mode=mode,
            comm=comm,
            params=params,
            names={id(p): n for n, p in named},
            buckets=buckets,
            timeline=timeline,
        )
        self._reducer.hooks.extend(self._install_hooks())
        weakref.finalize(self, _remove_all, self._reducer.hooks)
        _WRAPPED[module] = weakref.ref(self)

    @property
    def timeline(self) -> Timeline | None:
        """Where forward, backward, every allreduce and every wait are recorded (None: not)."""
        return self._reducer.timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        self._reducer.timeline = timeline

    @property
    def _buckets(self) -> list[Bucket]:
        """The buckets (tests and benchmarks count them)."""
        return self._reducer.buckets

    # ---- set-up ------------------------------------------------------------------------------

    def _install_hooks(self) -> list[Any]:
        me = weakref.ref(self)  # hooks must not keep the wrapper alive (close on collection)

        def grad_ready(param: torch.Tensor) -> None:
            wrapper = me()
            if wrapper is not None:
                wrapper._on_grad_ready(param)

        hooks: list[Any] = [
            p.register_post_accumulate_grad_hook(grad_ready)  # type: ignore[no-untyped-call]
            for p in self._reducer.params
        ]
        return hooks + self._mode.install_hooks(self._reducer)

    # ---- the training loop ---------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open("forward")
        start = time.perf_counter()
        self._pass_open = False  # a backward that raised never ran its final callback
        root = 0  # whose buffers count: rank 0, or under join() the highest still training
        if self._joining.active:
            root = self._joining.notify(self._buffer_sync.due, self._sync)
        self._buffer_sync.before_forward(root)
        settle = self._mode.watch_forward(self._reducer)
        try:
            out = self.module(*args, **kwargs)
        finally:
            if settle is not None:
                settle()
        self._buffer_sync.after_forward(self._sync)
        self._forward_end = time.perf_counter()
        if self.timeline is not None:
            self.timeline.add("forward", "train", start, self._forward_end)
        return out

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """What the mode says, then the gradients are cleared; the same as
        ``model.optimizer.step()`` (call either, then your LR scheduler's ``step()``).
        ``closure`` (LBFGS): blocking and backward modes only."""
        return self.optimizer.step(closure)

    def _step(self, closure: Callable[[], float] | None) -> Any:
        self._check_open("step")
        if self.timeline is not None and self._forward_end:
            self.timeline.add("backward", "train", self._forward_end, time.perf_counter())
        started = time.perf_counter()
        if closure is not None and not self._mode.averaged_in_backward:
            raise UsageError(
                f"step(closure) re-evaluates the model, which mode={self.mode!r} cannot do "
                "(it applies updates later); use mode='backward'"
            )
        if closure is None and self._passes == 0:
            self._open_pass()  # no synced backward this step: send what there is (maybe none)
            self._end_pass()
        result = self._mode.step(self._reducer, closure)
        self._reducer.clear_gradients()
        self._reducer.generation += 1
        self._passes = 0
        if self.timeline is not None:
            self.timeline.add("step", "train", started, time.perf_counter())
        return result

    def synchronize(self) -> None:
        """Apply every pending update: parameters are final (evaluation, the end of training;
        for a checkpoint that resumes exactly, see ``wrapper_state_dict``)."""
        self._check_open("synchronize")
        self._mode.synchronize(self._reducer)

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """Uneven inputs, as DDP's ``Join``: wrap the training loop; a rank whose data ends
        first shadows the others' communication until every rank's has, then every rank takes
        the final model of the last to finish (see join.py). One backward per forward."""
        self._check_open("join")
        self._joining.active = True
        try:
            yield
        except BaseException:
            self._joining.active = False
            raise
        self._joining.active = False
        self._joining.shadow_until_all_joined()

    def _shadow_backward(self) -> None:
        """join(): the synced backward pass of the ranks still training, with zeros here."""
        reducer = self._reducer
        saved = [p.grad for p in reducer.params]
        reducer.clear_gradients()
        self._open_pass()
        self._end_pass()  # every bucket posted with flag 0; blocking/backward wait here
        for bucket in reducer.buckets:
            update, bucket.inflight = bucket.inflight, None
            if update is not None:
                reducer.gradients(bucket, update)
        for p, g in zip(reducer.params, saved, strict=True):
            p.grad = g
        self._passes = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward outside sends the accumulated sum."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def stats(self, reset: bool = False) -> dict[str, float]:
        """Seconds of communication the training thread was exposed to (``exposed_s``; in
        blocking mode all of it), seconds any allreduce was in flight (``comm_s``), and
        ``hidden_share``; ``reset``: start counting afresh after this call."""
        snapshot = self._reducer.stats.snapshot()
        if reset:
            self._reducer.stats.reset()
        return snapshot

    def close(self) -> None:
        """Remove every hook (also done when the wrapper is garbage collected); the module can
        then be wrapped again. Pending updates are not applied: ``synchronize()`` first."""
        if self._closed:
            return
        self._closed = True
        _remove_all(self._reducer.hooks)
        owner = _WRAPPED.get(self.module)
        if owner is not None and owner() is self:
            del _WRAPPED[self.module]

    # ---- checkpoints ---------------------------------------------------------------------------

    def wrapper_state_dict(self) -> dict[str, Any]:
        """The wrapper's own state: the updates still pending (forward and double_buffer), by
        parameter name, averaged; with ``model.state_dict()`` and
        ``model.optimizer.state_dict()`` saved at the same point, a run resumed from the three
        continues exactly where this one goes on. Waits for the pending allreduces."""
        self._check_open("wrapper_state_dict")
        return pending_state(self._reducer)

    def load_wrapper_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``wrapper_state_dict`` saved, before the first step of the resumed run."""
        self._check_open("load_wrapper_state_dict")
        load_pending_state(self._reducer, state)

    # ---- backward passes -------------------------------------------------------------------------

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync or self._closed:
            return
        if not self._pass_open:
            self._open_pass()
            Variable._execution_engine.queue_callback(self._end_pass)
        bucket = self._reducer.bucket_of[id(param)]
        if bucket.update is not None:
            self._mode.used_while_pending(self._reducer, param)
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params) and self._mode.posts_early:
            self._mode.post(self._reducer, bucket)

    def _open_pass(self) -> None:
        self._pass_open = True
        self._reducer.open_pass()

    def _end_pass(self) -> None:
        """The end of a synced backward pass: what the mode does then (``Mode.end_pass``:
        every bucket not sent in it is sent; blocking and backward then wait for the averages
        and put them in ``p.grad``)."""
        self._pass_open = False
        self._passes += 1
        self._mode.end_pass(self._reducer)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{what}: this DataParallel was closed")


# ---- helpers -----------------------------------------------------------------------------


def _check_arguments(module: nn.Module, mode: str, optimizer: Any) -> None:
    if mode not in MODES:
        raise UsageError(f"mode={mode!r} is not one of {', '.join(MODES)}")
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(
            "optimizer must be a factory: lambda params: torch.optim.SGD(params, ...); the "
            "optimizer it makes is model.optimizer"
        )
    if isinstance(module, DataParallel):
        raise UsageError("this module is a DataParallel already; wrap the module inside it")
    previous = _WRAPPED.get(module)
    if previous is not None and previous() is not None:
        raise UsageError(
            "this module is wrapped by another DataParallel already, whose hooks would send "
            "its gradients too; call close() on that one first"
        )


def _made(optimizer: Any) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(
            f"the optimizer factory returned {type(optimizer).__name__}, "
            "not a torch.optim.Optimizer"
        )
    return optimizer


def _remove_all(hooks: list[Any]) -> None:
    for hook in hooks:
        hook.remove()


_WRAPPERS: weakref.WeakKeyDictionary[Communicator, int] = weakref.WeakKeyDictionary()


def _next_prefix(comm: Communicator) -> str:
    """A name prefix per wrapper, so two models on one communicator never share bucket names."""
    index = _WRAPPERS.get(comm, 0)
    _WRAPPERS[comm] = index + 1
    return f"asyncreduce.dp{index}"
