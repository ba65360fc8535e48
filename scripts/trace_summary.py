"""Summarise DataParallel timelines: the training thread's waits layer by layer, and how much of
each iteration some allreduce was in flight.

``bench scaling --trace DIR`` (or any ``DataParallel(..., timeline=Timeline(comm))`` run) writes
one Chrome trace per rank. For every file this prints, over the iterations after the first
``--skip`` (the warm-up), per iteration: the iteration's length, the time the training thread
waited in all (``wait <bucket>`` events), the buckets it waited on longest, and the share of
the iteration during which at least one allreduce was in flight (the ``comm`` track's union:
an idle share here is time the link could not have been busy with this rank's gradients).

    python scripts/trace_summary.py results/trace-scaling [--skip 2] [--top 5]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

Event = tuple[str, str, float, float]  # (name, track, start us, end us)


def events_of(path: Path) -> list[Event]:
    """The complete ("X") events of one Chrome trace file."""
    document = json.loads(path.read_text())
    return [
        (e["name"], e["cat"], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in document["traceEvents"]
        if e.get("ph") == "X"
    ]


def summary(events: list[Event], skip: int, top: int) -> dict[str, Any] | None:
    """Per-iteration waits (total, longest buckets) and the comm track's busy share, over the
    window from the end of the ``skip``-th step to the end of the last one; None if too short."""
    steps = sorted(end for name, track, _, end in events if name == "step" and track == "train")
    if len(steps) <= skip or not steps:
        return None
    start = steps[skip - 1] if skip else min(s for _, _, s, _ in events)
    end, iterations = steps[-1], len(steps) - skip
    waits: defaultdict[str, float] = defaultdict(float)
    comm: list[tuple[float, float]] = []
    for name, track, s, e in events:
        s, e = max(s, start), min(e, end)
        if e <= s:
            continue
        if track == "train" and name.startswith("wait "):
            waits[name[5:]] += e - s
        elif track == "comm":
            comm.append((s, e))
    longest = sorted(waits.items(), key=lambda kv: -kv[1])[:top]
    per = 1e6 * iterations
    return {
        "iterations": iterations,
        "iteration_s": (end - start) / per,
        "wait_s": sum(waits.values()) / per,
        "longest": [(name, t / per) for name, t in longest],
        "comm_busy": _union(comm) / (end - start),
    }


def _union(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where the trace files are")
    parser.add_argument("--skip", type=int, default=2, help="warm-up iterations to leave out")
    parser.add_argument("--top", type=int, default=5, help="how many buckets to name")
    args = parser.parse_args(argv)
    files = sorted(args.folder.glob("*.json"))
    if not files:
        print(f"no trace files in {args.folder}", file=sys.stderr)
        return 2
    for path in files:
        found = summary(events_of(path), args.skip, args.top)
        if found is None:
            print(f"{path.stem}: fewer than {args.skip + 1} steps")
            continue
        longest = ", ".join(f"{name} {t * 1e3:.1f}" for name, t in found["longest"]) or "-"
        print(f"{path.stem}: {found['iterations']} iterations of {found['iteration_s']:.3f} s; "
              f"waited {found['wait_s'] * 1e3:.1f} ms/it (longest, ms/it: {longest}); "
              f"an allreduce in flight {found['comm_busy']:.0%} of the time")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
