"""Staging: collectives of tensors that live on a GPU, through pinned host memory, pipelined.

Theory of operation. The communicator reduces host memory only. A CPU tensor is handed to it
as it is (no copy). A tensor on a staged device (CUDA) travels through a host twin that two
staging threads of that device move it in and out of, each with a stream of its own (a CUDA
context and current device are per thread), so the copy of one chunk to the host, the host
collective of the chunk before it and the copy back of the one before that all overlap:

1. The caller's thread records an event ``ready`` on its current stream (the kernels that
   produce the tensor may still be running) and returns a request at once: it never blocks
   and never synchronizes with the device.
2. The *out* thread makes its stream wait for ``ready`` and queues the copy device -> host of
   every chunk (``CHUNK_BYTES``; a small tensor is one chunk). It keeps one copy queued ahead
   of the one it waits for, so the copy engine never idles while it posts: once a chunk's copy
   has landed it posts the chunk's host collective (named ``name``, or ``name#k`` for chunk k).
3. When a chunk's collective completes, the *back* thread queues its copy host -> device on
   its stream, again one ahead of the one it waits for (where nothing was copied out, as on a
   broadcast's leaves, that stream first waits for ``ready``: the tensor's last writers). Once
   every chunk is back the request
   completes, holding the event of the last copy back: a request that is done holds its result
   on the device for every stream and every thread. ``wait()`` also makes the caller's current
   stream wait for that event, so the consumer's kernels are ordered after the copy on the GPU.

Each thread runs its jobs in the order they came, starts with the first and ends after a short
idle spell. Staged operations are posted from the out thread, so their order among the
caller's other operations is not fixed: they must be named (matching is by name). A host twin
may be longer than its tensor: the elements past the tensor travel as the caller wrote them
(DataParallel's used-flags, written on the host, so no scalar crosses to the device). Host
twins are allocated once: by ``DataParallel`` per bucket, and here per size for
``iallreduce`` (a pool, reused).

Every device call sits in a ``Device`` (device.py). ``STAGED`` maps a device type to its
adapter; tests and ``bench gpu`` register a CPU stand-in under ``"cpu"`` (standin.py).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from ..buffers import as_buffer
from ..comm import Communicator
from ..errors import ClosedError, UsageError
from ..request import Request
from .device import CudaDevice, Device

__all__ = ["CHUNK_BYTES", "STAGED", "StagedRequest", "Stager", "iallreduce", "stager_for"]

T = TypeVar("T")
IDLE_S = 0.5  # a staging thread with nothing to do for this long ends (the next post restarts it)
CHUNK_BYTES = 4 << 20  # a larger tensor is staged in chunks of this size, one collective each
AHEAD = 2  # copies a staging thread keeps queued on its stream: the one it waits for, and one

STAGED: dict[str, Callable[[torch.device], Device]] = {"cuda": CudaDevice}
Post = Callable[[torch.Tensor, str], Request[Any]]  # (host chunk, name) -> its host collective


class StagedRequest(Request[T]):
    """A request whose result lands on a device (see the module docstring, step 3)."""

    def __init__(self, label: str, runner: Any, device: Device) -> None:
        super().__init__(label, runner)
        self.event: Any = None  # recorded on the back stream after the last copy back
        self._device = device

    def wait(self, timeout: float | None = None) -> T:
        """The result; the calling thread's current stream is ordered after the copy back."""
        result = super().wait(timeout)
        self.order_current_stream()
        return result

    def order_current_stream(self) -> None:
        """Once done: this thread's current stream waits (on the device) for the copy back."""
        if self.event is not None:
            self._device.wait(self.event, None)


