"""What one run of the allreduce benchmark holds, and how it is shown: tables, JSON, plot.

``Settings`` are the resolved options (parent and workers read the same), ``Result`` one
(library, N, size) point as a worker measured it in one round, ``Run`` all of them with what
was skipped or failed. ``report`` prints the machine line, one core's memcpy bandwidth (the
yardstick of a one-host allreduce) and every core's at once (its limit, issue 38), the
settings, then one ``table`` per N: latency and bus
bandwidth per library in ``LIBS`` order, and asyncreduce's (``OURS``) ratios to the others.
Over several rounds (``--rounds``) a point is the median of its rounds, and a ratio the median
of the rounds' own ratios, with their spread: each round's pair met the machine in the same
state, so a round where the scheduler placed one library's ranks badly does not decide it.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import harness  # noqa: E402
from harness import format_size  # noqa: E402

__all__ = ["LIBS", "OURS", "Result", "Run", "Settings", "memcpy_all_cores_gbps", "memcpy_gbps",
           "plot", "report", "table", "write_json"]  # fmt: skip

LIBS = ("asyncreduce", "window", "gloo", "mpi", "mpi-tcp")
OURS = ("asyncreduce", "window")  # window: asyncreduce on buffers from comm.shared_empty


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
    rounds: int = 1


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
    round: int = 0


@dataclass
class Run:
    """Everything one invocation measured."""

    settings: Settings
    results: list[Result] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # lib -> why
    failures: list[dict[str, Any]] = field(default_factory=list)
    set_seconds: dict[str, float] = field(default_factory=dict)  # "lib N=n" -> wall time

    def rounds_of(self, lib: str, nprocs: int, nbytes: int) -> dict[int, Result]:
        """The point's result in each round that measured it, by round."""
        point = (lib, nprocs, nbytes)
        return {r.round: r for r in self.results if (r.lib, r.nprocs, r.bytes) == point}

    def get(self, lib: str, nprocs: int, nbytes: int) -> Result | None:
        """The point over its rounds: the one result, or the round of median latency (the
        lower middle one of an even count)."""
        found = sorted(self.rounds_of(lib, nprocs, nbytes).values(), key=lambda r: r.latency_us)
        return found[(len(found) - 1) // 2] if found else None

    def ratios(self, ours: str, other: str, nprocs: int, nbytes: int, kind: str) -> list[float]:
        """Per round that measured both: ``kind`` "lat", our latency / the other's; else
        (bandwidth, and a barrier's speed) the other's latency / ours."""
        mine, theirs = self.rounds_of(ours, nprocs, nbytes), self.rounds_of(other, nprocs, nbytes)
        pairs = [(mine[i].latency_us, theirs[i].latency_us) for i in sorted(mine) if i in theirs]
        return [a / b if kind == "lat" else b / a for a, b in pairs]

    def failed(self, lib: str, nprocs: int) -> bool:
        return any((f["lib"], f["nprocs"]) == (lib, nprocs) for f in self.failures)


def _machine_line(machine: dict[str, Any]) -> str:
    parts = [
        f"{machine['cores']} cores" + (f" ({machine['cpu']})" if machine["cpu"] else ""),
        machine["platform"],
        f"Python {machine['python']}",
        f"numpy {machine['numpy']}",
        f"torch {machine['torch'] or 'not installed'}",
        f"mpi4py {machine['mpi4py'] or 'not installed'}",
        machine["open_mpi"] or "Open MPI not found",
        f"asyncreduce {machine['asyncreduce']} (up to "
        f"{format_size(machine['small_allreduce_bytes'])} the same-host lane where all ranks "
        "share a host, else recursive doubling; ring above; cma, where the ranks "
        f"may read each other's memory, from {format_size(machine.get('cross_memory_bytes', 0))})",
    ]
    return "machine: " + "; ".join(parts + harness.load_words(machine))


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
        row = [format_size(nbytes) if nbytes else "barrier", plain.algorithm if plain else "-"]
        for lib in libs:
            r = run.get(lib, nprocs, nbytes)
            if r is None:
                cell = "fail" if run.failed(lib, nprocs) else "-"
                row += [cell, cell]
            else:
                row += [_fmt_us(r.latency_us), _fmt_gbps(r.busbw_gbps) if nbytes else "-"]
        for _, ours, kind, lib in ratios:
            kind = kind if nbytes else "bw"  # (a barrier moves no bytes: its speed, as bw's)
            row.append(_ratio_cell(run.ratios(ours, lib, nprocs, nbytes, kind)))
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
        + ("; window = asyncreduce on comm.shared_empty buffers" if "window" in libs else "")
        + ("; barrier: each library's; ratio = other's time / ours" if 0 in s.sizes else "")
        + (
            f"; over {s.rounds} rounds: each time the median round, each ratio the median of "
            "the rounds' ratios (min-max)"
            if s.rounds > 1
            else ""
        ),
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


def _ratio_cell(values: list[float]) -> str:
    """One ratio, or the median of the rounds' with their spread."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}x"
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


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


def memcpy_all_cores_gbps(nbytes: int, repeats: int = 5) -> float:
    """Every core's copy bandwidth together at this size: one thread per core of this
    process's affinity mask, each copying a buffer of its own at once (numpy's copy releases
    the GIL), total bytes over the slowest thread's time, median of ``repeats``: the limit a
    one-host allreduce that uses every core is read against."""
    import os
    import threading

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    pairs = [(np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)) for _ in range(cores)]
    for src, dst in pairs:
        np.copyto(dst, src)  # fault the pages in
    times = []
    for _ in range(repeats):
        start = threading.Barrier(cores + 1)
        threads = [threading.Thread(target=_copy_after, args=(start, src, dst))
                   for src, dst in pairs]  # fmt: skip
        for t in threads:
            t.start()
        start.wait()
        began = time.perf_counter()
        for t in threads:
            t.join()
        times.append(time.perf_counter() - began)
    return cores * nbytes / statistics.median(times) / 1e9


def _copy_after(start: Any, src: np.ndarray, dst: np.ndarray) -> None:
    start.wait()
    np.copyto(dst, src)


def report(run: Run, machine: dict[str, Any]) -> str:
    lines = [_machine_line(machine)]
    if machine.get("memcpy_gbps"):
        copies = ", ".join(
            f"{format_size(int(size))} {gbps:.2f} GB/s"
            for size, gbps in machine["memcpy_gbps"].items()
        )
        lines.append(f"one core's memcpy (numpy copyto, after the runs): {copies}")
    if machine.get("memcpy_all_cores_gbps"):
        copies = ", ".join(
            f"{format_size(int(size))} {gbps:.2f} GB/s"
            for size, gbps in machine["memcpy_all_cores_gbps"].items()
        )
        lines.append(f"all {machine.get('copy_cores', '?')} cores' memcpy at once (a thread "
                     f"each, a buffer each): {copies}")  # fmt: skip
    for lib, why in run.skipped.items():
        lines.append(f"skipped {lib}: {why}")
    for f in run.failures:
        lines.append(f"FAILED {f['lib']} N={f['nprocs']}: {f['error']}")
    s = run.settings
    lines.append(
        f"settings: min-time {s.min_time} s per point, {s.repeats} repeats (median), "
        f"warm-up up to {s.warmup}{', quick' if s.quick else ''}"
        + (
            f"; {s.rounds} rounds, each starting every library's ranks afresh, the libraries "
            "in turn first"
            if s.rounds > 1
            else ""
        )
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
            found = (run.get(lib, nprocs, size) for size in run.settings.sizes if size)
            points = [(r.bytes, r.busbw_gbps) for r in found if r is not None]  # (no barrier)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=lib)
        ax.set_xscale("log", base=2)
        sizes = [s for s in run.settings.sizes if s]
        ax.set_xticks(sizes)
        ax.set_xticklabels([format_size(s).replace(" ", "") for s in sizes])
        ax.tick_params(axis="x", labelrotation=45)
        ax.set_title(f"allreduce, N={nprocs}")
        ax.set_xlabel("buffer size (float32)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("bus bandwidth (GB/s)")
    harness.save_figure(plt, fig, path)
