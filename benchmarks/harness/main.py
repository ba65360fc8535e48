"""A benchmark's ``main``: the worker with ``--worker``, else the parent that runs every set.

``bench_main`` is the whole ``main`` of a benchmark on the worker-set protocol: it parses the
command line, runs one rank (``worker_main``) when started as a worker, and otherwise hands a
``Benchmark`` (how to start a set, report, summarise and plot) to ``parent_main``. That skips
the libraries that cannot run here, runs every (N, library) set in turn (or what ``sets``
says, e.g. inside emulated clusters), then prints the report and writes the JSON and the plot
(``finish``). Ctrl-C stops the running set and still reports what was measured (exit code
130); a failed set makes the exit code 1. ``--from-json`` reports a saved run instead
(``replay``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .cli import parse
from .machine import LoadWatch, library_state, machine_info
from .ranks import Rank, Tell, worker_main
from .report import write_json
from .workers import Progress, Run, SetSpec, run_set, unavailable

__all__ = [
    "Benchmark",
    "SetRunner",
    "bench_main",
    "finish",
    "parent_main",
    "replay",
    "skip_unavailable",
]


@dataclass(frozen=True)
class Benchmark:
    """What ``parent_main`` needs from one benchmark."""

    name: str
    script: Path
    spec: Callable[[str, int], SetSpec]  # (lib, nprocs) -> how to run that set
    report: Callable[[Run, dict[str, Any]], str]
    summary: Callable[[Run], dict[str, Any]]
    plot: Callable[[Path, Run], None]


def replay(bench: Benchmark, path: Path, plot_path: Path | None) -> int:
    """Print the report of a saved ``--json`` document (and plot it) without running anything."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"{bench.name} bench: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    if doc.get("benchmark") != bench.name:
        print(f"{bench.name} bench: {path} is a {doc.get('benchmark')!r} run", file=sys.stderr)
        return 2
    run = Run(bench.name, doc["settings"], doc["results"], doc["skipped"], doc["failures"],
              doc["notes"], doc["set_seconds"])  # fmt: skip
    print(bench.report(run, doc["machine"]))
    print(f"\n(measured {doc['date']} by: {doc['command']['line']}; total {doc['elapsed_s']} s)")
    if plot_path is not None and run.results:
        bench.plot(plot_path, run)
        print(f"wrote {plot_path}")
    return 1 if run.failures else 0


SetRunner = Callable[[Run, Sequence[str], Progress], None]  # (run, libraries, progress)


def _sets_here(bench: Benchmark, nprocs: Sequence[int]) -> SetRunner:
    """Every (N, library) set on this host, N by N."""

    def run_all(run: Run, libs: Sequence[str], progress: Progress) -> None:
        for n in nprocs:
            for lib in libs:
                run_set(bench.spec(lib, n), run, progress)

    return run_all


def parent_main(
    bench: Benchmark, run: Run, libs: Sequence[str], nprocs: Sequence[int],
    argv: Sequence[str], args: argparse.Namespace,
    sets: SetRunner | None = None, why_not: Callable[[str], str | None] = unavailable,
) -> int:  # fmt: skip
    """Run every (N, library) set in turn, print the report, write JSON and plot.

    ``args`` supplies ``json``, ``plot`` and ``from_json`` (report a saved run instead).
    ``sets(run, libs, progress)``, where given, runs the sets instead (e.g. in emulated
    clusters, ``run_set_in_cluster``) with the libraries that ``why_not`` did not skip.
    """
    json_path, plot_path = args.json, args.plot
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        print("--plot needs matplotlib: pip install 'asyncreduce[plot]'", file=sys.stderr)
        return 2
    if args.from_json is not None:
        return replay(bench, args.from_json, plot_path)
    started, load = time.monotonic(), LoadWatch()
    skip_unavailable(bench.name, libs, run.skipped, why_not)
    progress = Progress()
    interrupted = False
    try:
        runner = sets or _sets_here(bench, nprocs)
        runner(run, [lib for lib in libs if lib not in run.skipped], progress)
    except KeyboardInterrupt:  # the set is torn down already; report what we have
        interrupted = True
        progress.end(f"{bench.name} bench: interrupted; partial results follow")
    elapsed = time.monotonic() - started
    machine = {**machine_info(), "library": library_state()}
    machine.update(load.ended())
    return finish(
        bench.report(run, machine), elapsed, interrupted, bool(run.failures),
        json_path, lambda path: write_json(path, run, machine, argv, elapsed, bench.summary(run)),
        plot_path if run.results else None, lambda path: bench.plot(path, run),
    )  # fmt: skip


def skip_unavailable(
    name: str, libs: Sequence[str], skipped: dict[str, str],
    why_not: Callable[[str], str | None] = unavailable,
) -> None:  # fmt: skip
    """Record (and say on stderr) each of ``libs`` that cannot run here."""
    for lib in libs:
        why = why_not(lib)
        if why:
            skipped[lib] = why
            print(f"{name} bench: skipping {lib}: {why}", file=sys.stderr)


def finish(
    report: str, elapsed: float, interrupted: bool, failed: bool,
    json_path: Path | None, write: Callable[[Path], None],
    plot_path: Path | None, plot: Callable[[Path], None],
) -> int:  # fmt: skip
    """Print the report, write the JSON and the plot (where asked), return the exit code."""
    print(report)
    print(f"\n(total {elapsed:.1f} s)")
    if json_path is not None:
        write(json_path)
        print(f"wrote {json_path}")
    if plot_path is not None:
        plot(plot_path)
        print(f"wrote {plot_path}")
    if interrupted:
        return 130
    return 1 if failed else 0


def bench_main(
    name: str, script: Path, argv: Sequence[str] | None, parser: argparse.ArgumentParser,
    settings: Callable[[argparse.Namespace], Any],
    worker: Callable[[Rank, dict[str, Any], Tell], None],
    spec: Callable[[Any, float | None, str, int], SetSpec],
    report: Callable[[Run, dict[str, Any]], str], summary: Callable[[Run], dict[str, Any]],
    plot: Callable[[Path, Run], None],
) -> int:  # fmt: skip
    """The ``main`` of a benchmark on this module's protocol: one rank with ``--worker``, else
    the parent. ``settings(args)`` is a dataclass with ``libs`` and ``nprocs``; ``spec(settings,
    --timeout, lib, N)`` says how to run one set."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    if args.worker:
        return worker_main(args, worker)
    s = settings(args)
    bench = Benchmark(
        name, script, lambda lib, n: spec(s, args.timeout, lib, n), report, summary, plot
    )
    run = Run(name, asdict(s))
    return parent_main(bench, run, s.libs, s.nprocs, argv, args)
