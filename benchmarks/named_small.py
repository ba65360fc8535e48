"""Named small allreduces on one host, against Open MPI, in the same processes under mpirun.

Issue 36 asks that a *named* 1-16 KiB blocking allreduce on one host cost at most 5x Open MPI's
shared-memory latency. Each rank of one ``mpirun`` holds both libraries: mpi4py's
``COMM_WORLD`` (Open MPI picks shared memory on one host) and an asyncreduce communicator
made over that job (``ar.init()`` under mpirun). For every size, in every round, three loops
run back to back in an order that rotates from round to round: ``MPI.Allreduce``, asyncreduce's
``allreduce`` with a name (the lane's named slots, lane/named.py) and without one (its
sequence-numbered slots). A loop's time is the slowest rank's mean per operation; the table
gives the median over the rounds and the ratio to Open MPI of the same round.

Run: ``python benchmarks/named_small.py [--nprocs 2,4] [--sizes 1K,4K,16K] [--rounds 5]
[--json FILE] [--plot FILE]``; ``ASYNCREDUCE_LANE_NAMED=0`` in the environment shows the
engine's path for the named loop (the "before"). Figures differ several-fold between
machines: compare the columns of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import harness  # noqa: E402

LIBS = ("mpi", "named", "unnamed")
MPIRUN = ("--allow-run-as-root", "--oversubscribe", "--bind-to", "none")


def _worker(sizes: list[int], rounds: int, seconds: float) -> None:
    import numpy as np
    from mpi4py import MPI

    import asyncreduce as ar

    world = MPI.COMM_WORLD
    comm = ar.init()
    rows: list[dict[str, Any]] = []
    for round_ in range(rounds):
        for nbytes in sizes:
            x = np.ones(nbytes // 4, np.float32)
            out = np.empty_like(x)
            calls = {
                "mpi": lambda x=x, out=out: world.Allreduce(x, out),
                "named": lambda x=x: comm.allreduce(x, name="loss"),
                "unnamed": lambda x=x: comm.allreduce(x),
            }
            order = LIBS[round_ % 3 :] + LIBS[: round_ % 3]
            for lib in order:
                call = calls[lib]
                for _ in range(50):
                    call()
                world.Barrier()
                iters = _iterations(call, seconds, world)
                start = time.perf_counter()
                for _ in range(iters):
                    call()
                mean = (time.perf_counter() - start) / iters
                slowest = world.allreduce(mean, op=MPI.MAX)
                rows.append({"round": round_, "bytes": nbytes, "lib": lib, "s": slowest})
    lane = comm._backend.lane  # type: ignore[attr-defined]
    named = getattr(lane, "named", None)
    used = {"named_in_lane": named.completed if named is not None else 0}
    comm.close()
    if world.rank == 0:
        print(json.dumps({"rows": rows, **used}), flush=True)


def _iterations(call: Any, seconds: float, world: Any) -> int:
    """As many iterations as take about ``seconds`` (every rank the same number)."""
    from mpi4py import MPI

    start = time.perf_counter()
    for _ in range(20):
        call()
    each = (time.perf_counter() - start) / 20
    return int(world.allreduce(max(20, min(20000, int(seconds / max(each, 1e-7)))), op=MPI.MAX))


def _run(n: int, sizes: list[int], rounds: int, seconds: float) -> dict[str, Any]:
    command = ["mpirun", "-n", str(n), *MPIRUN, sys.executable, __file__, "--worker",
               "--sizes", ",".join(map(str, sizes)), "--rounds", str(rounds),
               "--seconds", str(seconds)]  # fmt: skip
    env = dict(os.environ)
    src = harness.package_root()
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]
    raise RuntimeError(f"mpirun -n {n} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def _table(n: int, got: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    rows = got["rows"]
    headers = ["size", "Open MPI (us)", "named (us)", "unnamed (us)", "named / MPI",
               "unnamed / MPI"]  # fmt: skip
    lines, summary = [], []
    for nbytes in sorted({r["bytes"] for r in rows}):
        by = {lib: {r["round"]: r["s"] for r in rows if r["bytes"] == nbytes and r["lib"] == lib}
              for lib in LIBS}  # fmt: skip
        med = {lib: statistics.median(by[lib].values()) for lib in LIBS}
        ratio = {lib: statistics.median(by[lib][k] / by["mpi"][k] for k in by["mpi"])
                 for lib in ("named", "unnamed")}  # fmt: skip
        lines.append([harness.format_size(nbytes), f"{med['mpi'] * 1e6:.2f}",
                      f"{med['named'] * 1e6:.2f}", f"{med['unnamed'] * 1e6:.2f}",
                      f"{ratio['named']:.1f}x", f"{ratio['unnamed']:.1f}x"])  # fmt: skip
        times = {f"{k}_us": v * 1e6 for k, v in med.items()}
        ratios = {f"{k}_ratio": v for k, v in ratio.items()}
        summary.append({"n": n, "bytes": nbytes, **times, **ratios})
    title = f"N={n} (named operations the lane completed on rank 0: {got['named_in_lane']})"
    return title + "\n" + harness.render_table(headers, lines), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nprocs", default="2,4")
    parser.add_argument("--sizes", default="1K,4K,16K")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.3, help="per loop and round")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    sizes = [harness.parse_size(s) for s in args.sizes.split(",")]
    if args.worker:
        _worker(sizes, args.rounds, args.seconds)
        return
    machine = harness.machine_info()
    print(harness.machine_line(machine))
    summary: list[dict[str, Any]] = []
    for n in (int(v) for v in args.nprocs.split(",")):
        text, rows = _table(n, _run(n, sizes, args.rounds, args.seconds))
        print(text, flush=True)
        summary += rows
    if args.json:
        named = os.environ.get("ASYNCREDUCE_LANE_NAMED", "1")
        harness.save_json(args.json, {"machine": machine, "rows": summary, "lane_named": named})
    if args.plot:
        _plot(summary, args.plot)


def _plot(summary: list[dict[str, Any]], path: Path) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in sorted({r["n"] for r in summary}):
        rows = [r for r in summary if r["n"] == n]
        ax.plot([r["bytes"] for r in rows], [r["named_ratio"] for r in rows], "o-",
                label=f"named, N={n}")  # fmt: skip
    ax.axhline(5, color="grey", linestyle="--", label="target: 5x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_ylabel("time / Open MPI's")
    ax.legend()
    harness.save_figure(plt, fig, path)


if __name__ == "__main__":
    main()
