"""The two models of the scaling benchmark (not a benchmark itself): an emulated ResNet-50 and a
small real CNN.

Theory of operation
-------------------
**Model A, ResNet-50 emulated.** ``resnet50_layers()`` derives, from the architecture as
torchvision defines it (``resnet50``: a 7x7 stem, then Bottleneck blocks ``[3, 4, 6, 3]`` of
widths 64, 128, 256, 512 with expansion 4, the stride on the 3x3 convolution, a 1x1
downsample convolution and batch norm on the first block of each stage, a 2048 -> 1000
classifier; 224 x 224 input), every layer that owns parameters, in torchvision's registration
order: 53 convolutions (weights only), 53 batch norms (weight and bias) and the classifier
(weight and bias): 161 tensors, 25,557,032 parameters, 102.2 MB of float32. Each layer also gets
its forward FLOPs per image: ``2 * H_out * W_out * C_out * C_in * k * k`` for a convolution,
``8 * H * W * C`` for a batch norm (statistics, normalisation, scale and shift), ``2 * 2048 *
1000`` for the classifier (~8.2 GFLOPs in all, the usual 4.1 G multiply-adds).

``EmulatedResNet50(seconds)`` holds one ``EmulatedLayer`` per such layer, with parameters of
exactly those shapes, and runs them as one chain in registration order (which, for
torchvision's Bottleneck, is also the execution order: conv1, bn1, conv2, bn2, conv3, bn3,
then the downsample branch). One iteration's compute, ``seconds``, is split over the layers in
proportion to their FLOPs, one third to the forward pass and two thirds to the backward pass
(a backward computes the gradients of both the input and the weights: twice the forward's
work). Each layer calls a custom ``torch.autograd.Function`` that **sleeps** for its share in
``forward`` and in ``backward``, where it also returns a gradient for every parameter, so the
autograd engine accumulates gradients layer by layer, in reverse order, and every
post-accumulate-grad hook (what ``DataParallel`` and DDP rely on) fires when that layer's
backward ends, as on real hardware. The activations are a tiny tensor: only time and
parameters are emulated.

Why sleep and not spin: on a GPU the training thread launches kernels and waits, and the CPU
cores stay free for the communication thread. Sleeping reproduces exactly that; a busy-wait
would take a core away from the progress thread and the kernel's network stack, and with K
ranks on this machine's 2 cores the CPU, not the link, would decide the result. The CPU work
that remains real (creating gradients, copying them into buckets, the optimizer step) is
small next to ``seconds`` and is the same on 1 and on K hosts.

**Model B, a real small CNN** (``small_cnn()``): four 3x3 convolutions with batch norm and
ReLU (3 -> 64 -> 128 -> 256 -> 256 channels, 2x2 max-pooling after each), then 4096 -> 512 ->
10 linear layers: ~3.2M parameters, trained on random CIFAR-sized data (``cifar_batch``),
really computed by PyTorch on one thread per rank.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "BACKWARD_SHARE",
    "EmulatedLayer",
    "EmulatedResNet50",
    "Layer",
    "SleepClock",
    "cifar_batch",
    "resnet50_layers",
    "small_cnn",
]

BACKWARD_SHARE = 2 / 3  # of one iteration's compute: backward does twice the forward's work
_GRADIENT = 1e-4  # every emulated gradient element (the value does not matter, its size does)
_BN_FLOPS_PER_ELEMENT = 8
_STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))  # width, blocks, first stride
_EXPANSION = 4


@dataclass(frozen=True)
class Layer:
    """One layer that owns parameters: torchvision's name, its parameter shapes, its FLOPs."""

    name: str
    kind: str  # "conv", "bn" or "fc"
    shapes: tuple[tuple[int, ...], ...]
    flops: int  # forward, per image

    @property
    def params(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)


def _conv(name: str, c_in: int, c_out: int, k: int, out: int) -> Layer:
    return Layer(name, "conv", ((c_out, c_in, k, k),), 2 * out * out * c_out * c_in * k * k)


def _bn(name: str, channels: int, size: int) -> Layer:
    flops = _BN_FLOPS_PER_ELEMENT * size * size * channels
    return Layer(name, "bn", ((channels,), (channels,)), flops)


