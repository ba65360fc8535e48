"""Overlap: how much of one asynchronous allreduce hides behind computation on the caller's thread.

Theory of operation
-------------------
A user posts a non-blocking allreduce, computes, then waits: the allreduce is hidden to the
degree that the whole takes less than computing and communicating one after the other. For
every (library, N) one fresh set of N ranks (see ``common.py``) measures, on a float32 buffer
of ``--bytes`` (32 MiB by default, summed in place):

* ``t_comm``: post, then wait at once (the allreduce alone);
* ``t_compute``: ``k`` matmuls of two ``--matrix`` x ``--matrix`` float32 matrices (numpy, one
  BLAS thread: the workers run with OPENBLAS_NUM_THREADS=1), with no communication;
* ``t_both``: post, compute ``k`` matmuls, wait; the compute part and the wait are timed too.

``k`` is calibrated per library so that ``t_compute`` is about ``t_comm``: after a warm-up the
allreduce alone is timed three times, and twenty matmuls three times (all ranks at once). Then
``repeats`` rounds each time the three in turn (so drift hits all three alike); every time is
the slowest rank's, and the median over rounds is reported. The overlap is

    overlap = 1 - (t_both - max(t_comm, t_compute)) / min(t_comm, t_compute)

1 when the shorter one is completely hidden, 0 when nothing is (t_both = t_comm + t_compute);
it is reported raw and clipped to [0, 1]. The calls: asyncreduce ``iallreduce`` + ``wait``
(a progress thread moves the data), Gloo ``all_reduce(async_op=True)`` + ``wait`` (Gloo's own
threads), Open MPI ``Iallreduce`` + ``Wait`` with no MPI call during the computation, as a user
would write it (Open MPI progresses a non-blocking collective only inside MPI calls).

Every rank computes on its own core share: on a machine with fewer cores than ranks times two
busy threads, communication and computation compete for the CPU and the overlap says so.

Run it as ``asyncreduce bench overlap [options]`` or ``python benchmarks/overlap.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py and allreduce.py
import common  # noqa: E402

__all__ = ["main", "overlap"]

DEFAULT_BYTES = 32 << 20
QUICK_BYTES = 4 << 20
DEFAULT_REPEATS = 5
QUICK_REPEATS = 3
DEFAULT_MATRIX = 256
_CALIBRATION_MATMULS = 20
_ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_CALLS = {
    "asyncreduce": "iallreduce + wait",
    "gloo": "all_reduce(async_op=True) + wait",
    "mpi": "Iallreduce + Wait",
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


def overlap(t_comm: float, t_compute: float, t_both: float) -> float:
    """``1 - (t_both - max) / min``: 1 = the shorter one fully hidden, 0 = none of it (raw)."""
    return 1.0 - (t_both - max(t_comm, t_compute)) / min(t_comm, t_compute)


def _parser() -> argparse.ArgumentParser:
    parser = common.base_parser(
        "overlap",
        "How much of one non-blocking float32 allreduce hides behind numpy matmuls on the "
        "caller's thread: asyncreduce, Gloo (torch.distributed), Open MPI (mpi4py).",
        common.LIBS,
        DEFAULT_REPEATS,
        f"{common.format_size(QUICK_BYTES)} buffer, {QUICK_REPEATS} repeats",
    )
    parser.add_argument(
        "--bytes",
        type=common.parse_size,
        default=None,
        help="allreduce size, K/M suffixes (default 32M)",
    )
    parser.add_argument(
        "--matrix",
        type=common.positive_int,
        default=DEFAULT_MATRIX,
        help=f"side of the square float32 matrices multiplied (default {DEFAULT_MATRIX})",
    )
    parser.add_argument(
        "--warmup", type=common.positive_int, default=1, help="untimed rounds first (default 1)"
    )
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    quick = bool(args.quick)
    return Settings(
        nprocs=args.nprocs,
        libs=args.libs,
        bytes=args.bytes or (QUICK_BYTES if quick else DEFAULT_BYTES),
        matrix=args.matrix,
        repeats=args.repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS),
        warmup=args.warmup,
        quick=quick,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one rank of it); return the exit code."""
    return common.bench_main(
        "overlap", Path(__file__), argv, _parser(), _settings, _worker, _spec,
        report, summary, plot,
    )  # fmt: skip


def _spec(s: Settings, timeout: float | None, lib: str, nprocs: int) -> common.SetSpec:
    slow_bytes_per_s = 30e6  # far below what a busy 2-core machine does
    one = s.bytes * nprocs / slow_bytes_per_s  # one allreduce, pessimistic
    step = 60.0 + (s.warmup + 3) * 2 * one
    limit = timeout or common.STARTUP_S + 2 * step + s.repeats * 4 * one
    return common.SetSpec(Path(__file__), lib, nprocs, asdict(s), limit, step, dict(_ONE_THREAD))


# ---- the worker: one rank ------------------------------------------------------------------

Post = Callable[[], Any]  # starts the allreduce, returns something to wait on
Wait = Callable[[Any], None]


def _calls(rank: Any, count: int) -> tuple[Post, Wait]:
    """How this library posts the allreduce of a zero buffer, and how it waits for it."""
    if rank.lib == "asyncreduce":
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


def _calibrate(rank: common.Rank, post: Post, wait: Wait, compute: _Compute) -> tuple[float, int]:
    """(t_comm estimate, matmuls per round): ``k`` matmuls take about as long as the allreduce."""
    t_comm = common.median(common.timed(rank, lambda: wait(post()), 3, warmup=0))
    per = common.median(common.timed(rank, lambda: compute.run(_CALIBRATION_MATMULS), 3, 0))
    per /= _CALIBRATION_MATMULS
    return t_comm, max(1, round(t_comm / per))


