"""The models of ``bench gpu`` (not a benchmark itself): ResNet-50, and a tiny MLP for the stand-in.

``resnet50()`` is torchvision's ``resnet50()`` where torchvision is importable, else
``ResNet50Like``: the same network built here (a 7x7/2 stem, a 3x3/2 max-pool, Bottleneck
blocks ``[3, 4, 6, 3]`` of widths 64, 128, 256, 512 with expansion 4 and the stride on the 3x3
convolution (v1.5), a 1x1 downsample convolution with batch norm on the first block of each
stage, global average pooling and a 2048 -> 1000 classifier): the same 161 parameter tensors
in the same order, 25,557,032 parameters (``scaling_models.resnet50_layers`` derives the same
count from the architecture), and the same work per image. The GPU machines that run
``scripts/gpu_check.sh`` cannot install torchvision, so the benchmark must not need it.

``tiny_mlp()`` is what the CPU stand-in trains: three linear layers, so a run takes seconds
and the counts per step (one bucket in most modes, one per layer in forward mode) are clear.
``batch(...)`` makes one rank's fixed batch for either model.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

__all__ = ["MODELS", "Bottleneck", "ResNet50Like", "batch", "build", "resnet50", "tiny_mlp"]

MODELS = ("resnet50", "mlp")
_STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))  # width, blocks, first stride
_EXPANSION = 4
_MLP_IN, _MLP_HIDDEN, _MLP_OUT = 64, 128, 10


class Bottleneck(nn.Module):
    """torchvision's Bottleneck: 1x1, 3x3 (stride here), 1x1, each with batch norm; a 1x1
    downsample with batch norm where the shape changes."""

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * _EXPANSION
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        result: torch.Tensor = self.relu(out + identity)
        return result


class ResNet50Like(nn.Module):
    """ResNet-50 as torchvision defines it, without torchvision (see the module docstring)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        c_in, stages = 64, []
        for width, blocks, stride in _STAGES:
            layers = []
            for i in range(blocks):
                layers.append(Bottleneck(c_in, width, stride if i == 0 else 1))
                c_in = width * _EXPANSION
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        out: torch.Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return out


def resnet50() -> tuple[nn.Module, str]:
    """(ResNet-50, where it came from): torchvision's where importable, else ours."""
    if importlib.util.find_spec("torchvision") is not None:
        import torchvision  # type: ignore[import-not-found,unused-ignore]

        model: nn.Module = torchvision.models.resnet50()
        return model, "torchvision resnet50"
    return ResNet50Like(), "ResNet50Like (torchvision's resnet50, built here)"


def tiny_mlp() -> nn.Module:
    """The stand-in's model: 64 -> 128 -> 128 -> 10, ReLU between."""
    return nn.Sequential(
        nn.Linear(_MLP_IN, _MLP_HIDDEN), nn.ReLU(),
        nn.Linear(_MLP_HIDDEN, _MLP_HIDDEN), nn.ReLU(),
        nn.Linear(_MLP_HIDDEN, _MLP_OUT),
    )  # fmt: skip


def build(name: str, seed: int) -> tuple[nn.Module, str]:
    """Model ``name`` with the parameters of ``seed`` (the same on every rank and row)."""
    torch.manual_seed(seed)
    if name == "resnet50":
        return resnet50()
    return tiny_mlp(), "tiny MLP 64-128-128-10"


def batch(name: str, size: int, seed: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's fixed (inputs, labels) for model ``name``, made on the CPU from ``seed`` (the
    same values whatever the device), then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    if name == "resnet50":
        x = torch.randn(size, 3, 224, 224, generator=gen)
        y = torch.randint(0, 1000, (size,), generator=gen)
    else:
        x = torch.randn(size, _MLP_IN, generator=gen)
        y = torch.randint(0, _MLP_OUT, (size,), generator=gen)
    return x.to(device), y.to(device)
