"""One rank of the allreduce benchmark: each library behind one small interface, and the
measurement every library gets alike (``measure``, steps 1-3 of ``allreduce.py``'s theory).

``worker_main`` is what ``allreduce.py --worker LIB`` runs: it joins as ``BACKENDS[LIB]``,
times every size and reports from rank 0 as JSON lines prefixed with ``MARK``: ``ready``, then
``start`` and ``result`` per size, then ``done``.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import harness  # noqa: E402
from allreduce_report import Settings  # noqa: E402
from harness import DTYPE_BYTES  # noqa: E402

__all__ = ["BACKENDS", "MARK", "measure", "worker_main"]

MARK = "@allreduce-bench "


class _Backend:
    """What a measurement needs from a library; one subclass per library."""

    rank = 0

    def array(self, count: int) -> Any:
        return np.zeros(count, dtype=np.float32)

    def allreduce(self, x: Any) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def max(self, value: float) -> float:
        """The maximum of ``value`` over all ranks (every rank must call it)."""
        raise NotImplementedError

    def algorithm(self, nbytes: int) -> str:
        return "-"

    def close(self) -> None:
        pass


class _AsyncReduce(_Backend):
    def __init__(self) -> None:
        import asyncreduce as ar
        from asyncreduce import algorithms

        self._algorithms = algorithms
        self._comm = ar.init(timeout=60.0)  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        self.rank = self._comm.rank

    def allreduce(self, x: Any) -> None:
        self._comm.allreduce(x)

    def barrier(self) -> None:
        self._comm.barrier()

    def max(self, value: float) -> float:
        box = np.array([value], dtype=np.float64)
        self._comm.allreduce(box, op="max")
        return float(box[0])

    def algorithm(self, nbytes: int) -> str:
        # read at run time: the thresholds are the library's to change
        if nbytes <= self._algorithms.SMALL_ALLREDUCE_BYTES:
            return "lane" if self._comm.data_plane.lane else "doubling"
        cross = self._comm.data_plane.cross_memory  # every rank may read the others' memory
        return "cma" if cross and nbytes >= self._algorithms.CROSS_MEMORY_BYTES else "ring"

    def close(self) -> None:
        self._comm.close()


class _Window(_AsyncReduce):
    """asyncreduce with every buffer in a shared window: above SMALL_ALLREDUCE_BYTES no
    payload crosses a socket; below, the path of any buffer (the lane, or doubling)."""

    def array(self, count: int) -> Any:
        x = self._comm.shared_empty(count, np.float32)
        x[:] = 0
        return x

    def algorithm(self, nbytes: int) -> str:
        return "window" if nbytes > self._algorithms.SMALL_ALLREDUCE_BYTES else super().algorithm(
            nbytes
        )


class _Gloo(_Backend):
    def __init__(self) -> None:
        self._torch: Any = importlib.import_module("torch")
        self._dist: Any = importlib.import_module("torch.distributed")
        if not self._dist.is_available() or not self._dist.is_gloo_available():
            raise RuntimeError("this PyTorch build has no Gloo backend")
        self._dist.init_process_group(
            "gloo", init_method="env://", timeout=datetime.timedelta(seconds=120)
        )
        self.rank = int(self._dist.get_rank())

    def array(self, count: int) -> Any:
        return self._torch.zeros(count, dtype=self._torch.float32)

    def allreduce(self, x: Any) -> None:
        self._dist.all_reduce(x)

    def barrier(self) -> None:
        self._dist.barrier()

    def max(self, value: float) -> float:
        box = self._torch.tensor([value], dtype=self._torch.float64)
        self._dist.all_reduce(box, op=self._dist.ReduceOp.MAX)
        return float(box.item())

    def close(self) -> None:
        self._dist.destroy_process_group()


class _Mpi(_Backend):
    def __init__(self) -> None:
        self._mpi: Any = importlib.import_module("mpi4py.MPI")
        self._comm = self._mpi.COMM_WORLD
        self.rank = int(self._comm.Get_rank())

    def allreduce(self, x: Any) -> None:
        self._comm.Allreduce(self._mpi.IN_PLACE, x, op=self._mpi.SUM)

    def barrier(self) -> None:
        self._comm.Barrier()

    def max(self, value: float) -> float:
        return float(self._comm.allreduce(value, op=self._mpi.MAX))


BACKENDS: dict[str, type[_Backend]] = {
    "asyncreduce": _AsyncReduce, "window": _Window, "gloo": _Gloo, "mpi": _Mpi,
}  # fmt: skip


def measure(
    backend: _Backend, nbytes: int, min_time: float, warmup: int, repeats: int
) -> dict[str, Any]:
    """Time in-place allreduces of ``nbytes`` of float32 (see the module docstring); 0: the
    library's barrier."""
    x = backend.array(nbytes // DTYPE_BYTES)
    one = backend.barrier if nbytes == 0 else functools.partial(backend.allreduce, x)
    per_repeat = min_time / repeats
    backend.barrier()
    start = time.perf_counter()
    one()
    estimate = backend.max(time.perf_counter() - start)
    more = min(warmup - 1, int(per_repeat / max(estimate, 1e-9)))
    if more > 0:
        backend.barrier()
        start = time.perf_counter()
        for _ in range(more):
            one()
        estimate = backend.max((time.perf_counter() - start) / more)
    iters = max(1, round(per_repeat / max(estimate, 1e-9)))
    times = []
    for _ in range(repeats):
        backend.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            one()
        backend.barrier()
        times.append(backend.max((time.perf_counter() - start) / iters))
    return {
        "bytes": nbytes,
        "latency_us": statistics.median(times) * 1e6,
        "min_us": min(times) * 1e6,
        "repeats_us": [t * 1e6 for t in times],
        "iters": iters,
        "warmup": 1 + max(more, 0),
        "algorithm": "barrier" if nbytes == 0 else backend.algorithm(nbytes),
    }


def worker_main(
    lib: str, settings: Settings, parent_pid: int | None, deadline: float | None, say: str
) -> int:
    """Run one rank of ``lib``; ``say`` starts the line that tells of a passed deadline."""
    harness.watchdog(parent_pid, deadline, say)
    started = time.perf_counter()
    backend = BACKENDS[lib]()

    def tell(event: str, **fields: Any) -> None:
        if backend.rank == 0:
            print(MARK + json.dumps({"event": event, **fields}), flush=True)

    try:
        tell("ready", init_s=time.perf_counter() - started)
        for nbytes in settings.sizes:
            tell("start", bytes=nbytes)
            result = measure(backend, nbytes, settings.min_time, settings.warmup, settings.repeats)
            tell("result", **result)
        backend.barrier()
        tell("done")
    finally:
        backend.close()
    return 0