def _both(rank: common.Rank, post: Post, wait: Wait, compute: _Compute, k: int) -> list[float]:
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


def _worker(rank: common.Rank, settings: dict[str, Any], tell: common.Tell) -> None:
    s = Settings(**settings)
    post, wait = _calls(rank, s.bytes // 4)
    compute = _Compute(s.matrix)
    tell("start", step="calibrate")
    for _ in range(s.warmup):
        wait(post())
        compute.run(_CALIBRATION_MATMULS)
        _both(rank, post, wait, compute, _CALIBRATION_MATMULS)
    estimate, k = _calibrate(rank, post, wait, compute)
    comm, comp, both = [], [], []
    for index in range(s.repeats):
        tell("start", step=f"round {index + 1}/{s.repeats} (k={k})")
        comm += common.timed(rank, lambda: wait(post()), 1, warmup=0)
        comp += common.timed(rank, lambda: compute.run(k), 1, warmup=0)
        both.append(_both(rank, post, wait, compute, k))
    tell("result", call=_CALLS[rank.lib], bytes=s.bytes, matmuls=k, comm_estimate_s=estimate,
         **_summarize(comm, comp, both))  # fmt: skip


def _summarize(comm: list[float], comp: list[float], both: list[list[float]]) -> dict[str, Any]:
    """Medians of the rounds, the overlap (clipped and raw) and every round's times."""
    t_comm, t_compute = common.median(comm), common.median(comp)
    t_both = common.median([b[0] for b in both])
    raw = overlap(t_comm, t_compute, t_both)
    return {
        "t_comm_s": t_comm,
        "t_compute_s": t_compute,
        "t_both_s": t_both,
        "post_s": common.median([b[1] for b in both]),
        "compute_in_both_s": common.median([b[2] for b in both]),
        "wait_in_both_s": common.median([b[3] for b in both]),
        "overlap": min(1.0, max(0.0, raw)),
        "overlap_raw": raw,
        "comm_repeats_s": comm,
        "compute_repeats_s": comp,
        "both_repeats_s": [b[0] for b in both],
    }


# ---- the parent: report ---------------------------------------------------------------------


def summary(run: common.Run) -> dict[str, Any]:
    """Per N: each library's overlap (clipped) and its speed-up over comm + compute in turn."""
    out: dict[str, Any] = {}
    for r in run.results:
        serial = r["t_comm_s"] + r["t_compute_s"]
        out.setdefault(str(r["nprocs"]), {})[r["lib"]] = {
            "overlap": r["overlap"],
            "speedup_vs_serial": serial / r["t_both_s"],
        }
    return out


def _table(run: common.Run, nprocs: int) -> str:
    s = run.settings
    headers = [
        "library", "call", "comm ms", "compute ms", "both ms", "serial ms", "overlap", "raw",
        "compute in both ms", "wait after ms", "matmuls",
    ]  # fmt: skip
    rows = []
    for lib in common.LIBS:
        for r in run.rows(lib=lib, nprocs=nprocs):
            rows.append([
                lib, r["call"], common.fmt_ms(r["t_comm_s"]), common.fmt_ms(r["t_compute_s"]),
                common.fmt_ms(r["t_both_s"]), common.fmt_ms(r["t_comm_s"] + r["t_compute_s"]),
                f"{r['overlap']:.2f}", f"{r['overlap_raw']:+.2f}",
                common.fmt_ms(r["compute_in_both_s"]), common.fmt_ms(r["wait_in_both_s"]),
                str(r["matmuls"]),
            ])  # fmt: skip
        if not run.rows(lib=lib, nprocs=nprocs) and run.failed(lib, nprocs):
            rows.append([lib, "fail", *["-"] * (len(headers) - 2)])
    title = (
        f"N={nprocs}: one {common.format_size(s['bytes'])} float32 allreduce posted, then "
        f"matmuls of {s['matrix']}x{s['matrix']} float32 (numpy, 1 thread) sized to take about "
        f"as long, then wait; median of {s['repeats']}, slowest rank\n"
        "overlap = 1 - (both - max(comm, compute)) / min(comm, compute), clipped to [0, 1]; "
        "serial = comm + compute"
    )
    if not rows:
        return title + "\n(no results)"
    return title + "\n" + common.render_table(headers, rows, left=2)


def report(run: common.Run, machine: dict[str, Any]) -> str:
    return common.report_per_n(run, machine, _table)


def plot(path: Path, run: common.Run) -> None:
    """One panel per N: comm, compute, both and comm + compute per library (grouped bars)."""
    plt = common.pyplot()
    ns = run.settings["nprocs"]
    fig, axes = plt.subplots(1, len(ns), figsize=(6 * len(ns), 4.5), squeeze=False)
    parts = [("t_comm_s", "allreduce alone"), ("t_compute_s", "compute alone"),
             ("t_both_s", "post, compute, wait"), ("serial", "comm + compute")]  # fmt: skip
    for ax, nprocs in zip(axes[0], ns, strict=True):
        rows = [r for lib in common.LIBS for r in run.rows(lib=lib, nprocs=nprocs)]
        for j, (key, label) in enumerate(parts):
            values = [
                (r["t_comm_s"] + r["t_compute_s"] if key == "serial" else r[key]) * 1e3
                for r in rows
            ]
            xs = [i + (j - 1.5) * 0.2 for i in range(len(rows))]
            ax.bar(xs, values, width=0.2, label=label, hatch="//" if key == "serial" else None)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([f"{r['lib']}\noverlap {r['overlap']:.2f}" for r in rows])
        ax.set_ylabel("ms (slowest rank, median)")
        ax.set_title(
            f"{common.format_size(run.settings['bytes'])} allreduce vs matmuls, N={nprocs}"
        )
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    common.save_figure(plt, fig, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
