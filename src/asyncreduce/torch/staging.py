"""Staging: allreduce of tensors that live on a GPU, through pinned host memory.

Theory of operation. The communicator reduces host memory only. A CPU tensor is handed to it
as it is (no copy). A tensor on a staged device (CUDA) travels through a host buffer that a
staging thread of that device moves it in and out of; the rules of the GPU are kept there:

1. The caller's thread records an event ``ready`` on its current stream: the kernels that
   produce the tensor (a gradient, a bucket being filled) may still be running.
2. The staging thread, which set the tensor's device as its own and made a stream of its own
   (a CUDA context and current device are per thread), makes that stream wait for ``ready``,
   copies device -> host (pinned, ``non_blocking``) on it and waits for the copy.
3. It posts ``comm.iallreduce`` on the host buffer; the progress thread reduces it there.
4. When that completes, the staging thread copies host -> device on its stream, records an
   event ``done`` and waits for it; only then does the request complete, so a request that is
   done holds its result on the device for every stream and every thread (callbacks,
   ``concurrent.futures.wait``). ``wait()`` also makes the caller's current stream wait for
   ``done``, so that consumer's kernels are ordered after the copy on the GPU as well.

One staging thread per device and communicator runs these steps in the order they were
posted; it starts with the first tensor and ends after a short idle spell (it holds no state
that outlives it but its stream). Staged operations are posted from that thread, so their
order among the caller's other operations is not fixed: they must be named (matching is by
name). Host buffers are allocated once per bucket by ``DataParallel`` (pinned memory, so the
copies are true DMA and ``non_blocking``) and reused every step.

Every device call sits in a ``Device`` adapter (``CudaDevice``). ``STAGED`` maps a device type
to its adapter; tests register a CPU stand-in under ``"cpu"`` to run the whole pipeline, with
real communication, on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from ..buffers import as_buffer
from ..comm import Communicator
from ..errors import ClosedError, UsageError
from ..request import Request

__all__ = ["CudaDevice", "Device", "STAGED", "StagedRequest", "Stager", "iallreduce", "stager_for"]

T = TypeVar("T")
IDLE_S = 0.5  # a staging thread with nothing to do for this long ends (the next post restarts it)


class Device(Protocol):
    """The device calls staging makes: what a GPU needs, in one small place."""

    device: torch.device

    def enter(self) -> None:
        """First call in each staging thread: make this device the thread's current one."""

    def new_stream(self) -> Any:
        """A stream of this device (made in the staging thread, used only there)."""

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` the current stream of this thread for the ``with`` block."""

    def record(self, stream: Any | None) -> Any:
        """An event recorded on ``stream`` (None: this thread's current stream)."""

    def wait(self, event: Any, stream: Any | None) -> None:
        """Make ``stream`` (None: this thread's current stream) wait for ``event``."""

    def synchronize(self, event: Any) -> None:
        """Block this thread until ``event`` has happened."""

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A host tensor shaped like ``like`` that the device copies to and from quickly."""


class CudaDevice:
    """``Device`` for CUDA: the tensor's device set in the staging thread, pinned host memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def enter(self) -> None:
        torch.cuda.set_device(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record(self, stream: Any | None) -> Any:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: Any, stream: Any | None) -> None:
        (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(event)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)


STAGED: dict[str, Callable[[torch.device], Device]] = {"cuda": CudaDevice}


class StagedRequest(Request[T]):
    """A request whose result lands on a device (see the module docstring, step 4)."""

    def __init__(self, label: str, runner: Any, device: Device) -> None:
        super().__init__(label, runner)
        self.event: Any = None  # recorded on the staging stream after the copy back
        self._device = device

    def wait(self, timeout: float | None = None) -> T:
        """The result; the calling thread's current stream is ordered after the copy back."""
        result = super().wait(timeout)
        self._device.wait(self.event, None)
        return result


class Stager:
    """Moves tensors of one device through host buffers for one communicator."""

    def __init__(self, comm: Communicator, device: Device) -> None:
        self._comm = weakref.ref(comm)  # the registry of stagers must not keep comm alive
        self._device = device
        self._stream: Any = None
        self._broken: Exception | None = None  # why the staging thread could not set up
        self._worker = _Worker(f"asyncreduce-staging-{device.device}", self._enter)

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer for ``like``; allocate once and pass it to every ``iallreduce``."""
        return self._device.host_buffer(like)

    def iallreduce(
        self, tensor: torch.Tensor, host: torch.Tensor, op: str = "sum", *, name: str | None = None,
        priority: int = 0, timeout: float | None = None,
    ) -> StagedRequest[torch.Tensor]:  # fmt: skip
        """Reduce ``tensor`` in place over all ranks, through ``host`` (its size and dtype)."""
        comm = self._live()
        if tensor.device != self._device.device:
            raise UsageError(f"a tensor on {tensor.device} given to the stager of {self.device}")
        if not tensor.is_contiguous():
            raise UsageError("x is not contiguous; pass x.contiguous() instead")
        if name is None:
            raise UsageError(
                f"a tensor on {tensor.device} is posted from a staging thread, so its order "
                "among this thread's operations is not fixed: give it a name= (matching is by name)"
            )
        if host.shape != tensor.shape or host.dtype != tensor.dtype or host.device.type != "cpu":
            raise UsageError(f"host buffer {host.shape} {host.dtype} does not fit x")
        # the communicator's own check and callback thread (staging is its device-side half):
        # a bad call fails here, before any post; callbacks run where its requests' do
        comm._check_reduction(op, as_buffer(host, "x"))
        ready = self._device.record(None)  # the producer's kernels, on the caller's stream
        request: StagedRequest[torch.Tensor] = StagedRequest(
            f"staged allreduce {name!r}", comm._runner, self._device
        )
        self._worker.submit(
            lambda: self._copy_out(tensor, host, ready, request, op, name, priority, timeout)
        )
        return request

    @property
    def device(self) -> torch.device:
        return self._device.device

    # ---- the staging thread ----------------------------------------------------------------

    def _enter(self) -> None:
        """First thing in each staging thread; a failure is reported by every job after it."""
        try:
            self._device.enter()
            if self._stream is None:
                self._stream = self._device.new_stream()
            self._broken = None
        except Exception as exc:
            self._broken = exc

    def _check_thread(self) -> None:
        if self._broken is not None:
            raise self._broken  # e.g. the device could not be set: every job fails with it

    def _copy_out(
        self, tensor: torch.Tensor, host: torch.Tensor, ready: Any,
        request: StagedRequest[torch.Tensor], op: str, name: str, priority: int,
        timeout: float | None,
    ) -> None:  # fmt: skip
        """Steps 2 and 3: wait for the producer, copy to the host, post the allreduce."""
        try:
            self._check_thread()
            self._device.wait(ready, self._stream)
            with self._device.use(self._stream):
                host.copy_(tensor, non_blocking=True)
            self._device.synchronize(self._device.record(self._stream))
            inner = self._live().iallreduce(host, op, name=name, priority=priority, timeout=timeout)
        except Exception as exc:
            request.set_exception(exc)
            return
        inner.add_done_callback(
            lambda done: self._worker.submit(lambda: self._copy_back(done, tensor, host, request))
        )

    def _copy_back(
        self, inner: Any, tensor: torch.Tensor, host: torch.Tensor,
        request: StagedRequest[torch.Tensor],
    ) -> None:  # fmt: skip
        """Step 4: copy the reduced host buffer back, wait for it, complete the request."""
        try:
            self._check_thread()
            inner.result()
            with self._device.use(self._stream):
                tensor.copy_(host, non_blocking=True)
            event = self._device.record(self._stream)
            self._device.synchronize(event)
        except Exception as exc:
            request.set_exception(exc)
            return
        request.event = event
        request.set_result(tensor)

    def _live(self) -> Communicator:
        comm = self._comm()
        if comm is None:
            raise ClosedError("allreduce: the communicator is gone")
        return comm


class _Worker:
    """One thread running jobs in order; it starts on demand and ends after ``IDLE_S`` idle."""

    def __init__(self, name: str, enter: Callable[[], None]) -> None:
        self._name = name
        self._enter = enter
        self._jobs: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._running = False

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._jobs.append(job)
            if self._running:
                self._cond.notify()
                return
            self._running = True
        threading.Thread(target=self._run, name=self._name, daemon=True).start()

    def _run(self) -> None:
        self._enter()  # never raises (Stager._enter keeps the error for the jobs to report)
        while True:
            with self._cond:
                if not self._jobs:
                    self._cond.wait(IDLE_S)
                if not self._jobs:
                    self._running = False
                    return
                job = self._jobs.popleft()
            job()


_STAGERS: weakref.WeakKeyDictionary[Communicator, dict[torch.device, Stager]] = (
    weakref.WeakKeyDictionary()
)
_STAGERS_LOCK = threading.Lock()


def stager_for(comm: Communicator, device: torch.device) -> Stager | None:
    """The stager of ``device`` on ``comm``; None for the CPU (its tensors need no copy), and
    for any device where the communicator's engine takes the tensors as they are
    (``backend="torch"``: CUDA tensors go to NCCL directly).

    Raises ``UsageError`` for a device that is neither."""
    engine = comm._ordered
    if device.type == "cuda" and getattr(engine and engine.adapter, "devices", False):
        return None
    make = STAGED.get(device.type)
    if make is None:
        if device.type == "cpu":
            return None
        raise UsageError(
            f"a tensor on {device} cannot be communicated; supported: cpu tensors (no copy) and "
            f"{', '.join(sorted(STAGED))} tensors (staged through pinned host memory)"
        )
    with _STAGERS_LOCK:
        per_comm = _STAGERS.setdefault(comm, {})
        if device not in per_comm:
            per_comm[device] = Stager(comm, make(device))
        return per_comm[device]


def iallreduce(
    comm: Communicator, tensor: torch.Tensor, op: str = "sum", *, name: str | None = None,
    priority: int = 0, timeout: float | None = None,
) -> Request[torch.Tensor]:  # fmt: skip
    """``comm.iallreduce`` in place for a CPU tensor (no copy) or a CUDA one (staged; named).

    The request's result is ``tensor``. For a CUDA tensor, call this from the thread and stream
    that produce it (it waits for their kernels), give it a ``name``, and leave the tensor alone
    until the request completes. Pinned host memory is taken per call from PyTorch's caching
    host allocator; ``DataParallel`` keeps one buffer per bucket instead.
    """
    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"x must be a torch tensor; got {type(tensor).__name__}")
    stager = stager_for(comm, tensor.device)
    if stager is None:
        return comm.iallreduce(tensor, op, name=name, priority=priority, timeout=timeout)
    return stager.iallreduce(
        tensor, stager.host_buffer(tensor), op, name=name, priority=priority, timeout=timeout
    )
