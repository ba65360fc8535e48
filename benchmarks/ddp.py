"""DDP over asyncreduce against DDP over Gloo: one model, one host or emulated hosts.

Theory of operation
-------------------
PyTorch's ``DistributedDataParallel`` runs unchanged on any process group; this measures what
the group behind it costs. Every rank joins Gloo as the default process group
(``init_process_group("gloo")``, env://) and makes a second group of the asyncreduce backend
(``new_group(backend="asyncreduce")``), then trains three copies of one model (same seed, same
data) in interleaved rounds:

* ``gloo``: DDP over the Gloo group;
* ``asyncreduce``: DDP over the asyncreduce group;
* ``no comm``: DDP over Gloo with a communication hook that returns each bucket untouched:
  DDP's own work, no communication at all.

The step time is the slowest rank's median over the timed steps of all rounds. What DDP
cannot hide is the step time minus ``no comm``'s (its **exposed** communication); the report
gives it per backend and their ratio (asyncreduce / Gloo: lower is better).

The **wrapper's cost** (one host only): on the same tensor, ``dist.all_reduce`` through the
backend against the communicator behind it called directly (``asyncreduce.torch.communicator``),
interleaved, median of many calls, at 4 KiB and 32 MiB.

Settings: ``--ranks`` on one host (``asyncreduce run``), and ``--hosts`` at each of ``--rates``
on emulated hosts (network namespaces behind ``tc`` shaped links, root only; see
``scripts/cluster.py``), one rank per host.

Run it as ``asyncreduce bench ddp [options]`` or ``python benchmarks/ddp.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent
sys.path.insert(0, str(_HERE))  # the harness, next to this file
import harness  # noqa: E402

MARK = "DDP-BENCH "
VARIANTS = ("gloo", "asyncreduce", "no comm")


# ---- inside each rank ------------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import asyncreduce.torch as art

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ours = dist.new_group(backend="asyncreduce")
    rank = dist.get_rank()

    def model() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(args.depth):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(args.width, 10))

    def completed(buffer: Any) -> Any:
        done: Any = torch.futures.Future()
        done.set_result(buffer)
        return done

    # DDP checks a hook's annotations (GradBucket, Future) and this module's are strings
    untouched = lambda state, bucket: completed(bucket.buffer())  # noqa: E731

    models = {"gloo": DDP(model()), "asyncreduce": DDP(model(), process_group=ours),
              "no comm": DDP(model())}  # fmt: skip
    models["no comm"].register_comm_hook(None, untouched)
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()

    def step(name: str) -> None:
        optimizers[name].zero_grad()
        loss_fn(models[name](x), y).backward()
        optimizers[name].step()

    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for name in VARIANTS:
        for _ in range(args.warmup):
            step(name)
    for _ in range(args.rounds):
        for name in VARIANTS:
            dist.barrier()
            for _ in range(args.steps):
                start = time.perf_counter()
                step(name)
                times[name].append(time.perf_counter() - start)
    slowest = {}
    for name, samples in times.items():
        med = torch.tensor([statistics.median(samples)], dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        slowest[name] = float(med)
    wrapper = _wrapper_cost(dist, ours, art.communicator(ours), np, torch) if args.wrapper else {}
    if rank == 0:
        print(MARK + json.dumps({"step_s": slowest, "wrapper": wrapper}), flush=True)
    dist.destroy_process_group()


def _wrapper_cost(dist: Any, group: Any, comm: Any, np: Any, torch: Any) -> dict[str, Any]:
    """dist.all_reduce through the backend vs the communicator directly, interleaved."""
    out = {}
    for nbytes, reps in ((4 << 10, 2000), (32 << 20, 20)):
        t = torch.ones(nbytes // 4)
        a = t  # the same tensor both ways: the wrapper's cost alone
        through, direct = [], []
        for i in range(reps + reps // 10):
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_reduce(t, group=group)
            middle = time.perf_counter()
            comm.allreduce(a)
            end = time.perf_counter()
            if i >= reps // 10:  # the first tenth warms up
                through.append(middle - start)
                direct.append(end - middle)
        out[str(nbytes)] = {"through_s": statistics.median(through),
                            "direct_s": statistics.median(direct)}  # fmt: skip
    return out


# ---- the parent ------------------------------------------------------------------------------


def _worker_argv(args: argparse.Namespace, wrapper: bool) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker",
            "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
            "--steps", str(args.steps), "--rounds", str(args.rounds),
            "--warmup", str(args.warmup)]  # fmt: skip
    return argv + (["--wrapper"] if wrapper else [])


def _result(lines: Sequence[str]) -> dict[str, Any]:
    found = [line.split(MARK, 1)[1] for line in lines if MARK in line]
    if not found:
        raise RuntimeError("no result from rank 0:\n" + "\n".join(lines[-30:]))
    result: dict[str, Any] = json.loads(found[-1])
    return result


def _one_host(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "asyncreduce", "run", "-n", str(ranks),
           *_worker_argv(args, wrapper=True)[1:]]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}  # Gloo on loopback, like the others
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit, cwd=ROOT,
                         env=env)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])
    return _result(out.stdout.splitlines())


def _hosts(args: argparse.Namespace, hosts: int, rate: str) -> dict[str, Any]:
    cluster: Any = harness.load_module(
        "asyncreduce_scripts.cluster", ROOT / "scripts" / "cluster.py"
    )

    lines: list[str] = []
    with cluster.Cluster(hosts=hosts, rate=rate) as c:
        def env(i: int) -> dict[str, str]:
            return {"RANK": str(i), "WORLD_SIZE": str(hosts), "LOCAL_RANK": "0",
                    "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": c.addrs[0], "MASTER_PORT": "29511",
                    "GLOO_SOCKET_IFNAME": c.ifname, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": str(ROOT / "src")}  # fmt: skip

        codes = c.run(_worker_argv(args, wrapper=False), env, timeout=args.limit,
                      on_line=lambda _, line: lines.append(line))  # fmt: skip
    if any(codes):
        raise RuntimeError(f"exit codes {codes}:\n" + "\n".join(lines[-30:]))
    return _result(lines)


def _row(setting: str, ranks: int, result: dict[str, Any]) -> dict[str, Any]:
    step = result["step_s"]
    exposed = {k: step[k] - step["no comm"] for k in ("gloo", "asyncreduce")}
    ratio = exposed["asyncreduce"] / exposed["gloo"] if exposed["gloo"] > 0 else None
    return {"setting": setting, "ranks": ranks, "step_s": step, "exposed_s": exposed,
            "exposed_ratio": ratio, "wrapper": result.get("wrapper", {})}  # fmt: skip


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'setting':<14}{'ranks':>6}{'gloo ms':>10}{'ours ms':>10}{'no comm':>10}"
            f"{'exposed gloo':>14}{'exposed ours':>14}{'ours/gloo':>11}")  # fmt: skip
    lines = [head]
    for r in rows:
        s, e = r["step_s"], r["exposed_s"]
        ratio = f"{r['exposed_ratio']:.2f}x" if r["exposed_ratio"] is not None else "-"
        steps = "".join(f"{s[k] * 1e3:>10.1f}" for k in ("gloo", "asyncreduce", "no comm"))
        exposed = f"{e['gloo'] * 1e3:>14.1f}{e['asyncreduce'] * 1e3:>14.1f}"
        lines.append(f"{r['setting']:<14}{r['ranks']:>6}{steps}{exposed}{ratio:>11}")
    wrappers = [(r["ranks"], r["wrapper"]) for r in rows if r["wrapper"]]
    if wrappers:
        lines += ["", "wrapper cost: dist.all_reduce through the backend vs comm.allreduce"]
        for ranks, w in wrappers:
            for nbytes, m in w.items():
                through, direct = m["through_s"] * 1e6, m["direct_s"] * 1e6
                lines.append(f"  {ranks} ranks, {int(nbytes) >> 10:>6} KiB: through "
                             f"{through:9.1f} us, direct {direct:9.1f} us: "
                             f"{through / direct:.2f}x, +{through - direct:.1f} us")  # fmt: skip
    return "\n".join(lines)


def _plot(path: str, rows: list[dict[str, Any]]) -> None:
    plt = harness.pyplot()
    labels = [f"{r['setting']}\n{r['ranks']} ranks" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    xs = range(len(rows))
    bars = ((-0.2, "gloo", "DDP over Gloo"), (0.2, "asyncreduce", "DDP over asyncreduce"))
    for offset, key, name in bars:
        ax.bar([x + offset for x in xs], [r["exposed_s"][key] * 1e3 for r in rows], 0.4,
               label=name)  # fmt: skip
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("exposed communication per step (ms)")
    ax.set_title("What DDP cannot hide: step time minus the step without communication")
    ax.legend()
    harness.save_figure(plt, fig, Path(path))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="ranks on one host (comma list; '' for none)")
    p.add_argument("--hosts", default="", help="emulated hosts, e.g. 2,4 (root only)")
    p.add_argument("--rates", default="1gbit,10gbit", help="link rates for --hosts")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round and variant")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--limit", type=float, default=900, help="seconds a setting may take")
    p.add_argument("--quick", action="store_true", help="a smoke run: small model, few steps")
    p.add_argument("--json", help="write the rows as JSON here")
    p.add_argument("--plot", help="write a PNG of the exposed times here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--wrapper", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.quick:
        args.width, args.depth, args.steps, args.rounds, args.warmup = 256, 2, 3, 1, 1
    rows = []
    for ranks in [int(n) for n in args.ranks.split(",") if n]:
        rows.append(_row("1 host", ranks, _one_host(args, ranks)))
        print(_table(rows[-1:]), flush=True)
    for hosts in [int(n) for n in args.hosts.split(",") if n]:
        if os.geteuid() != 0:
            print("--hosts needs root (network namespaces)", file=sys.stderr)
            return 2
        for rate in [r for r in args.rates.split(",") if r]:
            rows.append(_row(f"hosts @ {rate}", hosts, _hosts(args, hosts, rate)))
            print(_table(rows[-1:]), flush=True)
    print()
    print(f"DDP over asyncreduce vs Gloo; MLP {args.depth}x{args.width}, batch {args.batch}; "
          f"{os.cpu_count()} cores")  # fmt: skip
    print(_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
    if args.plot:
        _plot(args.plot, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
