"""The device calls of staging, in one small place: what a GPU needs, and nothing else.

Theory of operation. Every move of bytes between host and device, every event and every wait
that staging (staging.py) makes goes through a ``Device``. ``CudaDevice`` is the real one;
``standin.HostDevice`` is a CPU stand-in that runs the same pipeline on machines without a
GPU and counts each call, so the tests can hold the contracts (how many copies, which thread
synchronizes) on every machine. A device call never blocks the calling thread except
``synchronize``, which only staging threads make.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["CudaDevice", "Device"]


class Device(Protocol):
    """The device calls staging makes (see the module docstring)."""

    device: torch.device

    def enter(self) -> None:
        """First call in each staging thread: make this device the thread's current one."""

    def new_stream(self) -> Any:
        """A stream of this device (made in a staging thread, used only there)."""

    def record(self, stream: Any | None) -> Any:
        """An event recorded on ``stream`` (None: this thread's current stream)."""

    def wait(self, event: Any, stream: Any | None) -> None:
        """Make ``stream`` (None: this thread's current stream) wait for ``event``; the
        calling thread goes on at once."""

    def synchronize(self, event: Any) -> None:
        """Block this thread until ``event`` has happened (staging threads only)."""

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host tensor the device copies to and from quickly (pinned)."""

    def to_host(self, host: torch.Tensor, source: torch.Tensor, stream: Any) -> None:
        """Queue the copy of ``source`` (on the device) into ``host`` on ``stream``."""

    def to_device(self, target: torch.Tensor, host: torch.Tensor, stream: Any) -> None:
        """Queue the copy of ``host`` into ``target`` (on the device) on ``stream``."""


class CudaDevice:
    """``Device`` for CUDA: the device set in each staging thread, pinned host memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def enter(self) -> None:
        torch.cuda.set_device(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def record(self, stream: Any | None) -> Any:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: Any, stream: Any | None) -> None:
        (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(event)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def to_host(self, host: torch.Tensor, source: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            host.copy_(source.reshape(-1), non_blocking=True)
        source.record_stream(stream)  # its memory is not reused before this copy has read it

    def to_device(self, target: torch.Tensor, host: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            target.reshape(-1).copy_(host, non_blocking=True)
        target.record_stream(stream)