class _Staged:
    """One staged operation: its tensor, host twin, chunks, and how many are still out."""

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor, name: str, post: Post,
                 request: StagedRequest[Any], moves: tuple[bool, bool],
                 release: Callable[[], None] | None) -> None:  # fmt: skip
        self.tensor, self.flat, self.host = tensor, tensor.reshape(-1), host
        self.release = release  # called once the host twin is free, before the request ends
        self.ready: Any = None  # the event of the caller's stream at the post
        self.post, self.request = post, request
        # (copy out, copy back): a broadcast's root sends and keeps, its leaves only receive
        self.copy_out, self.copy_back = moves
        step = max(1, CHUNK_BYTES // host.element_size())
        bounds = list(range(0, host.numel(), step)) or [0]
        self.chunks = [(a, min(a + step, host.numel())) for a in bounds]
        self.names = [name] if len(self.chunks) == 1 else [f"{name}#{k}" for k in
                                                           range(len(self.chunks))]  # fmt: skip
        self.left = len(self.chunks)
        self._lock = threading.Lock()

    def device_part(self, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(device piece, host piece) of chunk k where it overlaps the tensor, else None."""
        a, b = self.chunks[k]
        b = min(b, self.flat.numel())
        return None if a >= b else (self.flat[a:b], self.host[a:b])

    def chunk_back(self, event: Any) -> None:
        """Chunk's copy back landed: the last one completes the request with its event."""
        with self._lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self._released()
            self.request.event = event
            self.request.set_result(self.tensor)

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            first, self.left = self.left > 0, 0
        if first:
            self._released()
            self.request.set_exception(exc)

    def _released(self) -> None:
        if self.release is not None:
            self.release()


class Stager:
    """Moves tensors of one device through host twins for one communicator."""

    def __init__(self, comm: Communicator, device: Device) -> None:
        self._comm = weakref.ref(comm)  # the registry of stagers must not keep comm alive
        self._device = device
        name = f"asyncreduce-staging-{device.device}"
        self._out = _Pipe(f"{name}-out", device)
        self._back = _Pipe(f"{name}-back", device)
        self._pool: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._pool_lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return self._device.device

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat pinned host twin; allocate once and pass it to every call."""
        return self._device.host_buffer(numel, dtype)

    def iallreduce(
        self, tensor: torch.Tensor, host: torch.Tensor, op: str = "sum", *, name: str | None = None,
        priority: int = 0, timeout: float | None = None, release: Callable[[], None] | None = None,
    ) -> StagedRequest[torch.Tensor]:  # fmt: skip
        """Reduce ``tensor`` in place over all ranks, through ``host`` (flat, its dtype, at
        least its size: elements past the tensor travel as the caller wrote them).
        ``release`` is called once ``host`` is free again, just before the request ends."""
        comm = self._checked(tensor, host, name)
        comm._check_reduction(op, as_buffer(host, "x"))  # a bad call fails here, before a post

        def post(chunk: torch.Tensor, label: str) -> Request[Any]:
            return self._live().iallreduce(chunk, op, name=label, priority=priority,
                                           timeout=timeout)  # fmt: skip

        return self._start(tensor, host, name, post, (True, True), release)

    def ibroadcast(
        self, tensor: torch.Tensor, host: torch.Tensor, root: int = 0, *, name: str | None = None,
        timeout: float | None = None, release: Callable[[], None] | None = None,
    ) -> StagedRequest[torch.Tensor]:  # fmt: skip
        """Copy ``root``'s ``tensor`` into ``tensor`` on every rank, through ``host``
        (``release`` as in ``iallreduce``)."""
        comm = self._checked(tensor, host, name)

        def post(chunk: torch.Tensor, label: str) -> Request[Any]:  # bytes: any dtype
            return self._live().ibroadcast(chunk.view(torch.uint8), root, name=label,
                                           timeout=timeout)  # fmt: skip

        moves = (comm.rank == root, comm.rank != root)
        return self._start(tensor, host, name, post, moves, release)

    def pooled_allreduce(
        self, tensor: torch.Tensor, op: str, *, name: str | None, priority: int = 0,
        timeout: float | None = None,
    ) -> StagedRequest[torch.Tensor]:  # fmt: skip
        """``iallreduce`` through a pooled host twin (see ``_pooled``)."""
        return self._pooled(
            tensor,
            lambda host, release: self.iallreduce(
                tensor, host, op, name=name, priority=priority, timeout=timeout, release=release
            ),
        )

    def pooled_broadcast(
        self, tensor: torch.Tensor, root: int, *, name: str | None, timeout: float | None = None
    ) -> StagedRequest[torch.Tensor]:
        """``ibroadcast`` through a pooled host twin (see ``_pooled``)."""
        return self._pooled(tensor, lambda host, release: self.ibroadcast(
            tensor, host, root, name=name, timeout=timeout, release=release))  # fmt: skip

    def _pooled(self, tensor: torch.Tensor,
                start: Callable[[torch.Tensor, Callable[[], None]], StagedRequest[torch.Tensor]]
                ) -> StagedRequest[torch.Tensor]:  # fmt: skip
        """``start(host, release)`` with a host twin taken from this stager's pool: made once
        per size and dtype, back in the pool before the request ends."""
        key = (tensor.numel(), tensor.dtype)
        with self._pool_lock:
            free = self._pool.setdefault(key, [])
            host = free.pop() if free else None
        if host is None:
            host = self.host_buffer(*key)

        def give_back() -> None:
            with self._pool_lock:
                self._pool[key].append(host)

        try:
            return start(host, give_back)
        except BaseException:
            give_back()
            raise

    # ---- the caller's side -------------------------------------------------------------------

    def _checked(self, tensor: torch.Tensor, host: torch.Tensor, name: str | None
                 ) -> Communicator:  # fmt: skip
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
        if (host.dim() != 1 or host.numel() < tensor.numel() or host.dtype != tensor.dtype
                or host.device.type != "cpu"):  # fmt: skip
            raise UsageError(f"host twin {tuple(host.shape)} {host.dtype} does not fit x "
                             f"{tuple(tensor.shape)} {tensor.dtype}: flat, on the host, at "
                             "least as long")  # fmt: skip
        return comm

    def _start(self, tensor: torch.Tensor, host: torch.Tensor, name: str | None, post: Post,
               moves: tuple[bool, bool], release: Callable[[], None] | None
               ) -> StagedRequest[torch.Tensor]:  # fmt: skip
        """Step 1: the producer's event, the request, and the job of the out thread."""
        assert name is not None
        request: StagedRequest[torch.Tensor] = StagedRequest(
            f"staged {name!r}", self._live()._runner, self._device
        )
        staged = _Staged(tensor, host, name, post, request, moves, release)
        staged.ready = self._device.record(None)  # (a broadcast's leaves: its last writers)
        self._out.submit(_CopyOut(self, staged))
        return request

    def _posted(self, staged: _Staged, k: int) -> None:
        """The out thread: chunk k is on the host; post its collective, the back job after."""
        a, b = staged.chunks[k]
        inner = staged.post(staged.host[a:b], staged.names[k])
        inner.add_done_callback(lambda done: self._collected(staged, k, done))

    def _collected(self, staged: _Staged, k: int, inner: Future[Any]) -> None:
        error = inner.exception()
        if error is not None:
            staged.fail(error)
        else:
            self._back.submit(_CopyBack(staged, k))

    def _live(self) -> Communicator:
        comm = self._comm()
        if comm is None:
            raise ClosedError("a staged operation: the communicator is gone")
        return comm


class _CopyOut:
    """The out thread's job for one operation: every chunk to the host, each then posted."""

    def __init__(self, stager: Stager, staged: _Staged) -> None:
        self.stager, self.staged = stager, staged
        self.steps = len(staged.chunks)

    def start(self, k: int, device: Device, stream: Any) -> Any:
        if not self.staged.copy_out:
            return None
        if k == 0:
            device.wait(self.staged.ready, stream)  # the producer's kernels first (on the device)
        part = self.staged.device_part(k)
        if part is None:
            return None
        piece, host = part
        device.to_host(host, piece, stream)
        return device.record(stream)

    def finish(self, k: int) -> None:
        self.stager._posted(self.staged, k)

    def fail(self, exc: BaseException) -> None:
        self.staged.fail(exc)


class _CopyBack:
    """The back thread's job for one chunk: to the device, then counted as back."""

    steps = 1

    def __init__(self, staged: _Staged, k: int) -> None:
        self.staged, self.k = staged, k
        self.event: Any = None

    def start(self, _: int, device: Device, stream: Any) -> Any:
        if not self.staged.copy_out:  # nothing ordered this copy after the tensor's last
            device.wait(self.staged.ready, stream)  # writers yet: wait for them (on the device)
        part = self.staged.device_part(self.k) if self.staged.copy_back else None
        if part is not None:
            piece, host = part
            device.to_device(piece, host, stream)
        self.event = device.record(stream)
        return self.event

    def finish(self, _: int) -> None:
        self.staged.chunk_back(self.event)

    def fail(self, exc: BaseException) -> None:
        self.staged.fail(exc)


class _Pipe:
    """One staging thread and its stream: jobs in order, each a few steps of (queue device
    work, then act once it landed), with ``AHEAD`` steps queued on the stream at a time. It
    starts on demand and ends after ``IDLE_S`` idle; it blocks on the device only when it has
    nothing else to queue."""

    def __init__(self, name: str, device: Device) -> None:
        self._name = name
        self._device = device
        self._stream: Any = None
        self._jobs: deque[Any] = deque()
        self._cond = threading.Condition()
        self._running = False

    def submit(self, job: Any) -> None:
        with self._cond:
            self._jobs.append(job)
            if self._running:
                self._cond.notify()
                return
            self._running = True
        threading.Thread(target=self._run, name=self._name, daemon=True).start()

    def _run(self) -> None:
        broken = self._enter()
        queued: deque[tuple[Any, Any, int]] = deque()  # (event, job, step) on the stream
        steps: deque[tuple[Any, int]] = deque()  # (job, step) not yet queued
        while True:
            if len(queued) < AHEAD and not steps:
                with self._cond:
                    if not self._jobs and not queued:
                        self._cond.wait(IDLE_S)
                    if not self._jobs and not queued:
                        self._running = False
                        return
                    if self._jobs:
                        job = self._jobs.popleft()
                        steps.extend((job, k) for k in range(job.steps))
            if steps and len(queued) < AHEAD:
                job, k = steps.popleft()
                self._queue(job, k, queued, broken)
            elif queued:
                self._land(queued.popleft())

    def _enter(self) -> BaseException | None:
        """Make the device this thread's and the stream; an error fails every job after."""
        try:
            self._device.enter()
            if self._stream is None:
                self._stream = self._device.new_stream()
        except Exception as exc:  # noqa: BLE001 - reported by every job of this thread
            return exc
        return None

    def _queue(self, job: Any, k: int, queued: deque[tuple[Any, Any, int]],
               broken: BaseException | None) -> None:  # fmt: skip
        try:
            if broken is not None:
                raise broken
            queued.append((job.start(k, self._device, self._stream), job, k))
        except Exception as exc:  # noqa: BLE001 - the request carries it
            job.fail(exc)

    def _land(self, entry: tuple[Any, Any, int]) -> None:
        event, job, k = entry
        try:
            if event is not None:
                self._device.synchronize(event)
            job.finish(k)
        except Exception as exc:  # noqa: BLE001 - the request carries it
            job.fail(exc)


_STAGERS: weakref.WeakKeyDictionary[Communicator, dict[tuple[torch.device, Any], Stager]] = (
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
        if (device, make) not in per_comm:  # (a new adapter, a new stager)
            per_comm[(device, make)] = Stager(comm, make(device))
        return per_comm[(device, make)]


def iallreduce(
    comm: Communicator, tensor: torch.Tensor, op: str = "sum", *, name: str | None = None,
    priority: int = 0, timeout: float | None = None,
) -> Request[torch.Tensor]:  # fmt: skip
    """``comm.iallreduce`` in place for a CPU tensor (no copy) or a CUDA one (staged; named).

    The request's result is ``tensor``. For a CUDA tensor, call this from the thread and stream
    that produce it (its kernels are waited for on the device, never on this thread), give it a
    ``name``, and leave the tensor alone until the request completes. Large tensors are staged
    in chunks that overlap their copies with their reduction; pinned host twins are kept per
    size and reused.
    """
    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"x must be a torch tensor; got {type(tensor).__name__}")
    stager = stager_for(comm, tensor.device)
    if stager is None:
        return comm.iallreduce(tensor, op, name=name, priority=priority, timeout=timeout)
    return stager.pooled_allreduce(tensor, op, name=name, priority=priority, timeout=timeout)
