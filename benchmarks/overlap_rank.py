"""One rank of the overlap benchmark: post one allreduce, compute about as long, wait.

``worker`` is the body ``harness.worker_main`` runs (``connect`` joins: the reference's own
sockets for ``tcp``, else the library's ``harness.Rank``). It warms up, calibrates ``k``
matmuls to take about as long as the allreduce alone (``_calibrate``), then for every round
times the allreduce alone, the matmuls alone and both (post, compute, wait), each the slowest
rank's, and reports the medians and ``overlap`` of them. ``Settings`` are what the parent
resolved and every rank is told (as JSON).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import harness  # noqa: E402
import rawtcp  # noqa: E402

__all__ = ["AR_MPI", "TCP", "Settings", "connect", "overlap", "worker"]

_WARMUP_MATMULS = 20
_PROBE_MATMULS = 5  # timed once, to size the calibration's runs
_CALIBRATION_S = 0.025  # each calibration run of matmuls takes about this long
_CALIBRATION_REPEATS = 5  # the fastest counts
TCP = rawtcp.NAME  # the reference: raw TCP streams, no reduction, no library
AR_MPI = "asyncreduce-mpi"  # asyncreduce over MPI (backend="mpi"): our thread polls MPI
_CALLS = {
    "asyncreduce": "iallreduce + wait",
    AR_MPI: "iallreduce + wait, over MPI",
    "gloo": "all_reduce(async_op=True) + wait",
    "mpi": "Iallreduce + Wait",
    TCP: "raw TCP streams, no reduction",
}


@dataclass(frozen=True)
class Settings:
    nprocs: list[int]
    libs: list[str]
    bytes: int
    matrix: int
    repeats: int
    warmup: int
    quick: bool
    hosts: list[int] | None = None  # None: N ranks on this host; else one rank per emulated host
    rates: list[str] = field(default_factory=list)  # with hosts: one cluster per (K, rate)
    mtu: int | None = None  # with hosts: the links' MTU


def overlap(t_comm: float, t_compute: float, t_both: float) -> float:
    """``1 - (t_both - max) / min``: 1 = the shorter one fully hidden, 0 = none of it (raw)."""
    return 1.0 - (t_both - max(t_comm, t_compute)) / min(t_comm, t_compute)


Post = Callable[[], Any]  # starts the allreduce, returns something to wait on
Wait = Callable[[Any], None]


def connect(lib: str) -> harness.Rank:
    """Join the set as one rank of ``lib``: the reference's own sockets, or the library."""
    return rawtcp.RawTcpRank() if lib == TCP else harness.connect(lib)


def _calls(rank: Any, count: int) -> tuple[Post, Wait]:
    """How this library posts the allreduce of a zero buffer, and how it waits for it (the
    reference: the bytes a ring allreduce of it moves, both ways, nothing reduced)."""
    if rank.lib == TCP:
        streams = rank.streams(count * harness.DTYPE_BYTES)
        return streams.post, streams.wait
    if rank.lib in ("asyncreduce", AR_MPI):
        x = np.zeros(count, dtype=np.float32)
        return (lambda: rank.comm.iallreduce(x, name="overlap")), (lambda req: req.wait())
    if rank.lib == "gloo":
        t = rank.torch.zeros(count, dtype=rank.torch.float32)
        return (lambda: rank.dist.all_reduce(t, async_op=True)), (lambda work: work.wait())
    mpi, y = rank.MPI, np.zeros(count, dtype=np.float32)
    return (lambda: rank.comm.Iallreduce(mpi.IN_PLACE, y, op=mpi.SUM)), (lambda req: req.Wait())


class _Compute:
    """``k`` matmuls of two square float32 matrices into a preallocated output."""

    def __init__(self, side: int) -> None:
        rng = np.random.default_rng(0)
        self.a = rng.random((side, side), dtype=np.float32)
        self.b = rng.random((side, side), dtype=np.float32)
        self.out = np.empty_like(self.a)

    def run(self, k: int) -> None:
        for _ in range(k):
            np.matmul(self.a, self.b, out=self.out)


@dataclass(frozen=True)
class _Calibration:
    comm_s: float  # the allreduce alone, median of three
    matmul_s: float  # one matmul, at the fastest of the calibration's runs
    k: int  # matmuls per round: round(comm_s / matmul_s), at least 1


