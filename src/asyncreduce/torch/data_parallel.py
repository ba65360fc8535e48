"""Data-parallel training that overlaps gradient allreduce with computation.

Theory of operation. Parameters are grouped into buckets: one per layer (a module that owns
parameters directly) in ``forward`` mode, or runs of parameters in reverse registration order
up to ``bucket_bytes`` otherwise (the order in which backward produces them). Each bucket has a
flat buffer holding its gradients followed by one "used" flag per parameter.

* A post-accumulate-grad hook marks a parameter ready once its gradient is complete (after
  every use, so a parameter used many times, as in an LSTM or tied weights, is sent once).
  When every parameter of a bucket is ready, its buffer is filled and ``iallreduce``-d (sum,
  named after the bucket, so ranks may finish buckets in any order).
* ``step()`` posts the buckets whose hooks did not all fire (parameters this rank did not use
  send zeros with flag 0), so every rank posts the same operations without a graph walk.
  After the sum, a parameter whose flags add to 0 was unused on every rank: its grad stays
  None and the optimizer leaves it alone, as in single-process training; otherwise its grad is
  the sum divided by the world size (ranks that did not use it contributed zeros).
* What ``step()`` then does is the mode: ``blocking`` posts everything only now and waits;
  ``backward`` waits for what backward already posted (the DDP way); ``forward`` waits for
  nothing: each layer's bucket is waited for, unpacked and stepped by its own optimizer just
  before that layer's next forward (a forward pre-hook), so communication overlaps the rest of
  backward and the next forward; ``double_buffer`` applies the previous step's gradients (one
  step stale) while this step's travel. ``synchronize()`` applies whatever is pending.

Devices. A bucket holds parameters of one device and dtype. CPU buckets are reduced in place
(no copy), and their buffers are carved from one shared window per dtype
(``comm.shared_empty``), so with every rank on one host their allreduces read the peers'
buffers in place instead of sending them; CUDA buckets travel through a pinned host twin of
their buffer (one per buffer, allocated once) by the device's staging thread (staging.py), and
every wait point above is a request ``wait()``, which orders this thread's current stream
after the copy back.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ..comm import Communicator
from ..errors import MismatchError, UsageError
from ..request import Request
from ..trace import Timeline
from .staging import Stager, stager_for

__all__ = ["DataParallel", "MODES"]

MODES = ("blocking", "backward", "forward", "double_buffer")
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
_NEEDS_ALL_GRADIENTS = (torch.optim.LBFGS,)  # re-evaluates the whole model in step()
_MAX_DIMS = 8


@dataclass(eq=False)
class _Bucket:
    """Parameters whose gradients travel together, and where their allreduce stands."""

    name: str
    params: list[nn.Parameter]
    priority: int
    buffers: list[torch.Tensor]  # two in double_buffer mode, else one
    module: nn.Module | None = None  # forward mode: the layer that owns the parameters
    optimizer: torch.optim.Optimizer | None = None  # forward mode: its own optimizer
    ready: set[int] = field(default_factory=set)
    posted: list[tuple[Request[Any], torch.Tensor]] = field(default_factory=list)  # oldest first
    posted_in: int = -1  # the last generation (step) this bucket was posted in
    stager: Stager | None = None  # None: the buffers are on the CPU and reduced in place
    hosts: list[torch.Tensor] = field(default_factory=list)  # with a stager: one per buffer

    def flat(self, generation: int) -> torch.Tensor:
        return self.buffers[generation % len(self.buffers)]

    def host(self, generation: int) -> torch.Tensor:
        return self.hosts[generation % len(self.hosts)]


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training over ``comm`` (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        optimizer: OptimizerFactory,
        mode: str = "forward",
        bucket_bytes: int = 4 << 20,
        timeline: Timeline | None = None,
    ) -> None:
        """``timeline``: record forward, backward, every allreduce and every wait into it
        (``timeline.write(path)`` gives Chrome trace JSON that Perfetto opens)."""
        super().__init__()
        if mode not in MODES:
            raise UsageError(f"mode={mode!r} is not one of {', '.join(MODES)}")
        if not callable(optimizer):
            raise UsageError(
                "optimizer must be a factory: lambda params: torch.optim.SGD(params, ...)"
            )
        self.module = module
        self.mode = mode
        self._comm = comm
        self._sync = True
        self._generation = 0
        self._exposed = 0.0
        self.timeline = timeline
        self._forward_end = 0.0
        self._busy = _BusyClock()
        params = [p for p in module.parameters() if p.requires_grad]
        for device in {p.device for p in params}:
            stager_for(comm, device)  # a device we cannot communicate from fails here, clearly
        self._params = params
        self._prefix = _next_prefix(comm)  # wrappers are built in the same order on every rank
        _check_same_everywhere(comm, module)
        _broadcast_from_rank0(comm, params)
        self._buckets = self._make_buckets(params, bucket_bytes)
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._optimizer = self._make_optimizers(optimizer, params)
        self._hooks = self._install_hooks(params)

    # ---- set-up ------------------------------------------------------------------------------

    def _make_buckets(self, params: list[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
        groups = (
            _layer_groups(self.module)
            if self.mode == "forward"
            else _size_groups(params, bucket_bytes)
        )
        copies = 2 if self.mode == "double_buffer" else 1
        sizes = [sum(p.numel() for p in group) + len(group) for _, group in groups]
        shared = self._shared_buffers([g for _, g in groups], sizes, copies)
        buckets = []
        for i, (module, group) in enumerate(groups):
            size = sizes[i]
            device, dtype = group[0].device, group[0].dtype
            buffers = shared.get(i) or [
                torch.zeros(size, dtype=dtype, device=device) for _ in range(copies)
            ]
            priority = len(groups) - i if self.mode == "forward" else 0  # nearest the input first
            bucket = _Bucket(f"{self._prefix}.bucket{i}", group, priority, buffers, module)
            bucket.stager = stager_for(self._comm, device)
            if bucket.stager is not None:
                bucket.hosts = [bucket.stager.host_buffer(b) for b in buffers]
            buckets.append(bucket)
        return buckets

    def _shared_buffers(
        self, groups: list[list[nn.Parameter]], sizes: list[int], copies: int
    ) -> dict[int, list[torch.Tensor]]:
        """The buffers of the CPU buckets, carved from one shared window per dtype
        (``comm.shared_empty``: collective, and the same on every rank, like the buckets), so
        that on one host their allreduces read the peers' buffers in place; elsewhere the
        window is an ordinary array. {bucket index: its buffers}."""
        out: dict[int, list[torch.Tensor]] = {}
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, group in enumerate(groups):
            if group[0].device.type == "cpu" and group[0].dtype != torch.bfloat16:
                by_dtype.setdefault(group[0].dtype, []).append(i)  # numpy has no bfloat16
        for dtype, mine in sorted(by_dtype.items(), key=lambda item: str(item[0])):
            np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
            window = self._comm.shared_empty(sum(sizes[i] for i in mine) * copies, np_dtype)
            window[:] = 0
            offset = 0
            for i in mine:
                out[i] = []
                for _ in range(copies):
                    out[i].append(torch.from_numpy(window[offset : offset + sizes[i]]))
                    offset += sizes[i]
        return out

    def _make_optimizers(
        self, factory: OptimizerFactory, params: list[nn.Parameter]
    ) -> torch.optim.Optimizer | None:
        if self.mode != "forward":
            return _checked(factory(params), "")
        for bucket in self._buckets:
            bucket.optimizer = _checked(factory(bucket.params), bucket.name)
            if isinstance(bucket.optimizer, _NEEDS_ALL_GRADIENTS):
                raise UsageError(
                    f"{type(bucket.optimizer).__name__} needs all gradients at once, so it cannot "
                    "step layer by layer in mode='forward'; use mode='backward'"
                )
        return None

    def _install_hooks(self, params: list[nn.Parameter]) -> list[Any]:
        hooks: list[Any] = []
        if self.mode != "blocking":
            ready = self._on_grad_ready
            hooks += [p.register_post_accumulate_grad_hook(ready) for p in params]  # type: ignore[no-untyped-call]
        if self.mode == "forward":
            for bucket in self._buckets:
                assert bucket.module is not None
                hook = bucket.module.register_forward_pre_hook(
                    lambda m, a, b=bucket: self._apply_pending(b)
                )
                hooks.append(hook)
        return hooks

    # ---- the training loop ---------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = self.module(*args, **kwargs)
        self._forward_end = time.perf_counter()
        if self.timeline is not None:
            self.timeline.add("forward", "train", start, self._forward_end)
        return out

    def step(self) -> None:
        """Post what backward did not; then wait and step as the mode says; clear gradients."""
        if self.timeline is not None and self._forward_end:
            self.timeline.add("backward", "train", self._forward_end, time.perf_counter())
        started = time.perf_counter()
        self._step()
        if self.timeline is not None:
            self.timeline.add("step", "train", started, time.perf_counter())

    def _step(self) -> None:
        for bucket in self._buckets:
            self._post(bucket)  # what backward did not (every mode posts the same operations)
        _clear(self._params)  # the gradients now live in the buckets' buffers
        if self.mode in ("blocking", "backward"):
            self._apply_all(oldest=False)
        elif self.mode == "double_buffer" and self._generation > 0:
            self._apply_all(oldest=True)  # the previous step's gradients: one step stale
        self._generation += 1  # forward mode applies each layer's update before its next forward

    def _apply_all(self, oldest: bool) -> None:
        for bucket in self._buckets:
            self._unpack(bucket, oldest)
        assert self._optimizer is not None
        self._optimizer.step()
        _clear(self._params)

    def synchronize(self) -> None:
        """Apply every pending gradient: parameters are final (checkpoint, evaluation, end)."""
        if self.mode == "forward":
            for bucket in self._buckets:
                self._apply_pending(bucket)
        elif self.mode == "double_buffer" and any(b.posted for b in self._buckets):
            self._apply_all(oldest=True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward outside sends the accumulated sum."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def stats(self) -> dict[str, float]:
        """Seconds the training thread waited on communication (exposed) vs spent in it (comm)."""
        comm = self._busy.total
        hidden = 1.0 - self._exposed / comm if comm else 0.0
        return {
            "exposed_s": self._exposed,
            "comm_s": comm,
            "hidden_share": min(1.0, max(0.0, hidden)),
        }

    # ---- buckets ---------------------------------------------------------------------------------

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params) and self.mode != "blocking":
            self._post(bucket)

    def _post(self, bucket: _Bucket) -> None:
        """Fill the bucket's buffer from the gradients (zeros, flag 0, where None) and send it."""
        if bucket.posted_in == self._generation:
            return  # already posted this step
        if self.mode == "forward" and bucket.posted:
            self._apply_pending(bucket)  # its layer did not run since: update before reuse
        flat = bucket.flat(self._generation)
        offset, flags = 0, flat.numel() - len(bucket.params)
        with torch.no_grad():
            for i, p in enumerate(bucket.params):
                piece = flat[offset : offset + p.numel()]
                if p.grad is None:
                    piece.zero_()
                else:
                    piece.copy_(p.grad.reshape(-1))
                flat[flags + i] = 0.0 if p.grad is None else 1.0
                offset += p.numel()
        request: Request[Any]
        if bucket.stager is None:
            request = self._comm.iallreduce(flat, "sum", name=bucket.name, priority=bucket.priority)
        else:
            host = bucket.host(self._generation)
            request = bucket.stager.iallreduce(
                flat, host, "sum", name=bucket.name, priority=bucket.priority
            )
        bucket.posted.append((request, flat))
        bucket.posted_in = self._generation
        bucket.ready.clear()

    def _unpack(self, bucket: _Bucket, oldest: bool = False) -> None:
        """Wait for the bucket's allreduce and set each parameter's averaged gradient."""
        if not bucket.posted:
            return
        request, flat = bucket.posted.pop(0 if oldest else -1)
        started = time.perf_counter()
        request.wait()  # staged: also orders this thread's current stream after the copy back
        ended = time.perf_counter()
        self._exposed += ended - started
        self._busy.add(request)
        if self.timeline is not None:
            self.timeline.add(f"wait {bucket.name}", "train", started, ended)
            self.timeline.add(
                f"allreduce {bucket.name}", "comm", request.posted_at, request.completed_at or ended
            )
        world = self._comm.world_size
        flags = flat.numel() - len(bucket.params)
        used = flat[flags:].tolist()
        offset = 0
        with torch.no_grad():
            if world > 1:
                flat[:flags].div_(world)  # the average, in place: one pass, no copy
            for p, users in zip(bucket.params, used, strict=True):
                if users == 0.0:
                    p.grad = None  # unused on every rank: as in single-process training
                else:
                    # a view of the bucket: the optimizer steps and the gradients are
                    # cleared before the bucket is refilled (forward: _apply_pending runs
                    # before _post reuses it; double_buffer alternates two buffers)
                    p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()

    def _apply_pending(self, bucket: _Bucket) -> None:
        """forward mode: this layer is about to run; apply its pending update first."""
        if not bucket.posted:
            return
        self._unpack(bucket)
        assert bucket.optimizer is not None
        bucket.optimizer.step()
        _clear(bucket.params)


