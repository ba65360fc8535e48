"""Ten allreduces at once or one after another: asyncreduce, Gloo and Open MPI, wall time.

Theory of operation
-------------------
The question: does running ten 8M-float allreduces (32 MiB each) concurrently, in ten threads
or as ten outstanding requests, beat running them one after another, and how does each library
fare? For every (library, N) one fresh set of N ranks (see ``harness``) allocates ``tensors``
float32 buffers of ``elements`` each and times every variant of that library:

* asyncreduce: ``sequential`` (``allreduce`` one after another); ``threads`` (ten threads, each
  one blocking ``allreduce`` with its own name: one connection per pair of ranks, one progress
  thread, chunks of all ten interleaved); ``requests`` (one thread: ``iallreduce`` x10, then
  ``wait_all``); and the same three as ``window-*`` on buffers from ``comm.shared_empty``
  (every rank reads its peers' buffers in place: see algorithms/shared.py). Each family is
  compared with its own sequential variant.
* Gloo (``torch.distributed``): ``sequential``; ``threads`` (ten threads, ten process groups from
  ``dist.new_group``, one per thread); ``pool2``/``pool4`` (ten threads sharing 2 or 4 of those
  groups: thread i uses group i mod P once thread i-P is done with it, an order that is the same
  on every rank, as Gloo requires); ``async`` (one thread: ``async_op=True`` x10 on the default
  group, then ``wait`` each).
* Open MPI (mpi4py, default transports: shared memory on one host): ``sequential``
  (``Allreduce``); ``requests`` (``Iallreduce`` x10 + ``Waitall``); ``threads`` (ten threads,
  each ``Allreduce`` on its own ``COMM_WORLD.Dup()``; needs ``MPI_THREAD_MULTIPLE``, skipped with
  a note when the library does not grant it).

Every run: fill buffer i with ``rank + 1 + i`` (untimed), barrier, run the variant; the wall
time is the slowest rank's. One warm-up run, then ``repeats`` timed ones, median reported. After
every run the buffers are checked against the expected sums (a sample of elements), so a
variant that paired the wrong tensors across ranks is caught, not timed. "bus GB/s" is
``tensors * bytes * 2 (N-1) / N / time``.

One rank (the variants, the buffers and their check) is ``concurrency_rank.py``.

Run it as ``asyncreduce bench concurrency [options]`` or ``python benchmarks/concurrency.py``.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from asyncreduce.argtypes import positive_int

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness and allreduce.py
import harness  # noqa: E402
from concurrency_rank import VARIANTS, WINDOW, Settings, variant_family, worker  # noqa: E402

__all__ = ["main", "VARIANTS"]

DEFAULT_TENSORS = 10
DEFAULT_ELEMENTS = 8 << 20  # 8M float32 = 32 MiB
QUICK_ELEMENTS = 1 << 20
DEFAULT_REPEATS = 3
QUICK_REPEATS = 2


def _count(text: str) -> int:
    """``"8M"`` -> 8388608 elements, ``"256K"`` -> 262144, ``"1000"`` -> 1000."""
    match = re.fullmatch(r"\s*(\d+)\s*([KM]?)\s*", text.upper())
    if not match or int(match.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"not an element count: {text!r} (try 8M, 256K, 1000)")
    return int(match.group(1)) << {"": 0, "K": 10, "M": 20}[match.group(2)]


def _parser() -> argparse.ArgumentParser:
    parser = harness.base_parser(
        "concurrency",
        "Wall time of ten concurrent float32 allreduces (threads, outstanding requests) vs ten "
        "sequential ones: asyncreduce, Gloo (torch.distributed), Open MPI (mpi4py).",
        harness.LIBS,
        DEFAULT_REPEATS,
        f"{QUICK_ELEMENTS >> 20}M elements per tensor, {QUICK_REPEATS} repeats",
    )
    parser.add_argument(
        "--tensors",
        type=positive_int,
        default=DEFAULT_TENSORS,
        help=f"allreduces per run (default {DEFAULT_TENSORS})",
    )
    parser.add_argument(
        "--elements",
        type=_count,
        default=None,
        help="float32 elements per tensor, K/M suffixes (default 8M = 32 MiB)",
    )
    parser.add_argument(
        "--warmup", type=positive_int, default=1, help="untimed runs first (default 1)"
    )
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    quick = bool(args.quick)
    return Settings(
        nprocs=args.nprocs,
        libs=args.libs,
        tensors=args.tensors,
        elements=args.elements or (QUICK_ELEMENTS if quick else DEFAULT_ELEMENTS),
        repeats=args.repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS),
        warmup=args.warmup,
        quick=quick,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one rank of it); return the exit code."""
    return harness.bench_main(
        "concurrency", Path(__file__), argv, _parser(), _settings, worker, _spec,
        report, summary, plot,
    )  # fmt: skip


