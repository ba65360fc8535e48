"""Priority: does a small urgent allreduce overtake a large one already in flight?

Theory of operation
-------------------
asyncreduce queues frames per peer in a heap on (-priority, order), so a frame of a more
urgent operation overtakes queued frames of others at frame granularity (``SEGMENT_BYTES``);
nothing preempts a frame already being written or bytes already in the socket. This benchmark
measures what that buys: on every rank, post a ``--big`` allreduce (128 MiB) at priority 0,
then at once a ``--small`` one (4 KiB, another name) at priority ``--high`` (10), and time from
posting the big one until each completes. Cases, interleaved in every round:

* ``small alone`` and ``big alone``: the two on their own (the floor and the reference);
* ``small p10``: big at priority 0, small at priority 10;
* ``small p0``: the same with the small one at priority 0 (no preemption: it waits its turn).

Completion times come from done-callbacks (``Request.add_done_callback``, which run on the
communicator's callback thread a few microseconds after completion), so the big one's time is
its own even when the small one finishes later; each is the slowest rank's. ``repeats`` rounds
after one warm-up round, medians reported, with small/big = the small one's time as a fraction
of the big one's in the same round.

With ``--libs asyncreduce,gloo`` Gloo (``torch.distributed``, ``async_op=True``) runs as the
reference a user has today, which has no priorities: ``same group`` posts both on the default
process group (the small one queues behind), ``own group`` posts the small one on a second
process group (its own connections, its own threads).

Run it as ``asyncreduce bench priority [options]`` or ``python benchmarks/priority.py``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness and allreduce.py
import harness  # noqa: E402

__all__ = ["main", "CASES"]

DEFAULT_BIG = 128 << 20
QUICK_BIG = 16 << 20
DEFAULT_SMALL = 4 << 10
DEFAULT_HIGH = 10
DEFAULT_REPEATS = 5
QUICK_REPEATS = 3
LIBS = ("asyncreduce", "gloo")

#: (library, case) -> its label; the order is the table's.
CASES: dict[tuple[str, str], str] = {
    ("asyncreduce", "small_alone"): "small alone",
    ("asyncreduce", "big_alone"): "big alone",
    ("asyncreduce", "small_high"): "big p0, then small p{high}",
    ("asyncreduce", "small_low"): "big p0, then small p0",
    ("gloo", "small_alone"): "small alone",
    ("gloo", "big_alone"): "big alone",
    ("gloo", "same_group"): "big, then small, same group",
    ("gloo", "own_group"): "big, then small on its own group",
}


@dataclass(frozen=True)
class Settings:
    nprocs: list[int]
    libs: list[str]
    big: int
    small: int
    high: int
    repeats: int
    quick: bool


def _parser() -> argparse.ArgumentParser:
    parser = harness.base_parser(
        "priority",
        "Time to complete a small high-priority allreduce posted right after a large one, "
        "against the same at equal priority and alone (asyncreduce; Gloo as a reference).",
        ("asyncreduce",),
        DEFAULT_REPEATS,
        f"big {harness.format_size(QUICK_BIG)}, {QUICK_REPEATS} repeats",
        known=LIBS,
    )
    parser.add_argument("--big", type=harness.parse_size, default=None, help="default 128M")
    parser.add_argument("--small", type=harness.parse_size, default=DEFAULT_SMALL, help="4K")
    parser.add_argument(
        "--high", type=int, default=DEFAULT_HIGH, help=f"the small one's priority ({DEFAULT_HIGH})"
    )
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    quick = bool(args.quick)
    return Settings(
        nprocs=args.nprocs,
        libs=args.libs,
        big=args.big or (QUICK_BIG if quick else DEFAULT_BIG),
        small=args.small,
        high=args.high,
        repeats=args.repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS),
        quick=quick,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one rank of it); return the exit code."""
    return harness.bench_main(
        "priority", Path(__file__), argv, _parser(), _settings, _worker, _spec,
        report, summary, plot,
    )  # fmt: skip