# ---- helpers -----------------------------------------------------------------------------


def _clear(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        p.grad = None


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


_WRAPPERS: weakref.WeakKeyDictionary[Communicator, int] = weakref.WeakKeyDictionary()


def _next_prefix(comm: Communicator) -> str:
    """A name prefix per wrapper, so two models on one communicator never share bucket names."""
    index = _WRAPPERS.get(comm, 0)
    _WRAPPERS[comm] = index + 1
    return f"asyncreduce.dp{index}"


def _checked(optimizer: Any, where: str) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(
            f"the optimizer factory returned {type(optimizer).__name__}, "
            "not a torch.optim.Optimizer"
        )
    return optimizer


def _layer_groups(module: nn.Module) -> list[tuple[nn.Module | None, list[nn.Parameter]]]:
    """One group per module that owns trainable parameters directly, in registration order
    (split by dtype and device: a bucket's buffer has one of each)."""
    groups: list[tuple[nn.Module | None, list[nn.Parameter]]] = []
    seen: set[int] = set()
    for sub in module.modules():
        own = [p for p in sub.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in own:
            by_kind.setdefault(_kind(p), []).append(p)
        groups += [(sub, ps) for ps in by_kind.values()]
    return groups


def _kind(p: nn.Parameter) -> tuple[torch.dtype, torch.device]:
    return p.dtype, p.device


def _size_groups(
    params: list[nn.Parameter], limit: int
) -> list[tuple[nn.Module | None, list[nn.Parameter]]]:
    """Runs of parameters in reverse registration order, up to ``limit`` bytes, one dtype and
    one device each."""
    groups: list[tuple[nn.Module | None, list[nn.Parameter]]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > limit or _kind(p) != _kind(current[0])):
            groups.append((None, current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        groups.append((None, current))
    return groups


def _check_same_everywhere(comm: Communicator, module: nn.Module) -> None:
    """Every rank must wrap the same architecture: compare parameter names' shapes."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    count = comm.allgather(np.array([len(named)], np.int64))
    if len(set(count.reshape(-1).tolist())) != 1:
        raise MismatchError(
            f"ranks wrap modules with different numbers of parameters: {count.reshape(-1).tolist()}"
        )
    table = np.full((len(named), _MAX_DIMS + 1), -1, np.int64)
    for i, (_, p) in enumerate(named):
        table[i, 0] = p.dim()
        table[i, 1 : 1 + min(p.dim(), _MAX_DIMS)] = list(p.shape)[:_MAX_DIMS]
    everyone = comm.allgather(table)
    for i, (name, p) in enumerate(named):
        for rank, theirs in enumerate(everyone):
            if not np.array_equal(theirs[i], table[i]):
                shape = tuple(int(d) for d in theirs[i, 1 : 1 + theirs[i, 0]])
                raise MismatchError(
                    f"parameter {name!r} has shape {tuple(p.shape)} on rank {comm.rank} but "
                    f"{shape} on rank {rank}: every rank must wrap the same model"
                )


def _broadcast_from_rank0(comm: Communicator, params: list[nn.Parameter]) -> None:
    """Rank 0's initial values everywhere (once, blocking: device parameters via a host copy)."""
    with torch.no_grad():
        hosts = [p.data if p.device.type == "cpu" else p.detach().cpu() for p in params]
        requests = [
            comm.ibroadcast(h, root=0, name=f"asyncreduce.dp.init{i}") for i, h in enumerate(hosts)
        ]
        for r in requests:
            r.wait()
        for p, h in zip(params, hosts, strict=True):
            if p.device.type != "cpu":
                p.copy_(h)
