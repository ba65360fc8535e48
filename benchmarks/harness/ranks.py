"""The worker side: one rank of one library, and the process that runs it.

``connect`` joins the job as a ``Rank``: the library's handle plus the three things every
measurement needs (``barrier``, ``max`` over ranks, ``close``), and ``gather`` (every rank's
numbers, for reports that keep them per rank). ``timed`` runs a step after a
barrier and returns each repeat's wall time, the maximum over ranks, so every rank runs the
same number of collectives.

``worker_main`` is a worker process: it reads the parent's settings (one JSON argument),
joins, runs the benchmark's body and reports from rank 0 only, as JSON lines on stdout, each
prefixed with ``MARK`` (anything else is ignored by the parent): ``ready``, then any number of
``start`` (a step begins), ``result`` (one row of results) and ``note`` (a sentence for the
report), then ``done``. ``watchdog`` ends the process (exit code 3) when the parent, or the
launcher that started it, is gone or the worker's own deadline has passed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "MARK",
    "AsyncReduceRank",
    "GlooRank",
    "MpiRank",
    "Rank",
    "Tell",
    "connect",
    "median",
    "timed",
    "watchdog",
    "worker_main",
]


MARK = "@asyncreduce-bench "


class Rank:
    """One rank of one library: its handle plus barrier, max over ranks and close."""

    lib = ""
    rank = 0
    size = 1

    def barrier(self) -> None:
        raise NotImplementedError

    def max(self, value: float) -> float:
        """The maximum of ``value`` over all ranks (every rank must call it)."""
        raise NotImplementedError

    def gather(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's ``values``, by rank, on every rank (every rank must call it with as
        many values)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class AsyncReduceRank(Rank):
    """``backend="mpi"``: ranks started by mpirun, asyncreduce over MPI (lib asyncreduce-mpi)."""

    def __init__(self, backend: str = "native") -> None:
        import numpy as np

        import asyncreduce as ar

        self.lib = "asyncreduce" if backend == "native" else f"asyncreduce-{backend}"
        self.ar: Any = ar
        self.np: Any = np
        self.comm: Any = ar.init(timeout=60.0, backend=backend)  # from the launcher
        self.rank, self.size = self.comm.rank, self.comm.world_size

    def barrier(self) -> None:
        self.comm.barrier(name="bench.barrier")

    def max(self, value: float) -> float:
        box = self.np.array([value], dtype=self.np.float64)
        self.comm.allreduce(box, op="max", name="bench.max")
        return float(box[0])

    def gather(self, values: Sequence[float]) -> list[list[float]]:
        box = _rows(self.np.zeros(self.size * len(values)), self.rank, values)
        self.comm.allreduce(box, op="sum", name="bench.gather")  # the others' rows are 0
        return _split(box.tolist(), self.size)

    def close(self) -> None:
        self.comm.close()


class GlooRank(Rank):
    """``init_method``: where the ranks meet (``env://``: MASTER_ADDR/MASTER_PORT; or
    ``tcp://host:port``), rank and world size from RANK and WORLD_SIZE either way."""

    def __init__(self, init_method: str = "env://") -> None:
        self.lib = "gloo"
        self.torch: Any = importlib.import_module("torch")
        self.dist: Any = importlib.import_module("torch.distributed")
        if not self.dist.is_available() or not self.dist.is_gloo_available():
            raise RuntimeError("this PyTorch build has no Gloo backend")
        self.torch.set_num_threads(1)  # N ranks share the cores; Gloo has its own threads
        self.dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=120),
        )
        self.rank, self.size = int(self.dist.get_rank()), int(self.dist.get_world_size())

    def barrier(self) -> None:
        self.dist.barrier()

    def max(self, value: float) -> float:
        box = self.torch.tensor([value], dtype=self.torch.float64)
        self.dist.all_reduce(box, op=self.dist.ReduceOp.MAX)
        return float(box.item())

    def gather(self, values: Sequence[float]) -> list[list[float]]:
        box = self.torch.zeros(self.size * len(values), dtype=self.torch.float64)
        box = _rows(box, self.rank, values)
        self.dist.all_reduce(box, op=self.dist.ReduceOp.SUM)  # the others' rows are 0
        return _split(box.tolist(), self.size)

    def close(self) -> None:
        self.dist.destroy_process_group()


