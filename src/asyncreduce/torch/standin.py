"""A CPU stand-in for a GPU: staging's whole pipeline, with real communication, and no device.

Theory of operation. ``HostDevice`` is a ``Device`` (device.py) whose "device" is the CPU:
registered as the adapter of "cpu" tensors (``standing_in()``), it makes every CPU tensor a
staged one, so ``DataParallel``, ``iallreduce`` and the torch backend take their GPU path on
any machine. Its copies are done when they return, so a stream is the staging thread itself,
and waiting on a stream from a staging thread waits in that thread. Its events are
``threading.Event``\\ s, already set, except the producer's while ``gate`` is set: then the
producer's "kernel" is in flight until the test opens the gate. Every call is logged with the
thread that made it, so tests and ``bench gpu`` can count copies and synchronizations.

``DeviceReads`` is the other half of the contract: on the thread that enters it, it counts
every call that on a GPU would move data between host and device outside the ``Device``
(``.item()``, ``.tolist()``, ``.cpu()``, a scalar written into a tensor, a copy between a host
twin and anything else): each one is a transfer the ``Device`` does not see, and on CUDA a
synchronization of the training thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import staging

__all__ = ["DeviceReads", "HostDevice", "standing_in"]

_READS = frozenset({"tolist", "item", "cpu", "numpy", "__float__", "__int__", "__bool__",
                    "__index__", "__array__"})  # fmt: skip


class HostDevice:
    """A ``Device`` whose "device" is the CPU (see the module docstring)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self.gate: threading.Event | None = None
        self.log: list[tuple[str, str]] = []  # (call, thread name)
        self._hosts: set[int] = set()  # data_ptr of every host buffer made
        self._made: list[torch.Tensor] = []  # and the buffers, kept for this device's life:
        # ``is_host`` goes by address, which a freed buffer would hand to a later tensor
        self._lock = threading.Lock()

    def _note(self, what: str) -> None:
        with self._lock:
            self.log.append((what, threading.current_thread().name))

    def counts(self) -> Counter[tuple[str, str]]:
        """{(call, thread name): how often} so far."""
        with self._lock:
            return Counter(self.log)

    def is_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in a host buffer this device made."""
        return tensor.untyped_storage().data_ptr() in self._hosts

    def enter(self) -> None:
        self._note("enter")

    def new_stream(self) -> Any:
        self._note("new_stream")
        return "stream"

    def record(self, stream: Any | None) -> Any:
        self._note(f"record {stream or 'current'}")
        if stream is None and self.gate is not None:
            return self.gate
        event = threading.Event()
        event.set()
        return event

    def wait(self, event: Any, stream: Any | None) -> None:
        self._note(f"wait {stream or 'current'}")
        if stream is not None:
            assert event.wait(30), "the producer's event never happened"

    def synchronize(self, event: Any) -> None:
        self._note("synchronize")
        assert event.wait(30)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self._note("host_buffer")
        host = torch.empty(numel, dtype=dtype)
        host.fill_(float("nan") if dtype.is_floating_point else -1)  # nothing copied yet
        with self._lock:
            self._hosts.add(host.untyped_storage().data_ptr())
            self._made.append(host)
        return host

    def to_host(self, host: torch.Tensor, source: torch.Tensor, stream: Any) -> None:
        self._note("to_host")
        host.copy_(source.reshape(-1))

    def to_device(self, target: torch.Tensor, host: torch.Tensor, stream: Any) -> None:
        self._note("to_device")
        target.reshape(-1).copy_(host)


class DeviceReads(TorchFunctionMode):
    """Counts host-device transfers made outside the ``Device`` on the thread that enters it
    (see the module docstring); ``found`` lists them as (call, tensor shape)."""

    def __init__(self, device: HostDevice) -> None:
        super().__init__()
        self._device = device
        self.found: list[tuple[str, tuple[int, ...]]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:  # fmt: skip
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor) and self._transfers(name, args, kwargs):
            self.found.append((name, tuple(args[0].shape)))
        return func(*args, **kwargs)

    def _transfers(self, name: str, args: Any, kwargs: Any) -> bool:
        first = args[0]
        if name in _READS:
            return not self._device.is_host(first)
        if name == "__setitem__":  # a Python scalar written into a "device" tensor
            return isinstance(args[2], int | float | bool) and not self._device.is_host(first)
        if name == "copy_":
            return self._device.is_host(first) != self._device.is_host(args[1])
        if name == "to":
            moves = [a for a in (*args[1:], kwargs.get("device")) if _names_device(a)]
            return bool(moves) and not self._device.is_host(first)
        return False


def _names_device(value: Any) -> bool:
    return (
        isinstance(value, torch.device)
        or value in ("cpu", "cuda")
        or (isinstance(value, str) and value.startswith("cuda:"))
    )


@contextlib.contextmanager
def standing_in() -> Iterator[HostDevice]:
    """Make every CPU tensor a staged one, through a fresh ``HostDevice``, for the block."""
    device = HostDevice()
    staging.STAGED["cpu"] = lambda _: device
    try:
        yield device
    finally:
        del staging.STAGED["cpu"]