def _calibrate(rank: harness.Rank, post: Post, wait: Wait, compute: _Compute) -> _Calibration:
    """``k`` matmuls take about as long as the allreduce: the allreduce's median of three, the
    matmuls' fastest of five runs of about ``_CALIBRATION_S``.

    The fastest, because a run can only be slowed by contention (on a machine with fewer free
    cores than busy threads the scheduler at times puts two ranks' computations on one core,
    and a short run caught by that takes twice as long): the minimum is the uncontended speed,
    and a median of short runs could halve ``k``."""
    t_comm = harness.median(harness.timed(rank, lambda: wait(post()), 3, warmup=0))
    count = _calibration_matmuls(rank, compute)
    fastest = min(harness.timed(rank, lambda: compute.run(count), _CALIBRATION_REPEATS, 0))
    per = fastest / count
    return _Calibration(t_comm, per, max(1, round(t_comm / per)))


def _calibration_matmuls(rank: harness.Rank, compute: _Compute) -> int:
    """How many matmuls take about ``_CALIBRATION_S``, from one short probe (the slowest rank's,
    so every rank runs as many)."""
    (probe,) = harness.timed(rank, lambda: compute.run(_PROBE_MATMULS), 1, warmup=0)
    return max(_PROBE_MATMULS, math.ceil(_CALIBRATION_S / probe * _PROBE_MATMULS))


def _both(rank: harness.Rank, post: Post, wait: Wait, compute: _Compute, k: int) -> list[float]:
    """One post-compute-wait round: [total, posting, computing, waiting], each max over ranks."""
    rank.barrier()
    t0 = time.perf_counter()
    handle = post()
    t1 = time.perf_counter()
    compute.run(k)
    t2 = time.perf_counter()
    wait(handle)
    t3 = time.perf_counter()
    return [rank.max(v) for v in (t3 - t0, t1 - t0, t2 - t1, t3 - t2)]


def worker(rank: harness.Rank, settings: dict[str, Any], tell: harness.Tell) -> None:
    s = Settings(**settings)
    post, wait = _calls(rank, s.bytes // harness.DTYPE_BYTES)
    compute = _Compute(s.matrix)
    tell("start", step="calibrate")
    for _ in range(s.warmup):
        wait(post())
        compute.run(_WARMUP_MATMULS)
        _both(rank, post, wait, compute, _WARMUP_MATMULS)
    cal = _calibrate(rank, post, wait, compute)
    k = cal.k
    comm, comp, both = [], [], []
    for index in range(s.repeats):
        tell("start", step=f"round {index + 1}/{s.repeats} (k={k})")
        comm += harness.timed(rank, lambda: wait(post()), 1, warmup=0)
        comp += harness.timed(rank, lambda: compute.run(k), 1, warmup=0)
        both.append(_both(rank, post, wait, compute, k))
    tell("result", call=_CALLS[rank.lib], bytes=s.bytes, matmuls=k, comm_estimate_s=cal.comm_s,
         matmul_calibrated_s=cal.matmul_s, **_reference(rank, s.bytes),
         **_summarize(comm, comp, both))  # fmt: skip


def _reference(rank: harness.Rank, nbytes: int) -> dict[str, Any]:
    """``reference``: whether this row is the raw-TCP reference, and if so what it moved."""
    if rank.lib != TCP:
        return {"reference": False}
    return {"reference": True, "bytes_each_way": rawtcp.ring_bytes(rank.size, nbytes)}


def _summarize(comm: list[float], comp: list[float], both: list[list[float]]) -> dict[str, Any]:
    """Medians of the rounds, the overlap (clipped and raw) and every round's times."""
    t_comm, t_compute = harness.median(comm), harness.median(comp)
    t_both = harness.median([b[0] for b in both])
    raw = overlap(t_comm, t_compute, t_both)
    return {
        "t_comm_s": t_comm,
        "t_compute_s": t_compute,
        "t_both_s": t_both,
        "post_s": harness.median([b[1] for b in both]),
        "compute_in_both_s": harness.median([b[2] for b in both]),
        "wait_in_both_s": harness.median([b[3] for b in both]),
        "overlap": min(1.0, max(0.0, raw)),
        "overlap_raw": raw,
        "comm_repeats_s": comm,
        "compute_repeats_s": comp,
        "both_repeats_s": [b[0] for b in both],
    }
