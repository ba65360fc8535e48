"""torch's handle of one operation of the "asyncreduce" backend: ``wait`` and ``get_future``
behave as Gloo's do.

A Work holds the communicator's requests of one torch call and the output tensors. ``wait``
waits for them (and copies back where the call ran on a copy); the torch future is completed
with the outputs, or given the error, on a pool of threads of its own (``_settlers``), so a
``then`` callback that waits on another Work's future (PowerSGD's do) holds one thread, not all.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..request import Request, wait_all
from .staging import StagedRequest

__all__ = ["Work", "joined"]

_LOCK = threading.Lock()
_SETTLERS: list[concurrent.futures.ThreadPoolExecutor] = []


def _settlers() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that complete torch futures (see ``_Work._settle``): a pool, so that a
    ``then`` callback waiting on another Work's future holds one thread, not all of them."""
    with _LOCK:
        if not _SETTLERS:
            _SETTLERS.append(concurrent.futures.ThreadPoolExecutor(
                16, thread_name_prefix="asyncreduce-torch-future"))  # fmt: skip
        return _SETTLERS[0]


class Work(dist.Work):  # type: ignore[misc, name-defined]
    """torch's handle of one operation: ``wait`` and ``get_future`` as Gloo's behave."""

    def __init__(self, requests: Sequence[Request[Any]], outputs: list[Any],
                 finish: Callable[[], None] | None = None) -> None:  # fmt: skip
        super().__init__()
        self._requests = list(requests)
        self._outputs = outputs
        self._finish = finish  # copies results into place, once, after the requests are done
        self._lock = threading.RLock()  # a closed communicator runs callbacks inline
        self._settled = False  # the torch future got its result or error
        self._future: torch.futures.Future[Any] | None = None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if timeout else None
        if len(self._requests) == 1:
            self._requests[0].wait(seconds)
        else:
            wait_all(self._requests, seconds)
        if self._finish is not None:
            self._done()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future(devices=_cuda_devices(self._outputs))
                pending = [len(self._requests)]
                for request in self._requests:
                    request.add_done_callback(lambda r: self._settle(r, pending))
                if not self._requests:
                    self._future.set_result(self._outputs)
        return self._future

    def _settle(self, request: Any, pending: list[int]) -> None:
        """On the communicator's callback thread: hand the torch future to a thread of its own,
        since torch runs the future's ``then`` callbacks inline and one may wait on another
        Work's future, which this very thread would have to settle (PowerSGD's hooks do)."""
        with self._lock:
            pending[0] -= 1
            last = pending[0] == 0
        error = request.exception()
        if error is not None or last:
            _settlers().submit(self._settle_future, error)

    def _settle_future(self, error: BaseException | None) -> None:
        future = self._future
        assert future is not None
        with self._lock:  # (an error and the last request may both come: settle once)
            settled, self._settled = self._settled, True
        if settled:
            return
        if error is not None:
            future.set_exception(error)
        else:
            try:
                for request in self._requests:  # staged: the future's events follow the copy
                    if isinstance(request, StagedRequest):  # back (on the device)
                        request.order_current_stream()
                self._done()
            except Exception as exc:  # noqa: BLE001 - torch's future carries it
                future.set_exception(exc)
                return
            future.set_result(self._outputs)

    def _done(self) -> None:
        """Copy results into torch's outputs, once; a concurrent caller returns only after."""
        with self._lock:
            finish, self._finish = self._finish, None
            if finish is not None:
                finish()

    def is_completed(self) -> bool:
        if not all(r.done() for r in self._requests):
            return False
        if all(r.exception() is None for r in self._requests):
            self._done()  # the outputs are filled once it says so
        return True

    def is_success(self) -> bool:
        return self.is_completed() and all(r.exception() is None for r in self._requests)

    def exception(self) -> Any:
        errors = [r.exception() for r in self._requests if r.done()]
        return next((e for e in errors if e is not None), None)

    def result(self) -> list[Any]:
        return self._outputs

    def synchronize(self) -> None:
        self.wait()


def _cuda_devices(outputs: list[Any]) -> list[int | str | torch.device]:
    """The CUDA devices of the outputs (a future holding CUDA tensors must name them)."""
    flat = [t for o in outputs for t in (o if isinstance(o, list) else [o])]
    return sorted({t.device for t in flat if isinstance(t, torch.Tensor)
                   and t.device.type == "cuda"}, key=str)  # fmt: skip


def joined(works: list[Work], outputs: list[Any]) -> Work:
    finishes = [w._finish for w in works if w._finish is not None]
    requests = [r for w in works for r in w._requests]

    def finish() -> None:
        for f in finishes:
            f()

    return Work(requests, outputs, finish)