def _bottleneck(prefix: str, c_in: int, width: int, size: int, stride: int) -> list[Layer]:
    """torchvision's Bottleneck (v1.5: stride on the 3x3), input ``size`` x ``size``."""
    out, c_out = size // stride, width * _EXPANSION
    layers = [
        _conv(f"{prefix}.conv1", c_in, width, 1, size),
        _bn(f"{prefix}.bn1", width, size),
        _conv(f"{prefix}.conv2", width, width, 3, out),
        _bn(f"{prefix}.bn2", width, out),
        _conv(f"{prefix}.conv3", width, c_out, 1, out),
        _bn(f"{prefix}.bn3", c_out, out),
    ]
    if stride != 1 or c_in != c_out:
        layers += [
            _conv(f"{prefix}.downsample.0", c_in, c_out, 1, out),
            _bn(f"{prefix}.downsample.1", c_out, out),
        ]
    return layers


@functools.cache
def resnet50_layers() -> tuple[Layer, ...]:
    """Every parameter-owning layer of torchvision's ``resnet50()``, in registration order."""
    layers = [_conv("conv1", 3, 64, 7, 112), _bn("bn1", 64, 112)]
    c_in, size = 64, 56  # after the stride-2 stem and the 3x3/2 max-pool
    for stage, (width, blocks, stride) in enumerate(_STAGES, start=1):
        for block in range(blocks):
            step = stride if block == 0 else 1
            layers += _bottleneck(f"layer{stage}.{block}", c_in, width, size, step)
            c_in, size = width * _EXPANSION, size // step
    fc_flops = 2 * c_in * 1000
    layers.append(Layer("fc", "fc", ((1000, c_in), (1000,)), fc_flops))
    return tuple(layers)  # cached: built once, shared by every caller


class SleepClock:
    """What every emulated layer asked to sleep, and how long its sleeps really took: the
    difference is time the training thread could not run when it should have (a busy CPU, or
    the GIL held by another thread), which a GPU's launch queue would mostly have absorbed."""

    asked = 0.0
    slept = 0.0

    @classmethod
    def sleep(cls, seconds: float) -> None:
        began = time.perf_counter()
        time.sleep(seconds)
        cls.slept += time.perf_counter() - began
        cls.asked += seconds

    @classmethod
    def late(cls) -> float:
        """Seconds the sleeps overran so far (all layers, both passes)."""
        return cls.slept - cls.asked


class _Emulate(torch.autograd.Function):
    """Sleep ``forward_s``; in backward sleep ``backward_s`` and return constant gradients."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float, *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.backward_s = backward_s
        ctx.params = [(p.shape, p.dtype) for p in params]
        SleepClock.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        SleepClock.sleep(ctx.backward_s)
        grads = [torch.full(shape, _GRADIENT, dtype=dtype) for shape, dtype in ctx.params]
        return (grad, None, None, *grads)


class EmulatedLayer(nn.Module):
    """Parameters of ``layer``'s shapes; forward and backward take ``forward_s``/``backward_s``
    of sleep. Owning its parameters directly, it is one bucket in ``DataParallel``'s forward
    mode, and its forward pre-hook is where that mode waits for its gradients."""

    def __init__(self, layer: Layer, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s
        self.weight = nn.Parameter(torch.randn(layer.shapes[0]) * 0.01)
        self.bias = nn.Parameter(torch.zeros(layer.shapes[1])) if len(layer.shapes) > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = [self.weight] if self.bias is None else [self.weight, self.bias]
        apply: Any = _Emulate.apply
        out: torch.Tensor = apply(x, self.forward_s, self.backward_s, *params)
        return out


class EmulatedResNet50(nn.Module):
    """ResNet-50's parameters, layer by layer, with ``seconds`` of emulated compute per
    iteration (forward and backward together), split by FLOPs (see the module docstring)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        specs = resnet50_layers()
        total = sum(layer.flops for layer in specs)
        layers = []
        for spec in specs:
            share = seconds * spec.flops / total
            layers.append(EmulatedLayer(spec, share * (1 - BACKWARD_SHARE), share * BACKWARD_SHARE))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x)
        return out

    @staticmethod
    def example_input(batch: int = 1) -> torch.Tensor:
        """What ``forward`` takes: a stand-in for the activations (its size does not matter)."""
        return torch.zeros(batch, 1)