def _spec(s: Settings, timeout: float | None, lib: str, nprocs: int) -> harness.SetSpec:
    slow_bytes_per_s = 30e6  # far below what a busy 2-core machine does
    one = s.big * nprocs / slow_bytes_per_s
    step = 60.0 + 4 * one
    limit = timeout or harness.STARTUP_S + (s.repeats + 1) * step
    return harness.SetSpec(Path(__file__), lib, nprocs, asdict(s), limit, step)


# ---- the worker: one rank ------------------------------------------------------------------


class _Clock:
    """Completion times, stamped from done-callbacks, relative to ``start()``."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.done: dict[str, float] = {}
        self._events: dict[str, threading.Event] = {}

    def start(self, *names: str) -> None:
        self.done.clear()
        self._events = {n: threading.Event() for n in names}
        self.t0 = time.perf_counter()

    def stamp(self, name: str) -> Callable[[Any], None]:
        def callback(_: Any) -> None:
            self.done[name] = time.perf_counter() - self.t0
            self._events[name].set()

        return callback

    def wait(self) -> None:
        for event in self._events.values():
            if not event.wait(600):
                raise TimeoutError("a completion callback never ran")


Case = Callable[[_Clock], None]  # posts, registers the stamps, waits


def _asyncreduce_cases(rank: Any, s: Settings) -> dict[str, Case]:
    comm = rank.comm
    big, small = np.zeros(s.big // 4, np.float32), np.zeros(s.small // 4, np.float32)

    def post(clock: _Clock, which: str, priority: int = 0) -> Any:
        x = big if which == "big" else small
        req = comm.iallreduce(x, name=f"priority.{which}", priority=priority)
        req.add_done_callback(clock.stamp(which))
        return req

    def both(high: int) -> Case:
        def case(clock: _Clock) -> None:
            clock.start("big", "small")
            reqs = [post(clock, "big"), post(clock, "small", high)]
            rank.ar.wait_all(reqs)
            clock.wait()

        return case

    def alone(which: str) -> Case:
        def case(clock: _Clock) -> None:
            clock.start(which)
            post(clock, which, s.high if which == "small" else 0).wait()
            clock.wait()

        return case

    return {
        "small_alone": alone("small"),
        "big_alone": alone("big"),
        "small_high": both(s.high),
        "small_low": both(0),
    }


def _gloo_cases(rank: Any, s: Settings) -> dict[str, Case]:
    torch, dist = rank.torch, rank.dist
    big = torch.zeros(s.big // 4, dtype=torch.float32)
    small = torch.zeros(s.small // 4, dtype=torch.float32)
    second = dist.new_group(backend="gloo")  # every rank, same order

    def post(clock: _Clock, which: str, group: Any = None) -> Any:
        work = dist.all_reduce(big if which == "big" else small, group=group, async_op=True)
        work.get_future().add_done_callback(clock.stamp(which))
        return work

    def both(group: Any) -> Case:
        def case(clock: _Clock) -> None:
            clock.start("big", "small")
            for work in [post(clock, "big"), post(clock, "small", group)]:
                work.wait()
            clock.wait()

        return case

    def alone(which: str) -> Case:
        def case(clock: _Clock) -> None:
            clock.start(which)
            post(clock, which).wait()
            clock.wait()

        return case

    return {
        "small_alone": alone("small"),
        "big_alone": alone("big"),
        "same_group": both(None),
        "own_group": both(second),
    }


def _round(rank: harness.Rank, case: Case, clock: _Clock) -> dict[str, float]:
    """One timed run of a case: {name: completion time}, the slowest rank's."""
    rank.barrier()
    case(clock)
    return {name: rank.max(clock.done.get(name, 0.0)) for name in ("big", "small")}


def _worker(rank: harness.Rank, settings: dict[str, Any], tell: harness.Tell) -> None:
    s = Settings(**settings)
    cases = (_asyncreduce_cases if rank.lib == "asyncreduce" else _gloo_cases)(rank, s)
    clock = _Clock()
    times: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for index in range(s.repeats + 1):  # round 0 is the warm-up
        tell("start", step=f"round {index}/{s.repeats}" + (" (warm-up)" if index == 0 else ""))
        for name, case in cases.items():
            result = _round(rank, case, clock)
            if index:
                times[name].append(result)
    for name, rounds in times.items():
        tell("result", case=name, **_medians(rounds))


