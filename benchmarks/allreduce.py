"""Allreduce latency and bus bandwidth: asyncreduce against Gloo (torch.distributed) and Open MPI.

Theory of operation
-------------------
The parent (``main``) never communicates itself. For every (library, N) it starts one fresh set
of N worker processes that runs every size, so start-up is paid once per set, not per size:

* ``asyncreduce`` and ``gloo``: N copies of this file with ``--worker LIB``, each told RANK,
  WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT (a free port) in its environment;
* ``mpi`` and ``mpi-tcp``: ``mpirun -n N ... python allreduce.py --worker mpi``; ``mpi`` lets
  Open MPI choose its transport (shared memory on one host), ``mpi-tcp`` forces TCP over the
  loopback (``--mca btl self,tcp``), the same wire asyncreduce and Gloo use here.

Per size every rank allocates one float32 buffer of zeros (sums stay zero: no overflow), and
measures, identically for every library:

1. warm-up: one allreduce whose time (the maximum over ranks) estimates the cost, then up to
   ``--warmup - 1`` more, as many as fit in one repeat's time (so 128 MiB does not pay five);
2. ``repeats`` times: barrier, ``k`` back-to-back in-place allreduces of the buffer, barrier;
   the time per allreduce is elapsed / k, taken as the maximum over ranks. ``k`` is chosen
   from the warm-up estimate so that a repeat lasts about ``--min-time / repeats``;
3. the latency is the median of the repeats. Bus bandwidth is
   ``bytes * 2 (N-1) / N / latency`` (what each rank's links must carry in a ring allreduce).

Size 0 (``--sizes 0,1K``) times each library's barrier the same way: the row ``barrier``.

``--rounds R`` starts every library's worker sets R times, the libraries taking turns to go
first (round r starts with the r-th), so each library meets the machine in each round as its
rivals do; a point is then its median round, and a ratio the median of the rounds' own ratios
with their spread. Fresh ranks each round also meet a fresh placement on the cores, which on a
small machine decides a round (two ranks on one core cost every step a context switch).

Every number a rank agrees on (the estimate, each repeat's time) goes through the library's own
allreduce with op max, so all ranks always run the same number of operations.

Rank 0 reports to the parent in JSON lines on stdout, each prefixed with ``MARK`` (anything else
on stdout is ignored): ``ready``, then ``start`` and ``result`` per size, then ``done``. The
parent waits for each next line no longer than a generous allowance for that step, and caps the
whole set with ``--timeout``; on a timeout, a rank that fails, an exception or Ctrl-C it kills
every worker's process group (SIGTERM, then SIGKILL) before going on. Workers also exit by
themselves when the parent disappears or their own deadline passes.

Open MPI runs with its defaults (plus ``--bind-to none``, like the other libraries' unbound
processes); its ranks busy-poll, so on a machine with as many busy processes as cores it loses
whole scheduler slices (milliseconds). Its own settings pass through the environment, e.g.
``OMPI_MCA_mpi_yield_when_idle=1``, which Open MPI already turns on when oversubscribed.

One rank (each library's backend, ``measure``) is ``allreduce_rank.py``; what a run holds and
its report, JSON and plot are ``allreduce_report.py``.

Run it as ``asyncreduce bench allreduce [options]`` or ``python benchmarks/allreduce.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncreduce.argtypes import positive_float, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import harness  # noqa: E402
from allreduce_rank import BACKENDS, MARK, worker_main  # noqa: E402
from allreduce_report import (  # noqa: E402
    LIBS,
    Result,
    Run,
    Settings,
    memcpy_all_cores_gbps,
    memcpy_gbps,
    plot,
    report,
    write_json,
)
from harness import busbw_gbps, format_size, machine_info, parse_size  # noqa: E402

__all__ = ["LIBS", "main", "parse_size", "format_size", "busbw_gbps"]

DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,32M,64M,128M"
QUICK_SIZES = "4K,1M,32M"
DEFAULT_MIN_TIME = 0.3
QUICK_MIN_TIME = 0.1
DEFAULT_WARMUP = 5
QUICK_WARMUP = 2
DEFAULT_REPEATS = 3

_SAY = "allreduce bench: "
_MPI_TCP = ("--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo")


# ---- sizes and units ------------------------------------------------------------------------


def _size_list(text: str) -> list[int]:
    """The sizes asked for, sorted; 0 is a barrier (``measure``)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    sizes = [0 if part == "0" else parse_size(part) for part in parts]
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sorted(set(sizes))