def small_cnn() -> nn.Module:
    """Model B: four conv-BN-ReLU-pool blocks on 32 x 32 images, then two linear layers."""
    blocks: list[nn.Module] = []
    c_in = 3
    for c_out in (64, 128, 256, 256):
        blocks += [
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(),
            nn.MaxPool2d(2),
        ]
        c_in = c_out
    return nn.Sequential(
        *blocks, nn.Flatten(), nn.Linear(c_in * 2 * 2, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def cifar_batch(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (``batch`` x 3 x 32 x 32) and labels (10 classes), the same per ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, 32, 32, generator=gen)
    return images, torch.randint(0, 10, (batch,), generator=gen)


# ---- the ideal schedule: what the link and the mode allow, with no CPU cost at all --------------


class _Link:
    """One link as a single server: the ring allreduce of a bucket occupies it for ``seconds``;
    the waiting bucket with the smallest priority key goes first (preemptive)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.queue: dict[tuple[int, int], float] = {}  # priority key -> seconds left
        self.finished: dict[tuple[int, int], float] = {}

    def advance(self, until: float) -> None:
        """Serve the queue until ``until`` (the training thread computed meanwhile)."""
        while self.queue and self.now < until:
            key = min(self.queue)
            run = min(self.queue[key], until - self.now)
            self.now += run
            self.queue[key] -= run
            if self.queue[key] <= 1e-12:
                del self.queue[key]
                self.finished[key] = self.now
        self.now = max(self.now, until)

    def finish(self, key: tuple[int, int]) -> float:
        """When ``key`` is done if nothing more is posted meanwhile (the caller waits for it)."""
        while key in self.queue:
            self.advance(self.now + self.queue[min(self.queue)])
        return self.finished[key]


def _buckets(layers: list[Layer], mode: str, bucket_bytes: int) -> list[list[int]]:
    """Layer indices per bucket, in the order backward fills them (last layer first)."""
    if mode == "forward":
        return [[i] for i in reversed(range(len(layers)))]
    buckets: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(layers))):
        if buckets[-1] and size + 4 * layers[i].params > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += 4 * layers[i].params
    return buckets


def ideal_period(
    mode: str, seconds: float, link_s_per_byte: float, iterations: int = 5,
    bucket_bytes: int = 4 << 20,
) -> float:  # fmt: skip
    """Steady-state seconds per iteration of ``EmulatedResNet50(seconds)`` in ``mode`` (or
    ``ddp``: backward with 25 MB buckets) if nothing but the link cost time: a bucket's
    allreduce holds the link for ``link_s_per_byte`` per gradient byte, one bucket at a time;
    forward mode serves the layers nearest the input first, the others first come first."""
    layers = resnet50_layers()
    total = sum(layer.flops for layer in layers)
    fwd = [seconds * (1 - BACKWARD_SHARE) * layer.flops / total for layer in layers]
    bwd = [seconds * BACKWARD_SHARE * layer.flops / total for layer in layers]
    if mode == "ddp":
        mode, bucket_bytes = "backward", 25 << 20
    buckets = _buckets(layers, "forward" if mode == "blocking" else mode, bucket_bytes)
    cost = {  # link seconds of each bucket, by the layer whose gradient completes it
        members[-1]: link_s_per_byte * sum(4 * layers[j].params for j in members)
        for members in buckets
    }
    link, t = _Link(), 0.0
    starts: list[float] = []
    previous: list[tuple[int, int]] = []
    for it in range(iterations):
        starts.append(t)
        for i in range(len(layers)):
            if mode == "forward" and it > 0:
                t = max(t, link.finish((it - 1, i)))
            t += fwd[i]
        posted = []
        for i in reversed(range(len(layers))):
            t += bwd[i]
            if i in cost and mode != "blocking":  # forward: by layer; else first come first
                posted.append(_post(link, t, (it, i if mode == "forward" else -i), cost[i]))
        if mode == "blocking":
            posted = [_post(link, t, (it, 0), sum(cost.values()))]
        waited = previous if mode == "double_buffer" else [] if mode == "forward" else posted
        t = max([t, *(link.finish(key) for key in waited)])
        previous = posted
    return (starts[-1] - starts[1]) / (iterations - 2)


def _post(link: _Link, now: float, key: tuple[int, int], seconds: float) -> tuple[int, int]:
    link.advance(now)
    link.queue[key] = seconds
    return key