def _medians(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """Median times of big and small (None where the case has none), and of their ratio."""
    big = [r["big"] for r in rounds]
    small = [r["small"] for r in rounds]
    both = all(b > 0 for b in big) and all(x > 0 for x in small)
    return {
        "big_s": harness.median(big) if all(b > 0 for b in big) else None,
        "small_s": harness.median(small) if all(x > 0 for x in small) else None,
        "small_over_big": harness.median([x / b for x, b in zip(small, big, strict=True)])
        if both
        else None,
        "rounds": rounds,
    }


# ---- the parent: report ---------------------------------------------------------------------


def _label(lib: str, case: str, s: dict[str, Any]) -> str:
    return CASES[(lib, case)].format(high=s["high"])


def summary(run: harness.Run) -> dict[str, Any]:
    """Per N and library: the small one's time with and without its head start, and alone."""
    out: dict[str, Any] = {}
    for r in run.results:
        entry = out.setdefault(str(r["nprocs"]), {}).setdefault(r["lib"], {})
        entry[r["case"]] = {k: r[k] for k in ("small_s", "big_s", "small_over_big")}
    return out


def _row(r: dict[str, Any], alone: float | None, s: dict[str, Any]) -> list[str]:
    small, big, ratio = r["small_s"], r["big_s"], r["small_over_big"]
    return [
        r["lib"],
        _label(r["lib"], r["case"], s),
        harness.fmt_ms(small) if small else "-",
        harness.fmt_ms(big) if big else "-",
        f"{ratio:.3f}" if ratio is not None else "-",
        f"{small / alone:.1f}x" if small and alone else "-",
    ]


def _table(run: harness.Run, nprocs: int) -> str:
    s = run.settings
    headers = ["library", "case", "small ms", "big ms", "small/big", "small vs alone"]
    rows = []
    for lib, case in CASES:
        found = run.rows(lib=lib, nprocs=nprocs, case=case)
        alone = run.rows(lib=lib, nprocs=nprocs, case="small_alone")
        if found:
            rows.append(_row(found[0], alone[0]["small_s"] if alone else None, s))
    title = (
        f"N={nprocs}: a {harness.format_size(s['big'])} allreduce (big) posted, then at once a "
        f"{harness.format_size(s['small'])} one (small, another name); ms from posting the big "
        f"one until each completes,\nslowest rank, median of {s['repeats']} rounds after a "
        "warm-up; small/big = the small one's time as a fraction of the big one's"
    )
    if not rows:
        return title + "\n(no results)"
    return title + "\n" + harness.render_table(headers, rows, left=2)


def report(run: harness.Run, machine: dict[str, Any]) -> str:
    return harness.report_per_n(run, machine, _table)


def plot(path: Path, run: harness.Run) -> None:
    """One panel per N: completion time of the small and the big one per case (log scale)."""
    plt = harness.pyplot()
    s = run.settings
    ns = s["nprocs"]
    fig, axes = plt.subplots(1, len(ns), figsize=(6.5 * len(ns), 5), squeeze=False)
    for ax, nprocs in zip(axes[0], ns, strict=True):
        rows = [r for lib, case in CASES for r in run.rows(lib=lib, nprocs=nprocs, case=case)]
        xs = range(len(rows))
        for offset, key, label in ((-0.2, "small_s", "small done"), (0.2, "big_s", "big done")):
            values = [(r[key] or 0.0) * 1e3 for r in rows]
            ax.bar([x + offset for x in xs], values, width=0.4, label=label)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(
            [f"{r['lib']}: {_label(r['lib'], r['case'], s)}" for r in rows],
            rotation=35, ha="right", fontsize=7,
        )  # fmt: skip
        ax.set_yscale("log")
        ax.set_ylabel("ms from posting the big one (log)")
        ax.set_title(
            f"{harness.format_size(s['small'])} after {harness.format_size(s['big'])}, N={nprocs}"
        )
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    harness.save_figure(plt, fig, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
