"""asyncreduce over the engines that need one order (backend="mpi", backend="torch") against
those engines used raw, and against native asyncreduce, all in one mpirun job.

Theory of operation
-------------------
The parent starts ``mpirun -n N`` of this file with ``--worker`` for every N asked for. Each
rank opens, in this order: a native communicator (``ar.init(backend="native")``), one over
MPI (``backend="mpi"``, control messages on MPI), one over MPI with control messages on the
native engine (ASYNCREDUCE_CONTROL=native), a Gloo job (torch.distributed, rendezvous on
127.0.0.1) and one over it (``backend="torch"``). Then, every measurement between barriers
and timed as the slowest rank's wall time:

* ``10x8M``: the seed's question, ten float32 allreduces of 8M elements, each way every library
  offers: one after another (``seq``), all outstanding then wait (``req``), ten threads
  (``thr``: MPI on ten ``Dup``s of COMM_WORLD; ours with ten names). Median of ``repeats``;
  the buffers are refilled (untimed) and checked after every run.
* ``4KiB``: the latency of one 1024-float allreduce, mean over ``iterations`` back to back.
* ``fusion``: 64 allreduces of 4 KiB (and of 64 KiB) posted at once over MPI, waited together,
  for several ``fusion_bytes``: how the default threshold was chosen.
* ``overlap``: one 32 MiB allreduce posted, then numpy work as long as the allreduce alone
  takes, then wait: the share of the allreduce hidden (1 - wait / alone), raw MPI
  (``Iallreduce`` nobody tests) against ours over MPI (our thread tests it).

Run it as ``asyncreduce bench engines [--nprocs 2,4] [--json F] [--plot P] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncreduce.launch import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import harness  # noqa: E402

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncreduce bench engines", description=__doc__.split("\n")[0]
    )
    p.add_argument("--nprocs", default="2,4", help="world sizes, comma-separated (default 2,4)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of 10x8M (default 3)")
    p.add_argument("--iterations", type=int, default=300, help="4 KiB allreduces timed (300)")
    p.add_argument("--quick", action="store_true", help="1M elements, 1 repeat, 50 iterations")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--plot", help="write a bar chart here (needs matplotlib)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return _worker(args)
    if shutil.which("mpirun") is None:
        print("bench engines needs mpirun (apt install openmpi-bin) and mpi4py", file=sys.stderr)
        return 2
    results = {}
    for n in [int(v) for v in args.nprocs.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [
                "mpirun",
                "-n",
                str(n),
                "--allow-run-as-root",
                "--oversubscribe",
                "--mca",
                "btl_tcp_if_include",
                "lo",
                sys.executable,
                __file__,
                "--worker",
                str(out),
                "--repeats",
                str(args.repeats),
                "--iterations",
                str(args.iterations),
            ] + (["--quick"] if args.quick else [])
            done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if done.returncode or not out.exists():
                print(f"the N={n} job failed ({done.returncode})", file=sys.stderr)
                return 1
            results[n] = json.loads(out.read_text())
        _report(n, results[n])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"machine": _machine(), "results": results}, indent=1)
        )
    if args.plot:
        _plot(results, args.plot)
    return 0


# ---- one rank ----------------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import asyncreduce as ar
    from asyncreduce.backends.ordered.fusion import FUSION_BYTES

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    elements = (1 << 20) if args.quick else (8 << 20)
    repeats, iterations = (1, 50) if args.quick else (args.repeats, args.iterations)
    torch.set_num_threads(1)
    native = ar.init(backend="native")
    ours = ar.init(backend="mpi")
    os.environ["ASYNCREDUCE_CONTROL"] = "native"
    ours_nc = ar.init(backend="mpi")
    del os.environ["ASYNCREDUCE_CONTROL"]
    port = world.bcast(free_port() if rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    over_gloo = ar.init(backend="torch")

    def timed(fn: Callable[[], Any], prepare: Callable[[], Any] = lambda: None) -> float:
        prepare()
        world.Barrier()
        start = time.perf_counter()
        fn()
        return float(world.allreduce(time.perf_counter() - start, op=MPI.MAX))

    result: dict[str, Any] = {"elements": elements, "iterations": iterations}
    xs = [np.empty(elements, np.float32) for _ in range(10)]
    ts = [torch.from_numpy(x) for x in xs]
    dups = [world.Dup() for _ in range(10)]

    def fill() -> None:
        for i, x in enumerate(xs):
            x.fill(rank + 1 + i)

    def check() -> None:
        for i, x in enumerate(xs):
            want = sum(q + 1 + i for q in range(n))
            assert x[::4099].min() == x[::4099].max() == want, (i, x[:3], want)

    def threads(fn: Callable[[int], Any]) -> None:
        pool = [threading.Thread(target=fn, args=(i,)) for i in range(10)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()

    def comm_variants(c: ar.Communicator) -> dict[str, Callable[[], Any]]:
        return {
            "seq": lambda: [c.allreduce(x) for x in xs],
            "req": lambda: ar.wait_all([c.iallreduce(x) for x in xs]),
            "thr": lambda: threads(lambda i: c.allreduce(xs[i], name=f"t{i}")),
        }

    variants: dict[str, dict[str, Callable[[], Any]]] = {
        "mpi": {
            "seq": lambda: [world.Allreduce(MPI.IN_PLACE, x) for x in xs],
            "req": lambda: MPI.Request.Waitall([world.Iallreduce(MPI.IN_PLACE, x) for x in xs]),
            "thr": lambda: threads(lambda i: dups[i].Allreduce(MPI.IN_PLACE, xs[i])),
        },
        "ours-mpi": comm_variants(ours),
        "native": comm_variants(native),
        "gloo": {
            "seq": lambda: [dist.all_reduce(t) for t in ts],
            "req": lambda: [w.wait() for w in [dist.all_reduce(t, async_op=True) for t in ts]],
        },
        "ours-torch": comm_variants(over_gloo),
    }
    big: dict[str, dict[str, float]] = {}
    for lib, ways in variants.items():
        big[lib] = {}
        for way, fn in ways.items():
            times = []
            for _ in range(repeats + 1):
                times.append(timed(fn, fill))
                check()
            big[lib][way] = statistics.median(times[1:])
    result["10x8M"] = big

    one = np.ones(1024, np.float32)
    t1 = torch.ones(1024)
    small = {
        "mpi": lambda: world.Allreduce(MPI.IN_PLACE, one),
        "ours-mpi": lambda: ours.allreduce(one),
        "ours-mpi-native-control": lambda: ours_nc.allreduce(one),
        "native": lambda: native.allreduce(one),
        "gloo": lambda: dist.all_reduce(t1),
        "ours-torch": lambda: over_gloo.allreduce(one),
    }
    result["4KiB"] = {}
    for lib, fn in small.items():
        count = iterations if "gloo" not in lib and "torch" not in lib else max(20, iterations // 5)
        for _ in range(10):
            fn()
        result["4KiB"][lib] = timed(lambda f=fn, k=count: [f() for _ in range(k)]) / count * 1e6

    engine = ours._ordered
    assert engine is not None
    fusion: dict[str, dict[str, float]] = {}
    for size in (1024, 16384):
        many = [np.ones(size, np.float32) for _ in range(64)]
        fusion[f"{size * 4 >> 10}KiB"] = {}
        for limit in (0, 64 << 10, 1 << 20, 16 << 20):
            engine.fusion_bytes = limit

            def fn(many: list[Any] = many) -> None:
                ar.wait_all([ours.iallreduce(m, name=f"f{i}") for i, m in enumerate(many)])

            fn()
            fusion[f"{size * 4 >> 10}KiB"][str(limit)] = (
                statistics.median(timed(fn) for _ in range(5)) * 1e6
            )
    engine.fusion_bytes = FUSION_BYTES
    result["fusion_us"] = fusion

    x = xs[0]
    a = np.random.default_rng(rank).random((256, 256))

    def compute(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            a @ a

    overlap: dict[str, float] = {}
    for lib, post in (
        ("mpi", lambda: world.Iallreduce(MPI.IN_PLACE, x)),
        ("ours-mpi", lambda: ours.iallreduce(x)),
    ):
        alone = statistics.median(timed(lambda p=post: _wait(p())) for _ in range(3))
        waits = []
        for _ in range(3):
            world.Barrier()
            req = post()
            compute(alone)
            start = time.perf_counter()
            _wait(req)
            waits.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
        overlap[lib] = max(0.0, 1 - statistics.median(waits) / alone)
        overlap[f"{lib}-alone_ms"] = alone * 1e3
    result["overlap"] = overlap

    for c in (over_gloo, ours_nc, ours, native):
        c.close()
    dist.destroy_process_group()
    for d in dups:
        d.Free()
    if rank == 0:
        Path(args.worker).write_text(json.dumps(result))
    return 0


def _wait(req: Any) -> None:
    req.Wait() if hasattr(req, "Wait") else req.wait()


# ---- the report --------------------------------------------------------------------------


def _report(n: int, r: dict[str, Any]) -> None:
    print(f"\nN={n}: 10 allreduces of {r['elements'] >> 20}M float32, slowest rank's wall ms "
          "(median)")  # fmt: skip
    big = r["10x8M"]
    print(f"{'':12}" + "".join(f"{w:>10}" for w in ("seq", "req", "thr", "best")))
    for lib, ways in big.items():
        cells = [
            f"{ways[w] * 1e3:10.1f}" if w in ways else f"{'-':>10}" for w in ("seq", "req", "thr")
        ]
        print(f"{lib:12}" + "".join(cells) + f"{min(ways.values()) * 1e3:10.1f}")
    best_mpi = min(big["mpi"].values())
    print(
        f"ours over MPI, best / raw MPI's best: {min(big['ours-mpi'].values()) / best_mpi:.2f}x; "
        f"native best / raw MPI's best: {min(big['native'].values()) / best_mpi:.2f}x"
    )
    print(f"\nN={n}: one 4 KiB allreduce, us (mean of {r['iterations']} back to back)")
    for lib, us in r["4KiB"].items():
        print(f"  {lib:26}{us:9.1f}")
    s = r["4KiB"]
    print(f"  agreement over MPI costs {s['ours-mpi'] - s['mpi']:.1f} us more than raw MPI; "
          f"over Gloo {s['ours-torch'] - s['gloo']:.1f} us more than raw Gloo")  # fmt: skip
    print(f"\nN={n}: 64 allreduces posted at once over MPI, us, by fusion_bytes")
    for size, by in r["fusion_us"].items():
        print(f"  {size:6}" + "".join(f"  {int(k) >> 10:>6} KiB: {v:9.0f}" for k, v in by.items()))
    o = r["overlap"]
    print(f"\nN={n}: 32 MiB allreduce hidden behind compute: raw MPI Iallreduce {o['mpi']:.0%} "
          f"(alone {o['mpi-alone_ms']:.1f} ms), ours over MPI {o['ours-mpi']:.0%} "
          f"(alone {o['ours-mpi-alone_ms']:.1f} ms)")  # fmt: skip


def _machine() -> str:
    return f"{harness.cpu_model() or 'unknown'}, {os.cpu_count()} cores"


def _plot(results: dict[int, Any], path: str) -> None:
    try:
        plt = harness.pyplot()
    except ImportError:
        print("--plot needs matplotlib (pip install 'asyncreduce[plot]')", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (n, r) in enumerate(sorted(results.items())):
        libs = list(r["10x8M"])
        axes[0].bar(
            [j + 0.4 * i for j in range(len(libs))],
            [min(r["10x8M"][lib].values()) * 1e3 for lib in libs],
            0.4,
            label=f"N={n}",
        )
        axes[0].set_xticks(range(len(libs)), libs, rotation=20)
        small = list(r["4KiB"])
        axes[1].bar([j + 0.4 * i for j in range(len(small))], [r["4KiB"][k] for k in small], 0.4,
                    label=f"N={n}")  # fmt: skip
        axes[1].set_xticks(range(len(small)), small, rotation=30, fontsize=7)
    axes[0].set_title("10 x 8M float32, best way, ms")
    axes[1].set_title("one 4 KiB allreduce, us")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.legend()
    fig.suptitle(_machine())
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
