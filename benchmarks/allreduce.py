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

Run it as ``asyncreduce bench allreduce [options]`` or ``python benchmarks/allreduce.py``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asyncreduce.argtypes import positive_float, positive_int

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import harness  # noqa: E402
from harness import DTYPE_BYTES, busbw_gbps, format_size, machine_info, parse_size  # noqa: E402

__all__ = ["LIBS", "main", "parse_size", "format_size", "busbw_gbps"]

LIBS = ("asyncreduce", "window", "gloo", "mpi", "mpi-tcp")
OURS = ("asyncreduce", "window")  # window: asyncreduce on buffers from comm.shared_empty
DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,32M,64M,128M"
QUICK_SIZES = "4K,1M,32M"
DEFAULT_MIN_TIME = 0.3
QUICK_MIN_TIME = 0.1
DEFAULT_WARMUP = 5
QUICK_WARMUP = 2
DEFAULT_REPEATS = 3
MARK = "@allreduce-bench "

_SAY = "allreduce bench: "
_MPI_TCP = ("--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo")


# ---- sizes and units ------------------------------------------------------------------------


def _size_list(text: str) -> list[int]:
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
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
        help=f"comma-separated buffer sizes in bytes, K/M suffixes (default {DEFAULT_SIZES}; "
        f"with --quick {QUICK_SIZES})",
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
        "--timeout",
        type=positive_float,
        default=None,
        metavar="S",
        help="hard limit per (library, N) worker set (default: scaled to the sizes)",
    )
    # The worker side: how the parent starts the ranks; not for people.
    parser.add_argument("--worker", choices=tuple(_BACKENDS), help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return parser


@dataclass(frozen=True)
class Settings:
    sizes: list[int]
    nprocs: list[int]
    libs: list[str]
    min_time: float
    warmup: int
    repeats: int
    timeout: float | None
    quick: bool


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
        return _worker_main(args.worker, settings, args.parent_pid, args.deadline)
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        print(
            f"{_SAY}--plot needs matplotlib, which is not installed: "
            "pip install 'asyncreduce[plot]' (or drop --plot)",
            file=sys.stderr,
        )
        return 2
    return _parent_main(settings, args.json, args.plot, argv)


# ---- the worker: one rank ------------------------------------------------------------------


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
            return "doubling"
        cross = self._comm._cross is not None  # every rank may read the others' memory
        return "cma" if cross and nbytes >= self._algorithms.CROSS_MEMORY_BYTES else "ring"

    def close(self) -> None:
        self._comm.close()


class _Window(_AsyncReduce):
    """asyncreduce with every buffer in a shared window: above SMALL_ALLREDUCE_BYTES no
    payload crosses a socket; below, recursive doubling as for any buffer."""

    def array(self, count: int) -> Any:
        x = self._comm.shared_empty(count, np.float32)
        x[:] = 0
        return x

    def algorithm(self, nbytes: int) -> str:
        return "window" if nbytes > self._algorithms.SMALL_ALLREDUCE_BYTES else "doubling"


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


_BACKENDS: dict[str, type[_Backend]] = {
    "asyncreduce": _AsyncReduce, "window": _Window, "gloo": _Gloo, "mpi": _Mpi,
}  # fmt: skip


def measure(
    backend: _Backend, nbytes: int, min_time: float, warmup: int, repeats: int
) -> dict[str, Any]:
    """Time in-place allreduces of ``nbytes`` of float32 (see the module docstring)."""
    x = backend.array(nbytes // DTYPE_BYTES)
    per_repeat = min_time / repeats
    backend.barrier()
    start = time.perf_counter()
    backend.allreduce(x)
    estimate = backend.max(time.perf_counter() - start)
    more = min(warmup - 1, int(per_repeat / max(estimate, 1e-9)))
    if more > 0:
        backend.barrier()
        start = time.perf_counter()
        for _ in range(more):
            backend.allreduce(x)
        estimate = backend.max((time.perf_counter() - start) / more)
    iters = max(1, round(per_repeat / max(estimate, 1e-9)))
    times = []
    for _ in range(repeats):
        backend.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            backend.allreduce(x)
        backend.barrier()
        times.append(backend.max((time.perf_counter() - start) / iters))
    return {
        "bytes": nbytes,
        "latency_us": statistics.median(times) * 1e6,
        "min_us": min(times) * 1e6,
        "repeats_us": [t * 1e6 for t in times],
        "iters": iters,
        "warmup": 1 + max(more, 0),
        "algorithm": backend.algorithm(nbytes),
    }


def _worker_main(
    lib: str, settings: Settings, parent_pid: int | None, deadline: float | None
) -> int:
    harness.watchdog(parent_pid, deadline, _SAY)
    started = time.perf_counter()
    backend = _BACKENDS[lib]()

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


# ---- the parent: worker sets -----------------------------------------------------------------


@dataclass
class Result:
    lib: str
    nprocs: int
    bytes: int
    latency_us: float
    busbw_gbps: float
    algorithm: str
    min_us: float
    repeats_us: list[float]
    iters: int
    warmup: int


@dataclass
class Run:
    """Everything one invocation measured."""

    settings: Settings
    results: list[Result] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # lib -> why
    failures: list[dict[str, Any]] = field(default_factory=list)
    set_seconds: dict[str, float] = field(default_factory=dict)  # "lib N=n" -> wall time

    def get(self, lib: str, nprocs: int, nbytes: int) -> Result | None:
        for r in self.results:
            if (r.lib, r.nprocs, r.bytes) == (lib, nprocs, nbytes):
                return r
        return None

    def failed(self, lib: str, nprocs: int) -> bool:
        return any((f["lib"], f["nprocs"]) == (lib, nprocs) for f in self.failures)


def _allowance(nbytes: int, nprocs: int, settings: Settings) -> float:
    """Seconds the parent waits for one size: generous, but bounded (a hang must end)."""
    ops = settings.warmup + settings.repeats + 2
    slow_bytes_per_s = 50e6  # ~20x below what a busy 2-core machine does
    return 30.0 + 4 * settings.min_time + ops * nbytes * nprocs / slow_bytes_per_s


def _run_set(
    lib: str, nprocs: int, settings: Settings, run: Run, progress: harness.Progress
) -> None:
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
    )  # fmt: skip
    tag = harness.set_tag(spec)

    def allow(message: dict[str, Any], allowance: float) -> float:
        if message.get("event") == "start":
            return allowances[settings.sizes.index(int(message["bytes"]))]
        return allowance

    def take(message: dict[str, Any]) -> None:
        event = message.get("event")
        if event == "start":
            progress.show(f"{tag} {format_size(int(message['bytes']))} ...")
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
                )
            )

    harness.drive_set(spec, run, progress, take, allow)


