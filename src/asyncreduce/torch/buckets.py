"""Buckets: parameters whose gradients travel together in one flat buffer.

Theory of operation. A bucket's buffer holds its parameters' gradients one after another,
followed by one "used" flag per parameter (for a staged bucket the flags are written and read
in the host twin's tail only, so no scalar ever crosses between host and device). ``pack``
fills it from ``p.grad`` (zeros and flag 0 where a rank has no gradient), the allreduce sums
it over ranks, and ``unpack`` divides the gradients by the world size in place and hands out
views of them: ``None`` where the flags add to 0 (no rank had a gradient, so the optimizer
leaves that parameter alone, as in single-process training), the average otherwise (ranks
without one contributed zeros).

Grouping: one bucket per module that owns trainable parameters directly (``layer_groups``,
forward mode, whose unit of overlap is the layer), or runs of parameters in reverse
registration order, the order backward produces them, up to a byte limit (``size_groups``).
A bucket holds one device and one dtype.

Buffers (``build_buckets``): CPU buckets are reduced in place, in buffers carved from one
shared window per dtype (``comm.shared_empty``), so with every rank on one host their
allreduces read the peers' buffers in place; CUDA buckets travel through a pinned host twin
of each buffer, by the device's staging thread (staging.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..comm import Communicator
from ..request import Request
from .optimizer import Hyper
from .staging import Stager, stager_for

__all__ = ["Bucket", "Update", "build_buckets", "layer_groups", "size_groups"]

Group = tuple[nn.Module | None, list[nn.Parameter]]


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients travel together, and where their allreduce stands."""

    name: str
    params: list[nn.Parameter]
    priority: int
    buffers: list[torch.Tensor]  # two in double_buffer mode, else one
    module: nn.Module | None = None  # forward mode: the layer that owns the parameters
    stager: Stager | None = None  # None: the buffers are on the CPU and reduced in place
    hosts: list[torch.Tensor] = field(default_factory=list)  # with a stager: one per buffer
    ready: set[int] = field(default_factory=set)  # params whose gradient is complete this pass
    posted_pass: int = -1  # the backward pass this bucket was last posted in
    inflight: Update | None = None  # this step's latest post, not yet handed to the optimizer
    update: Update | None = None  # forward, double_buffer: a finished step's, not yet applied
    sent: list[tuple[Any, int, tuple[float, float]]] = field(default_factory=list)  # changed()

    def flat(self, generation: int) -> torch.Tensor:
        return self.buffers[generation % len(self.buffers)]

    def host(self, generation: int) -> torch.Tensor:
        return self.hosts[generation % len(self.hosts)]

    @property
    def numel(self) -> int:
        """Elements of the gradients (the used-flags follow them)."""
        return sum(p.numel() for p in self.params)

    def flags(self, generation: int) -> torch.Tensor:
        """Where the used-flags travel: the host twin's tail (staged), else the buffer's."""
        whole = self.host(generation) if self.stager is not None else self.flat(generation)
        return whole[self.numel :]

    def pack(self, flat: torch.Tensor, flags: torch.Tensor) -> bool:
        """Gradients into ``flat`` and used-flags into ``flags`` (on the host where staged:
        no scalar crosses to the device); remember what was sent (see ``changed``). Returns
        whether this rank lacked a gradient: only then can a summed flag be 0, so only then
        must the flags be read back."""
        offset = 0
        sent: list[tuple[Any, int, tuple[float, float]]] = []
        unused: list[int] = []
        with torch.no_grad():
            for i, p in enumerate(self.params):
                piece = flat[offset : offset + p.numel()]
                grad = p.grad
                if grad is None:
                    piece.zero_()
                    sent.append((None, -1, (0.0, 0.0)))
                    unused.append(i)
                else:
                    if grad.data_ptr() != piece.data_ptr():  # a view of this very piece: as is
                        piece.copy_(grad.reshape(-1))
                    sent.append((weakref.ref(grad), grad._version, self._fingerprint(grad)))
                offset += p.numel()
            flags.fill_(1.0)
            for i in unused:
                flags[i] = 0.0
        self.sent = sent
        return bool(unused)

    def _fingerprint(self, grad: torch.Tensor) -> tuple[float, float]:
        """``_fingerprint`` of a gradient in host memory; nothing for a staged one or one on a
        device (reading a device tensor on the host would synchronize the training thread)."""
        on_host = self.stager is None and grad.device.type == "cpu"
        return _fingerprint(grad) if on_host else (0.0, 0.0)

    def changed(self) -> nn.Parameter | None:
        """The first parameter whose ``.grad`` was replaced or modified since it was packed:
        another tensor, a moved version counter (every in-place torch op), or, for a change
        through ``.data`` (which moves no counter), other values at 64 sampled places."""
        for p, (ref, version, print_) in zip(self.params, self.sent, strict=False):
            grad = p.grad
            if ref is None:
                if grad is not None:
                    return p
            elif (
                ref() is not grad
                or grad is None
                or grad._version != version
                or self._fingerprint(grad) != print_  # last: the costliest test
            ):
                return p
        return None