def _spec(s: Settings, timeout: float | None, lib: str, nprocs: int) -> harness.SetSpec:
    runs = s.warmup + s.repeats
    slow_bytes_per_s = 30e6  # far below what a busy 2-core machine does
    step = 60.0 + runs * s.tensors * s.elements * 4 * nprocs / slow_bytes_per_s
    variants = sum(1 for key in VARIANTS if key[0] == lib)
    limit = timeout or harness.STARTUP_S + variants * step
    return harness.SetSpec(Path(__file__), lib, nprocs, asdict(s), limit, step)


# ---- the parent: report ---------------------------------------------------------------------


def _busbw(s: dict[str, Any], nprocs: int, seconds: float) -> float:
    nbytes = int(s["tensors"]) * int(s["elements"]) * 4
    return nbytes * 2 * (nprocs - 1) / nprocs / seconds / 1e9


def _best(
    run: harness.Run,
    lib: str,
    nprocs: int,
    concurrent: bool | None = None,
    family: str | None = None,
) -> Any:
    rows = [
        r
        for r in run.rows(lib=lib, nprocs=nprocs)
        if (concurrent is None or (not r["variant"].endswith("sequential")) == concurrent)
        and (family is None or variant_family(r["variant"]) == family)
    ]
    return min(rows, key=lambda r: r["seconds"]) if rows else None


def _families(lib: str) -> list[tuple[str, str, str]]:
    """(key in the summary, library, variant prefix) of each family of ``lib``'s variants."""
    plain = (lib, lib, "")
    return [plain, (f"{lib} window", lib, WINDOW)] if lib == "asyncreduce" else [plain]


def summary(run: harness.Run) -> dict[str, Any]:
    """Per N: each library's best and sequential time, and the two ratios the report states."""
    out: dict[str, Any] = {}
    for nprocs in run.settings["nprocs"]:
        entry: dict[str, Any] = {}
        for key, lib, family in (f for name in run.settings["libs"] for f in _families(name)):
            seq = run.rows(lib=lib, nprocs=nprocs, variant=family + "sequential")
            best = _best(run, lib, nprocs, family=family)
            conc = _best(run, lib, nprocs, True, family)
            if not best:
                continue
            entry[key] = {
                "best_variant": best["variant"],
                "best_s": best["seconds"],
                "sequential_s": seq[0]["seconds"] if seq else None,
                "best_concurrent_variant": conc["variant"] if conc else None,
                "concurrent_vs_sequential": (
                    seq[0]["seconds"] / conc["seconds"] if seq and conc else None
                ),
            }
        ours = [entry[k] for k in ("asyncreduce", "asyncreduce window") if k in entry]
        if ours and "gloo" in entry:
            entry["ours_best"] = min(ours, key=lambda e: e["best_s"])
            ratio = entry["ours_best"]["best_s"] / entry["gloo"]["best_s"]
            entry["ours_best_over_gloo_best"] = ratio
        out[str(nprocs)] = entry
    return out