# ---- the parent: report ---------------------------------------------------------------------


def _machine_line(machine: dict[str, Any]) -> str:
    parts = [
        f"{machine['cores']} cores" + (f" ({machine['cpu']})" if machine["cpu"] else ""),
        machine["platform"],
        f"Python {machine['python']}",
        f"numpy {machine['numpy']}",
        f"torch {machine['torch'] or 'not installed'}",
        f"mpi4py {machine['mpi4py'] or 'not installed'}",
        machine["open_mpi"] or "Open MPI not found",
        f"asyncreduce {machine['asyncreduce']} (doubling up to "
        f"{format_size(machine['small_allreduce_bytes'])}, ring above; cma, where the ranks "
        f"may read each other's memory, from {format_size(machine.get('cross_memory_bytes', 0))})",
    ]
    return "machine: " + "; ".join(parts)


def _fmt_us(value: float) -> str:
    if value < 10:
        return f"{value:.2f}"
    if value < 1000:
        return f"{value:.1f}"
    return f"{value:.0f}"


def _fmt_gbps(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def table(run: Run, nprocs: int) -> str:
    """The text table for one process count: one row per size."""
    s = run.settings
    libs = [lib for lib in LIBS if lib in s.libs and lib not in run.skipped]  # fixed order
    others = [lib for lib in libs if lib not in OURS]
    ratios: list[tuple[str, str, str, str]] = []  # (header, ours, "lat" or "bw", other lib)
    headers = ["size", "alg"]
    groups: list[tuple[str, int]] = [("", 2)]
    for lib in libs:
        headers += ["us", "GB/s"]
        groups.append((lib, 2))
    for ours in (lib for lib in OURS if lib in libs):
        columns = [("lat/gloo", ours, "lat", "gloo")] if "gloo" in others else []
        columns += [(f"bw/{lib}", ours, "bw", lib) for lib in others]
        if columns:
            ratios += columns
            headers += [column[0] for column in columns]
            groups.append((f"{ours} / other", len(columns)))
    rows: list[list[str]] = []
    for nbytes in s.sizes:
        plain = run.get("asyncreduce", nprocs, nbytes)
        row = [format_size(nbytes), plain.algorithm if plain else "-"]
        for lib in libs:
            r = run.get(lib, nprocs, nbytes)
            if r is None:
                cell = "fail" if run.failed(lib, nprocs) else "-"
                row += [cell, cell]
            else:
                row += [_fmt_us(r.latency_us), _fmt_gbps(r.busbw_gbps)]
        for _, ours, kind, lib in ratios:
            mine, other = run.get(ours, nprocs, nbytes), run.get(lib, nprocs, nbytes)
            if mine is None or other is None:
                row.append("-")
            elif kind == "lat":
                row.append(f"{mine.latency_us / other.latency_us:.2f}x")
            else:
                row.append(f"{mine.busbw_gbps / other.busbw_gbps:.2f}x")
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    widths[0] = max(widths[0], 7)
    # widen a group's columns until its title fits above them
    col = 0
    for title, span in groups:
        needed = len(title) - (sum(widths[col : col + span]) + 2 * (span - 1))
        if needed > 0:
            widths[col + span - 1] += needed
        col += span
    sep = "  "
    line1, col = [], 0
    for title, span in groups:
        width = sum(widths[col : col + span]) + len(sep) * (span - 1)
        line1.append(title.center(width))
        col += span
    out = [
        f"N={nprocs}: allreduce of float32 (sum, in place); us = median time per allreduce, "
        "GB/s = bus bandwidth = bytes*2(N-1)/N/time"
        + ("; window = asyncreduce on comm.shared_empty buffers" if "window" in libs else ""),
        (sep * 2).join(line1).rstrip(),
    ]

    # a double gap between groups keeps the libraries apart
    def render(cells: list[str]) -> str:
        parts, col = [], 0
        for _, span in groups:
            chunk = [
                (cells[i].ljust(widths[i]) if i == 0 else cells[i].rjust(widths[i]))
                for i in range(col, col + span)
            ]
            parts.append(sep.join(chunk))
            col += span
        return (sep * 2).join(parts).rstrip()

    out.append(render(headers))
    out += [render(r) for r in rows]
    return "\n".join(out)


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """One core's copy bandwidth at this size (numpy copyto in this process, median): the
    yardstick for a one-host allreduce, which must at least copy its buffer."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def report(run: Run, machine: dict[str, Any]) -> str:
    lines = [_machine_line(machine)]
    if machine.get("memcpy_gbps"):
        copies = ", ".join(
            f"{format_size(int(size))} {gbps:.2f} GB/s"
            for size, gbps in machine["memcpy_gbps"].items()
        )
        lines.append(f"one core's memcpy (numpy copyto, after the runs): {copies}")
    for lib, why in run.skipped.items():
        lines.append(f"skipped {lib}: {why}")
    for f in run.failures:
        lines.append(f"FAILED {f['lib']} N={f['nprocs']}: {f['error']}")
    s = run.settings
    lines.append(
        f"settings: min-time {s.min_time} s per point, {s.repeats} repeats (median), "
        f"warm-up up to {s.warmup}{', quick' if s.quick else ''}"
    )
    for nprocs in s.nprocs:
        lines += ["", table(run, nprocs)]
    return "\n".join(lines)


def write_json(
    path: Path, run: Run, machine: dict[str, Any], argv: Sequence[str], elapsed: float
) -> None:
    document = {
        **harness.json_head("allreduce", argv, elapsed, machine, sys_argv=list(sys.argv)),
        "settings": asdict(run.settings),
        "skipped": run.skipped,
        "failures": run.failures,
        "set_seconds": run.set_seconds,
        "results": [asdict(r) for r in run.results],
    }
    harness.save_json(path, document)


def plot(path: Path, run: Run) -> None:
    """Bus bandwidth against size (log x), one line per library, one panel per N."""
    plt = harness.pyplot()
    ns = run.settings.nprocs
    fig, axes = plt.subplots(1, len(ns), figsize=(6 * len(ns), 4.5), sharey=True, squeeze=False)
    for ax, nprocs in zip(axes[0], ns, strict=True):
        for lib in (lib for lib in LIBS if lib in run.settings.libs):
            points = sorted(
                (r.bytes, r.busbw_gbps) for r in run.results if (r.lib, r.nprocs) == (lib, nprocs)
            )
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=lib)
        ax.set_xscale("log", base=2)
        ax.set_xticks(run.settings.sizes)
        ax.set_xticklabels([format_size(s).replace(" ", "") for s in run.settings.sizes])
        ax.tick_params(axis="x", labelrotation=45)
        ax.set_title(f"allreduce, N={nprocs}")
        ax.set_xlabel("buffer size (float32)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("bus bandwidth (GB/s)")
    harness.save_figure(plt, fig, path)


def _parent_main(
    settings: Settings, json_path: Path | None, plot_path: Path | None, argv: Sequence[str]
) -> int:
    started = time.monotonic()
    run = Run(settings)
    harness.skip_unavailable("allreduce", settings.libs, run.skipped)
    progress = harness.Progress()
    interrupted = False
    try:
        for nprocs in settings.nprocs:
            for lib in settings.libs:
                if lib not in run.skipped:
                    _run_set(lib, nprocs, settings, run, progress)
    except KeyboardInterrupt:  # the worker set is already torn down; report what we have
        interrupted = True
        progress.end(f"{_SAY}interrupted; partial results follow")
    elapsed = time.monotonic() - started
    machine = machine_info()
    machine["memcpy_gbps"] = {str(n): memcpy_gbps(n) for n in settings.sizes if n >= 1 << 20}
    return harness.finish(
        report(run, machine), elapsed, interrupted, bool(run.failures),
        json_path, lambda path: write_json(path, run, machine, argv, elapsed),
        plot_path if run.results else None, lambda path: plot(path, run),
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