# ---- command line ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncreduce bench allreduce",
        description="Allreduce latency and bus bandwidth of asyncreduce, Gloo (torch.distributed)"
        " and Open MPI (mpi4py), float32 sum in place, each library in fresh processes on this "
        "machine.",
        epilog="example: asyncreduce bench allreduce --quick --json results/allreduce.json",
    )
    parser.add_argument(
        "--sizes",
        type=_size_list,
        default=None,
        help=f"comma-separated buffer sizes in bytes, K/M suffixes, 0 for a barrier (default "
        f"{DEFAULT_SIZES}; with --quick {QUICK_SIZES})",
    )
    parser.add_argument(
        "--nprocs", type=harness.nprocs_list, default=[2, 4], help="process counts (default 2,4)"
    )
    parser.add_argument(
        "--libs",
        type=harness.lib_list(LIBS),
        default=list(LIBS),
        help=f"libraries to compare (default {','.join(LIBS)}); missing ones are skipped",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"sizes {QUICK_SIZES}, --min-time {QUICK_MIN_TIME}, --warmup {QUICK_WARMUP}",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every result here")
    parser.add_argument(
        "--plot", type=Path, metavar="PATH", help="bus bandwidth vs size, PNG (needs matplotlib)"
    )
    parser.add_argument(
        "--min-time",
        type=positive_float,
        default=None,
        metavar="S",
        help=f"seconds of timed allreduces per point (default {DEFAULT_MIN_TIME})",
    )
    parser.add_argument(
        "--warmup",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"untimed allreduces per point, at most (default {DEFAULT_WARMUP}; fewer when slow)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=DEFAULT_REPEATS,
        metavar="R",
        help=f"timed repeats per point, the median is reported (default {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        metavar="R",
        help="start every library's ranks R times, the libraries in turn first; each point is "
        "the median round and each ratio the median of the rounds' ratios (default 1)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        metavar="S",
        help="hard limit per (library, N) worker set (default: scaled to the sizes)",
    )
    # The worker side: how the parent starts the ranks; not for people.
    parser.add_argument("--worker", choices=tuple(BACKENDS), help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    return Settings(
        sizes=args.sizes or _size_list(QUICK_SIZES if args.quick else DEFAULT_SIZES),
        nprocs=args.nprocs,
        libs=args.libs,
        min_time=args.min_time or (QUICK_MIN_TIME if args.quick else DEFAULT_MIN_TIME),
        warmup=args.warmup or (QUICK_WARMUP if args.quick else DEFAULT_WARMUP),
        repeats=args.repeats,
        timeout=args.timeout,
        quick=args.quick,
        rounds=args.rounds,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one rank of it); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse: 2 for bad arguments, 0 for --help
        return exc.code if isinstance(exc.code, int) else 1
    settings = _settings(args)
    if args.worker:
        return worker_main(args.worker, settings, args.parent_pid, args.deadline, _SAY)
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        print(
            f"{_SAY}--plot needs matplotlib, which is not installed: "
            "pip install 'asyncreduce[plot]' (or drop --plot)",
            file=sys.stderr,
        )
        return 2
    return _parent_main(settings, args.json, args.plot, argv)


# ---- the parent: worker sets -----------------------------------------------------------------


def _allowance(nbytes: int, nprocs: int, settings: Settings) -> float:
    """Seconds the parent waits for one size: generous, but bounded (a hang must end)."""
    ops = settings.warmup + settings.repeats + 2
    slow_bytes_per_s = 50e6  # ~20x below what a busy 2-core machine does
    return 30.0 + 4 * settings.min_time + ops * nbytes * nprocs / slow_bytes_per_s


def _run_set(
    lib: str, nprocs: int, settings: Settings, run: Run, progress: harness.Progress,
    round_: int = 0,
) -> None:  # fmt: skip
    allowances = [_allowance(s, nprocs, settings) for s in settings.sizes]
    sizes = ",".join(str(s) for s in settings.sizes)
    limit = settings.timeout or (harness.STARTUP_S + sum(allowances))
    spec = harness.SetSpec(
        Path(__file__), lib, nprocs, {}, limit_s=limit, step_s=max(allowances),
        worker_args=(
            "--sizes", sizes, "--min-time", repr(settings.min_time), "--warmup",
            str(settings.warmup), "--repeats", str(settings.repeats),
        ),
        mpirun_args=_MPI_TCP if lib == "mpi-tcp" else (),
        mark=MARK,
        silence="progress",
        killed_first=True,
        limit_note=" (--timeout)" if settings.timeout else "",
        where=f"round {round_ + 1}" if settings.rounds > 1 else "",
        row={"round": round_} if settings.rounds > 1 else {},
    )  # fmt: skip
    tag = harness.set_tag(spec)

    def allow(message: dict[str, Any], allowance: float) -> float:
        if message.get("event") == "start":
            return allowances[settings.sizes.index(int(message["bytes"]))]
        return allowance

    def take(message: dict[str, Any]) -> None:
        event = message.get("event")
        if event == "start":
            nbytes = int(message["bytes"])
            progress.show(f"{tag} {format_size(nbytes) if nbytes else 'barrier'} ...")
        elif event == "result":
            nbytes = int(message["bytes"])
            seconds = float(message["latency_us"]) / 1e6
            run.results.append(
                Result(
                    lib=lib,
                    nprocs=nprocs,
                    bytes=nbytes,
                    latency_us=float(message["latency_us"]),
                    busbw_gbps=busbw_gbps(nbytes, nprocs, seconds),
                    algorithm=str(message["algorithm"]),
                    min_us=float(message["min_us"]),
                    repeats_us=[float(t) for t in message["repeats_us"]],
                    iters=int(message["iters"]),
                    warmup=int(message["warmup"]),
                    round=round_,
                )
            )

    harness.drive_set(spec, run, progress, take, allow)


def _in_turn(libs: list[str], round_: int) -> list[str]:
    """The libraries in round ``round_``'s order: each first in turn."""
    first = round_ % len(libs)
    return libs[first:] + libs[:first]


def _parent_main(
    settings: Settings, json_path: Path | None, plot_path: Path | None, argv: Sequence[str]
) -> int:
    started, load = time.monotonic(), harness.LoadWatch()
    run = Run(settings)
    harness.skip_unavailable("allreduce", settings.libs, run.skipped)
    progress = harness.Progress()
    interrupted = False
    try:
        for round_ in range(settings.rounds):
            for nprocs in settings.nprocs:
                for lib in _in_turn(settings.libs, round_):
                    if lib not in run.skipped:
                        _run_set(lib, nprocs, settings, run, progress, round_)
    except KeyboardInterrupt:  # the worker set is already torn down; report what we have
        interrupted = True
        progress.end(f"{_SAY}interrupted; partial results follow")
    elapsed = time.monotonic() - started
    machine = {**machine_info(), **load.ended()}
    machine["memcpy_gbps"] = {str(n): memcpy_gbps(n) for n in settings.sizes if n >= 1 << 20}
    machine["memcpy_all_cores_gbps"] = {str(n): memcpy_all_cores_gbps(n)
                                        for n in settings.sizes if n >= 1 << 20}  # fmt: skip
    machine["copy_cores"] = len(os.sched_getaffinity(0))
    return harness.finish(
        report(run, machine), elapsed, interrupted, bool(run.failures),
        json_path, lambda path: write_json(path, run, machine, argv, elapsed),
        plot_path if run.results else None, lambda path: plot(path, run),
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
