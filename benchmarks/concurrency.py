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
time is the slowest rank's. First ``warmup`` untimed runs of every variant, then ``rounds``
rounds: each runs every variant of the library once, in an order shuffled per round from a
fixed seed (the same on every rank), so a variant and its sequential run meet the same state
of the machine in every round. The table gives each variant's median time over the rounds and
its spread (min-max), and its speed-up computed per round: that round's sequential time / the
variant's time in that round, median and min-max over the rounds. After every run the buffers
are checked against the expected sums (a sample of elements), so a variant that paired the
wrong tensors across ranks is caught (``WRONG``), not timed. "bus GB/s" is
``tensors * bytes * 2 (N-1) / N / time``. The JSON keeps every round's time of every variant
(``rounds_s``, in round order) and its place in each round (``positions``).

One rank (the variants, the buffers and their check) is ``concurrency_rank.py``.

Run it as ``asyncreduce bench concurrency [options]`` or ``python benchmarks/concurrency.py``.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable, Sequence
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
DEFAULT_ROUNDS = 9
QUICK_ROUNDS = 3


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
        DEFAULT_ROUNDS,
        f"{QUICK_ELEMENTS >> 20}M elements per tensor, {QUICK_ROUNDS} rounds",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        metavar="R",
        help="timed rounds after the warm-up; each runs every variant once, in an order "
        "shuffled per round (fixed seed); the table gives medians and min-max over the "
        f"rounds (default {DEFAULT_ROUNDS})",
    )
    for action in parser._actions:  # the harness's name for it, kept as an alias
        if "--repeats" in action.option_strings:
            action.help = "the same as --rounds"
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
        "--warmup",
        type=positive_int,
        default=1,
        help="untimed runs of every variant before the rounds (default 1)",
    )
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    quick = bool(args.quick)
    return Settings(
        nprocs=args.nprocs,
        libs=args.libs,
        tensors=args.tensors,
        elements=args.elements or (QUICK_ELEMENTS if quick else DEFAULT_ELEMENTS),
        rounds=args.rounds or args.repeats or (QUICK_ROUNDS if quick else DEFAULT_ROUNDS),
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
    slow_bytes_per_s = 30e6  # far below what a busy 2-core machine does
    variants = sum(1 for key in VARIANTS if key[0] == lib)
    one_round = variants * s.tensors * s.elements * 4 * nprocs / slow_bytes_per_s
    step = 60.0 + max(1, s.warmup) * one_round  # the warm-up or one round: between two reports
    limit = timeout or harness.STARTUP_S + (1 + s.rounds) * step
    return harness.SetSpec(Path(__file__), lib, nprocs, asdict(s), limit, step)


# ---- the parent: report ---------------------------------------------------------------------

OLD_FORMAT = (
    "concurrency bench: this JSON is of the old format (each variant's repeats back to back, "
    "'repeats_s', no rounds), from before the variants were interleaved in rounds; its "
    "speed-ups cannot be computed per round: run the benchmark again"
)


def _check_format(run: harness.Run) -> None:
    """Refuse (exit 2, saying why) a document of the old, back-to-back format."""
    if "rounds" not in run.settings or any("rounds_s" not in r for r in run.results):
        print(OLD_FORMAT, file=sys.stderr)
        raise SystemExit(2)


def _busbw(s: dict[str, Any], nprocs: int, seconds: float) -> float:
    nbytes = int(s["tensors"]) * int(s["elements"]) * 4
    return nbytes * 2 * (nprocs - 1) / nprocs / seconds / 1e9


def _sequential(run: harness.Run, lib: str, nprocs: int, variant: str) -> Any:
    """The row of the sequential variant of ``variant``'s family, or None."""
    rows = run.rows(lib=lib, nprocs=nprocs, variant=variant_family(variant) + "sequential")
    return rows[0] if rows else None


def _speedups(run: harness.Run, row: dict[str, Any]) -> list[float] | None:
    """Per round: that round's sequential time / this variant's time in it (None: no
    sequential run to compare with)."""
    seq = _sequential(run, row["lib"], row["nprocs"], row["variant"])
    if seq is None:
        return None
    return [a / b for a, b in zip(seq["rounds_s"], row["rounds_s"], strict=True)]


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": harness.median(values), "min": min(values), "max": max(values)}


def _families(lib: str) -> list[tuple[str, str, str]]:
    """(key in the summary, library, variant prefix) of each family of ``lib``'s variants."""
    plain = (lib, lib, "")
    return [plain, (f"{lib} window", lib, WINDOW)] if lib == "asyncreduce" else [plain]


def _family_summary(run: harness.Run, lib: str, nprocs: int, family: str) -> Any:
    """A family's fastest variant (median time), its sequential time, and every concurrent
    variant's speed-up over the rounds; the best and the worst of those by their median."""
    rows = [r for r in run.rows(lib=lib, nprocs=nprocs) if variant_family(r["variant"]) == family]
    if not rows:
        return None
    best = min(rows, key=lambda r: r["seconds"])
    seq = _sequential(run, lib, nprocs, family + "sequential")
    vs_seq = {
        r["variant"]: _stats(ups)
        for r in rows
        if not r["variant"].endswith("sequential") and (ups := _speedups(run, r))
    }
    ranked = sorted(vs_seq, key=lambda v: vs_seq[v]["median"])
    return {
        "best_variant": best["variant"],
        "best_s": best["seconds"],
        "sequential_s": seq["seconds"] if seq else None,
        "vs_sequential": vs_seq,  # variant -> median, min, max of the per-round speed-ups
        "best_concurrent_variant": ranked[-1] if ranked else None,
        "concurrent_vs_sequential": vs_seq[ranked[-1]]["median"] if ranked else None,
        "worst_concurrent_variant": ranked[0] if ranked else None,
        "worst_concurrent_vs_sequential": vs_seq[ranked[0]]["median"] if ranked else None,
    }


def summary(run: harness.Run) -> dict[str, Any]:
    """Per N: each family's best and sequential time and its concurrent variants' speed-ups
    (medians over the rounds), and our best time against Gloo's."""
    out: dict[str, Any] = {}
    for nprocs in run.settings["nprocs"]:
        entry: dict[str, Any] = {}
        for key, lib, family in (f for name in run.settings["libs"] for f in _families(name)):
            found = _family_summary(run, lib, nprocs, family)
            if found:
                entry[key] = found
        ours = [entry[k] for k in ("asyncreduce", "asyncreduce window") if k in entry]
        if ours and "gloo" in entry:
            entry["ours_best"] = min(ours, key=lambda e: e["best_s"])
            ratio = entry["ours_best"]["best_s"] / entry["gloo"]["best_s"]
            entry["ours_best_over_gloo_best"] = ratio
        out[str(nprocs)] = entry
    return out


def _range(values: list[float], fmt: Callable[[float], str]) -> str:
    return f"{fmt(min(values))}-{fmt(max(values))}"


def _speedup(value: float) -> str:
    return f"{value:.2f}x"


def _row(run: harness.Run, r: dict[str, Any], label: str) -> list[str]:
    ups = _speedups(run, r)
    ratio, spread = "-", "-"
    if ups and not r["variant"].endswith("sequential"):
        ratio, spread = _speedup(harness.median(ups)), _range(ups, lambda v: f"{v:.2f}")
    elif ups:
        ratio = _speedup(1.0)
    return [
        r["lib"], label, harness.fmt_ms(r["seconds"]), _range(r["rounds_s"], harness.fmt_ms),
        f"{_busbw(run.settings, r['nprocs'], r['seconds']):.2f}", ratio, spread,
        "ok" if r["verified"] else "WRONG",
    ]  # fmt: skip


def _table(run: harness.Run, nprocs: int) -> str:
    s = run.settings
    headers = [
        "library", "variant", "median ms", "min-max ms", "bus GB/s", "vs seq", "min-max",
        "check",
    ]  # fmt: skip
    rows = []
    for (lib, variant), label in VARIANTS.items():
        found = run.rows(lib=lib, nprocs=nprocs, variant=variant)
        if found:
            rows.append(_row(run, found[0], label))
        elif lib in s["libs"] and lib not in run.skipped and run.failed(lib, nprocs):
            rows.append([lib, label, "fail", "-", "-", "-", "-", "-"])
    size = harness.format_size(s["elements"] * 4)
    title = (
        f"N={nprocs}: {s['tensors']} allreduces of {s['elements']} float32 ({size}) each, sum in "
        f"place; wall time of all of them over {s['rounds']} rounds after {s['warmup']} warm-up "
        "run(s) of each variant; each round runs every variant once, in a shuffled order"
        "\nmedian and min-max over the rounds; vs seq = per round, that round's sequential "
        "time / this time (above 1: faster than one after another), its median and min-max; "
        "check = every rank held the right sums"
    )
    return "\n".join([title, harness.render_table(headers, rows, left=2), *_verdicts(run, nprocs)])


def _verdicts(run: harness.Run, nprocs: int) -> list[str]:
    entry = summary(run).get(str(nprocs), {})
    lines = []
    for key, lib, _ in (f for name in harness.LIBS for f in _families(name)):
        e = entry.get(key)
        if not e or not e["vs_sequential"]:
            continue
        words = []
        for which in ("best", "worst"):
            variant = e[f"{which}_concurrent_variant"]
            st = e["vs_sequential"][variant]
            words.append(
                f"{which} {VARIANTS[(lib, variant)]} {_speedup(st['median'])} "
                f"({st['min']:.2f}-{st['max']:.2f})"
            )
        floor = "yes" if e["worst_concurrent_vs_sequential"] >= 1.0 else "no"
        lines.append(
            f"{key}: concurrent vs sequential, median (min-max) of the rounds: "
            f"{'; '.join(words)}; every median at least 1.00x: {floor}"
        )
    if "ours_best_over_gloo_best" in entry:
        mine, gloo = entry["ours_best"], entry["gloo"]
        lines.append(
            f"our best / Gloo best: {entry['ours_best_over_gloo_best']:.2f}x the time "
            f"({VARIANTS[('asyncreduce', mine['best_variant'])]}, "
            f"{harness.fmt_ms(mine['best_s'])} ms vs {VARIANTS[('gloo', gloo['best_variant'])]}, "
            f"{harness.fmt_ms(gloo['best_s'])} ms; medians)"
        )
    return lines


def report(run: harness.Run, machine: dict[str, Any]) -> str:
    _check_format(run)
    return harness.report_per_n(run, machine, _table)


def _bars(ax: Any, run: harness.Run, nprocs: int) -> None:
    """Median bars with min-max error bars, grouped by library (a gap between groups), the
    sequential one paler."""
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
        median, rounds = found[0]["seconds"] * 1e3, [t * 1e3 for t in found[0]["rounds_s"]]
        errors = [[median - min(rounds)], [max(rounds) - median]]
        bar = ax.bar(x, median, color=colors[lib], alpha=alpha, yerr=errors, capsize=3)
        ax.bar_label(bar, fmt="%.0f", fontsize=7, padding=2)
        ticks.append(x)
        labels.append(label)
        x += 1
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    patches = [Patch(color=colors[lib], label=lib) for lib in harness.LIBS if lib in used]
    ax.legend(handles=patches)


def plot(path: Path, run: harness.Run) -> None:
    """One panel per N: median wall time of every variant over the rounds (error bars:
    min-max), grouped by library."""
    _check_format(run)
    plt = harness.pyplot()
    s = run.settings
    ns = s["nprocs"]
    fig, axes = plt.subplots(1, len(ns), figsize=(7 * len(ns), 5.5), squeeze=False)
    for ax, nprocs in zip(axes[0], ns, strict=True):
        _bars(ax, run, nprocs)
        size = harness.format_size(s["elements"] * 4)
        ax.set_title(f"{s['tensors']} allreduces of {size}, N={nprocs}, {s['rounds']} rounds")
        ax.set_ylabel("wall time of all (ms): median, bars min-max")
        ax.grid(True, axis="y", alpha=0.3)
    harness.save_figure(plt, fig, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