class MpiRank(Rank):
    def __init__(self) -> None:
        rc: Any = importlib.import_module("mpi4py").rc
        rc.thread_level = "multiple"  # before MPI_Init: the threaded variants need it
        self.lib = "mpi"
        self.MPI: Any = importlib.import_module("mpi4py.MPI")
        self.comm: Any = self.MPI.COMM_WORLD
        self.rank, self.size = int(self.comm.Get_rank()), int(self.comm.Get_size())
        self.thread_multiple = self.MPI.Query_thread() == self.MPI.THREAD_MULTIPLE

    def barrier(self) -> None:
        self.comm.Barrier()

    def max(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=self.MPI.MAX))

    def gather(self, values: Sequence[float]) -> list[list[float]]:
        return [[float(v) for v in row] for row in self.comm.allgather(list(values))]


def _rows(box: Any, rank: int, values: Sequence[float]) -> Any:
    """``box`` (zeros, ranks x len(values), flat) with ``values`` in ``rank``'s row: summed
    over ranks, every row is its rank's values exactly (x + 0 is x in float64)."""
    n = len(values)
    for i, value in enumerate(values):
        box[rank * n + i] = float(value)
    return box


def _split(flat: list[float], size: int) -> list[list[float]]:
    """A flat ranks x n list as one list per rank."""
    n = len(flat) // size
    return [flat[r * n : (r + 1) * n] for r in range(size)]


def connect(lib: str) -> Rank:
    """Join the job as one rank of ``lib`` (from the environment the parent set)."""
    kinds: dict[str, Callable[[], Rank]] = {
        "asyncreduce": AsyncReduceRank,
        "asyncreduce-mpi": lambda: AsyncReduceRank("mpi"),
        "gloo": GlooRank,
        "mpi": MpiRank,
    }
    return kinds[lib]()


def timed(
    rank: Rank,
    step: Callable[[], object],
    repeats: int,
    warmup: int = 1,
    prepare: Callable[[], object] | None = None,
    after: Callable[[], object] | None = None,
) -> list[float]:
    """Wall seconds of ``step`` per repeat (after ``warmup`` untimed ones), max over ranks.

    Each run: ``prepare()`` (untimed), barrier, ``step()``; the clock stops when ``step``
    returns on this rank, then ``after()`` (untimed); the slowest rank's time counts.
    """
    times = []
    for index in range(warmup + repeats):
        if prepare is not None:
            prepare()
        rank.barrier()
        start = time.perf_counter()
        step()
        mine = time.perf_counter() - start
        if after is not None:
            after()
        elapsed = rank.max(mine)
        if index >= warmup:
            times.append(elapsed)
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


Tell = Callable[..., None]


def watchdog(parent_pid: int | None, deadline: float | None, say: str = "") -> None:
    """Exit (code 3) once the parent (or our launcher, mpirun) is gone or the deadline passed.

    ``say`` starts the line that tells of a passed deadline (on stderr).
    """
    end = None if deadline is None else time.monotonic() + deadline
    launcher = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if end is not None and time.monotonic() > end:
                print(f"{say}worker deadline of {deadline:.0f} s passed", file=sys.stderr)
                os._exit(3)
            if os.getppid() != launcher or (parent_pid is not None and not _alive(parent_pid)):
                os._exit(3)

    threading.Thread(target=watch, name="bench-watchdog", daemon=True).start()


def worker_main(
    args: argparse.Namespace,
    body: Callable[[Rank, dict[str, Any], Tell], None],
    make_rank: Callable[[str], Rank] = connect,
) -> int:
    """Run ``body(rank, settings, tell)`` as one rank; ``tell`` reports from rank 0 only.

    ``make_rank(lib)`` joins the job (default ``connect``)."""
    watchdog(args.parent_pid, args.deadline)
    settings: dict[str, Any] = json.loads(args.settings or "{}")
    started = time.perf_counter()
    rank = make_rank(args.worker)

    def tell(event: str, **fields: Any) -> None:
        if rank.rank == 0:
            print(MARK + json.dumps({"event": event, **fields}), flush=True)

    try:
        tell("ready", init_s=round(time.perf_counter() - started, 3))
        body(rank, settings, tell)
        rank.barrier()
        tell("done")
    finally:
        rank.close()
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