class Update:
    """One step's summed gradients of a bucket: posted (a request on ``flat``), or restored
    from a checkpoint (``grads`` already known); ``hyper``: forward mode's recorded
    hyper-parameters for them."""

    def __init__(
        self,
        request: Request[Any] | None,
        flat: torch.Tensor | None,
        grads: list[torch.Tensor | None] | None = None,
        hyper: Hyper | None = None,
        flags: torch.Tensor | None = None,
    ) -> None:
        self.request = request
        self.flat = flat
        self.flags = flags  # the summed used-flags to read back; None: every one is used
        self.grads = grads
        self.hyper = hyper

    def gradients(self, bucket: Bucket, world: int) -> list[torch.Tensor | None]:
        """The averaged gradients (views of the buffer), once the allreduce is done: call
        ``wait`` first where waiting is timed."""
        if self.grads is None:
            assert self.request is not None and self.flat is not None
            self.request.wait()  # staged: also orders this thread's stream after the copy back
            self.grads = unpack(bucket.params, self.flat, self.flags, world)
        return self.grads


def _fingerprint(grad: torch.Tensor) -> tuple[float, float]:
    """A position-weighted sum and the sum of squares of 64 evenly spaced elements. A plain
    sum would miss a scaled gradient whose elements add to zero, as a softmax bias's do."""
    flat = grad.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // 64)].double()
    weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64)
    return (float((sample * weights).sum()), float((sample * sample).sum()))


def unpack(
    params: list[nn.Parameter], flat: torch.Tensor, flags: torch.Tensor | None, world: int
) -> list[torch.Tensor | None]:
    """The average of each parameter's gradient in ``flat`` (the sum), or None if no rank had
    one (its summed flag in ``flags`` is 0; ``flags`` None: this rank had every one); divided
    in place, so the results are views of ``flat``."""
    used = flags.tolist() if flags is not None else [1.0] * len(params)
    grads: list[torch.Tensor | None] = []
    offset = 0
    with torch.no_grad():
        if world > 1:
            flat[: sum(p.numel() for p in params)].div_(world)  # the average, in place
        for p, users in zip(params, used, strict=True):
            grads.append(None if users == 0.0 else flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    return grads


def layer_groups(module: nn.Module) -> list[Group]:
    """One group per module that owns trainable parameters directly, in registration order
    (split by dtype and device: a bucket's buffer has one of each)."""
    groups: list[Group] = []
    seen: set[int] = set()
    for sub in module.modules():
        own = [p for p in sub.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in own:
            by_kind.setdefault(_kind(p), []).append(p)
        groups += [(sub, ps) for ps in by_kind.values()]
    return groups


def size_groups(params: list[nn.Parameter], limit: int) -> list[Group]:
    """Runs of parameters in reverse registration order, up to ``limit`` bytes, one dtype and
    one device each."""
    groups: list[Group] = []
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


def build_buckets(
    comm: Communicator, prefix: str, groups: list[Group], priorities: list[int], copies: int
) -> list[Bucket]:
    """One bucket per group, named ``{prefix}.bucket{i}``, with ``copies`` buffers each (see
    the module docstring): a staged bucket's buffers hold the gradients, and each one's host
    twin the gradients and the flags; any other bucket's buffers hold both."""
    sizes = [sum(p.numel() for p in group) + len(group) for _, group in groups]
    stagers = [stager_for(comm, group[0].device) for _, group in groups]
    shared = _shared_buffers(comm, [g for _, g in groups], sizes, copies, stagers)
    buckets = []
    for i, (module, group) in enumerate(groups):
        device, dtype, stager = group[0].device, group[0].dtype, stagers[i]
        length = sizes[i] - len(group) if stager is not None else sizes[i]
        buffers = shared.get(i) or [
            torch.zeros(length, dtype=dtype, device=device) for _ in range(copies)
        ]
        bucket = Bucket(f"{prefix}.bucket{i}", group, priorities[i], buffers, module, stager)
        if stager is not None:
            bucket.hosts = [stager.host_buffer(sizes[i], dtype) for _ in buffers]
        buckets.append(bucket)
    return buckets


def _shared_buffers(
    comm: Communicator,
    groups: list[list[nn.Parameter]],
    sizes: list[int],
    copies: int,
    stagers: list[Stager | None],
) -> dict[int, list[torch.Tensor]]:
    """The buffers of the CPU buckets, carved from one shared window per dtype
    (``comm.shared_empty``: collective, and the same on every rank, like the buckets), so
    that on one host their allreduces read the peers' buffers in place; elsewhere the
    window is an ordinary array. {bucket index: its buffers}."""
    out: dict[int, list[torch.Tensor]] = {}
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, group in enumerate(groups):
        unstaged_cpu = group[0].device.type == "cpu" and stagers[i] is None
        if unstaged_cpu and group[0].dtype != torch.bfloat16:
            by_dtype.setdefault(group[0].dtype, []).append(i)  # numpy has no bfloat16
    for dtype, mine in sorted(by_dtype.items(), key=lambda item: str(item[0])):
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        window = comm.shared_empty(sum(sizes[i] for i in mine) * copies, np_dtype)
        window[:] = 0
        offset = 0
        for i in mine:
            out[i] = []
            for _ in range(copies):
                out[i].append(torch.from_numpy(window[offset : offset + sizes[i]]))
                offset += sizes[i]
    return out


def _kind(p: nn.Parameter) -> tuple[torch.dtype, torch.device]:
    return p.dtype, p.device