def _table(run: harness.Run, nprocs: int) -> str:
    s = run.settings
    headers = ["library", "variant", "ms", "min-max ms", "bus GB/s", "vs seq", "check"]
    rows = []
    for (lib, variant), label in VARIANTS.items():
        found = run.rows(lib=lib, nprocs=nprocs, variant=variant)
        if not found:
            if lib in s["libs"] and lib not in run.skipped and run.failed(lib, nprocs):
                rows.append([lib, label, "fail", "-", "-", "-", "-"])
            continue
        r = found[0]
        seq = run.rows(lib=lib, nprocs=nprocs, variant=variant_family(variant) + "sequential")
        ratio = f"{seq[0]['seconds'] / r['seconds']:.2f}x" if seq else "-"
        spread = "-".join(harness.fmt_ms(f(r["repeats_s"])) for f in (min, max))
        rows.append([
            lib, label, harness.fmt_ms(r["seconds"]), spread,
            f"{_busbw(s, nprocs, r['seconds']):.2f}", ratio, "ok" if r["verified"] else "WRONG",
        ])  # fmt: skip
    size = harness.format_size(s["elements"] * 4)
    title = (
        f"N={nprocs}: {s['tensors']} allreduces of {s['elements']} float32 ({size}) each, sum in "
        f"place; wall time of all of them, median of {s['repeats']} after {s['warmup']} warm-up"
        "\nvs seq = sequential time / this time (above 1: faster than one after another); "
        "check = every rank held the right sums"
    )
    return "\n".join([title, harness.render_table(headers, rows, left=2), *_verdicts(run, nprocs)])


def _verdicts(run: harness.Run, nprocs: int) -> list[str]:
    entry = summary(run).get(str(nprocs), {})
    lines = []
    for key, lib, _ in (f for name in harness.LIBS for f in _families(name)):
        e = entry.get(key)
        if e and e["concurrent_vs_sequential"]:
            label = VARIANTS[(lib, e["best_concurrent_variant"])]
            lines.append(
                f"{key}: best concurrent ({label}) vs sequential: "
                f"speed-up {e['concurrent_vs_sequential']:.2f}x"
            )
    if "ours_best_over_gloo_best" in entry:
        mine, gloo = entry["ours_best"], entry["gloo"]
        lines.append(
            f"our best / Gloo best: {entry['ours_best_over_gloo_best']:.2f}x the time "
            f"({VARIANTS[('asyncreduce', mine['best_variant'])]}, "
            f"{harness.fmt_ms(mine['best_s'])} ms vs {VARIANTS[('gloo', gloo['best_variant'])]}, "
            f"{harness.fmt_ms(gloo['best_s'])} ms)"
        )
    return lines


def report(run: harness.Run, machine: dict[str, Any]) -> str:
    return harness.report_per_n(run, machine, _table)


def _bars(ax: Any, run: harness.Run, nprocs: int) -> None:
    """Bars grouped by library (a gap between groups), the sequential one paler."""
    colors = {"asyncreduce": "tab:blue", "gloo": "tab:orange", "mpi": "tab:green"}
    Patch: Any = importlib.import_module("matplotlib.patches").Patch
    x, ticks, labels, used = 0.0, list[float](), list[str](), set[str]()
    for (lib, variant), label in VARIANTS.items():
        found = run.rows(lib=lib, nprocs=nprocs, variant=variant)
        if not found:
            continue
        used.add(lib)
        if variant.endswith("sequential") and ticks:
            x += 0.8
        alpha = 0.5 if variant.endswith("sequential") else 0.95
        bar = ax.bar(x, found[0]["seconds"] * 1e3, color=colors[lib], alpha=alpha)
        ax.bar_label(bar, fmt="%.0f", fontsize=7)
        ticks.append(x)
        labels.append(label)
        x += 1
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    patches = [Patch(color=colors[lib], label=lib) for lib in harness.LIBS if lib in used]
    ax.legend(handles=patches)


def plot(path: Path, run: harness.Run) -> None:
    """One panel per N: wall time of every variant, grouped by library."""
    plt = harness.pyplot()
    s = run.settings
    ns = s["nprocs"]
    fig, axes = plt.subplots(1, len(ns), figsize=(7 * len(ns), 5.5), squeeze=False)
    for ax, nprocs in zip(axes[0], ns, strict=True):
        _bars(ax, run, nprocs)
        size = harness.format_size(s["elements"] * 4)
        ax.set_title(f"{s['tensors']} allreduces of {size}, N={nprocs}")
        ax.set_ylabel("wall time of all of them (ms), lower is better")
        ax.grid(True, axis="y", alpha=0.3)
    harness.save_figure(plt, fig, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
