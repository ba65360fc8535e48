"""Scaling: data-parallel training on 1, 2 and 4 emulated hosts; blocking, overlapped and DDP.

Theory of operation
-------------------
The seed's experiment (ResNet-50, 16 nodes, 10 GbE) scaled at 66.7% when every gradient
allreduce was waited for after backward, and at 92.4% when each layer's allreduce was posted
during backward and waited for just before that layer's next forward. This benchmark repeats
it on one machine:

* **Hosts**: for every K of ``--hosts`` (default 1, 2, 4) ``scripts/cluster.py`` builds K
  network namespaces on one switch, each behind a full-duplex link shaped by ``tc tbf`` to
  ``--rate``; one rank runs per host and the ranks meet over the hosts' addresses.
* **Models** (``scaling_models.py``): ``resnet50``, ResNet-50's 161 parameter tensors (25.6M
  parameters) in 107 layers whose forward and backward *sleep* for a share of ``compute_s``
  proportional to each layer's FLOPs (so the link, not this machine's 2 cores, decides), and
  ``cnn``, a small CNN really computed on random CIFAR-sized batches.
* **Link and compute**: a ring allreduce moves ``2 (K-1) / K`` times the gradient bytes over
  each host's link, each way. ``compute_s`` is chosen so that, at K = 4 and ~95% of the link
  rate (the TCP payload ceiling of ``tbf`` at MTU 1500), the blocking allreduce takes
  ``--ratio`` (0.5) of it: the seed's 66.7% is ``1 / (1 + 0.5)``. At 1 Gbit/s that is 2.58 s.
* **Methods**: ``asyncreduce.torch.DataParallel`` in modes ``blocking``, ``backward``,
  ``forward`` and ``double_buffer``; PyTorch ``DistributedDataParallel`` over Gloo (``ddp``:
  ``init_process_group("gloo", init_method="tcp://<host 0>:PORT")``, default 25 MB buckets);
  and ``local``: the same training with no communication at all (what K hosts can do when
  nothing is shared, which also shows what sharing the 2 cores costs by itself).

For every K the parent starts one set of K workers, one per host (``harness.run_cluster_set``).
Each joins asyncreduce and, for ``ddp``, a Gloo process group next to it (the one not in use
stays idle), then runs every (model, method) in turn: build the model (same seed everywhere),
wrap it, ``--warmup`` untimed iterations, then ``--iterations`` timed ones. The time is the
slowest rank's, from the start of the first timed iteration to the end of the last
``step()``; gradients still in flight then (forward and double_buffer modes) are waited for
afterwards, untimed, just as the warm-up's last ones are waited for inside the first timed
iteration: a steady-state rate. Rank 0 reports JSON lines (``harness.MARK``); the cluster is
torn down after every K whatever happens.

What the report shows per (model, method, K):

* **scaling**: iterations/s on K hosts over iterations/s of the same method on 1 host (weak
  scaling: the batch per rank is fixed);
* **ideal** (resnet50): the scaling if only the link cost time, from the same layers, compute
  split, buckets and order (``scaling_models.ideal_period``): what the schedule allows;
* **vs local**: over ``local`` at the same K, which leaves out what the hosts lose by sharing
  this machine's CPU;
* **hidden**, **exposed**, **comm**: from ``DataParallel.stats()`` over the timed iterations
  (1 - time the training thread waited / time any allreduce was in flight);
* **late** (resnet50): how much the emulated sleeps overran on rank 0, i.e. how long the
  training thread, ready to run, could not (a busy CPU, or the GIL held by another thread).
* **where the time goes**, a second table (``scaling_usage``): CPU seconds per iteration of
  the training thread, asyncreduce's progress thread, the rest of the process and the whole
  process (mean over ranks), how long the training and the progress threads were ready to
  run and waited for a core (**ready**: more ranks than cores), all ranks' CPU as a share of
  the machine's cores, and the link's utilisation each way over the same timed window; every
  rank's totals are in the JSON.

One rank is ``scaling_rank.py``, the report ``scaling_report.py``, the terms they share with
this file (methods, ports, the link's arithmetic) ``scaling_setup.py``, the models
``scaling_models.py``.

Needs root, ``ip`` and ``tc``. Run it as ``asyncreduce bench scaling [options]`` or
``python benchmarks/scaling.py``; ``--quick`` is a smoke run (1 and 2 hosts, faster link and
less compute in the same ratio, few iterations).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncreduce.argtypes import positive_float, positive_int

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # the harness and scaling_*.py, next to this file
import harness  # noqa: E402
from scaling_rank import worker  # noqa: E402
from scaling_report import plot, report, summary  # noqa: E402
from scaling_setup import (  # noqa: E402
    ASYNCREDUCE_PORT,
    CNN_ITERATIONS,
    DEFAULT_RATIO,
    METHODS,
    MODELS,
    MODES,
    compute_for,
    ideal_comm_s,
    resnet50_bytes,
    ring_bytes,
)

cluster: Any = harness.load_module(
    "asyncreduce_scripts.cluster", _HERE.parent / "scripts/cluster.py"
)

__all__ = ["METHODS", "MODELS", "main", "ring_bytes"]

DEFAULT_HOSTS, QUICK_HOSTS = (1, 2, 4), (1, 2)
DEFAULT_RATE, QUICK_RATE = "1gbit", "4gbit"  # quick: 4x the rate, so 1/4 of the compute
DEFAULT_WARMUP, QUICK_WARMUP = 2, 1
DEFAULT_ITERATIONS, QUICK_ITERATIONS = 3, 1
DEFAULT_CNN_BATCH = 16
DEFAULT_TCP_S, QUICK_TCP_S = 1.0, 0.5
_SET_UP_S = 30.0  # per (model, method): wrapping broadcasts the parameters, DDP too
_SAY = "scaling bench: "


# ---- command line --------------------------------------------------------------------------------


def _hosts(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of host counts: {text!r}") from None
    if not values or values[0] < 1 or values[-1] > 16:
        raise argparse.ArgumentTypeError(f"host counts must be within 1..16, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncreduce bench scaling",
        description="Weak scaling of data-parallel training on emulated hosts (network "
        "namespaces, tbf-shaped links): asyncreduce.torch.DataParallel's modes against "
        "PyTorch DDP over Gloo. Needs root.",
        epilog="example: asyncreduce bench scaling --json results/scaling.json "
        "--plot docs/img/scaling.png",
    )
    _workload_options(parser)
    _run_options(parser)
    # the worker side: how the parent starts the ranks; not for people
    parser.add_argument("--worker", choices=("asyncreduce",), help=argparse.SUPPRESS)
    parser.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def _workload_options(parser: argparse.ArgumentParser) -> None:
    """What is measured: hosts, models, methods, link rate and compute."""
    add = parser.add_argument
    add("--hosts", type=_hosts, default=None, help="host counts (default 1,2,4; quick 1,2)")
    add("--models", type=harness.lib_list(MODELS, "models"), default=list(MODELS),
        help=f"of {','.join(MODELS)} (default both)")  # fmt: skip
    add("--methods", type=harness.lib_list(METHODS, "methods"), default=list(METHODS),
        help=f"of {','.join(METHODS)} (default all)")  # fmt: skip
    add("--rate", type=harness.checked(cluster.parse_rate), default=None,
        help=f"link rate (default {DEFAULT_RATE}; quick {QUICK_RATE})")  # fmt: skip
    add("--ratio", type=positive_float, default=DEFAULT_RATIO,
        help="blocking comm / compute at K=4: sets resnet50's compute (default 0.5)")  # fmt: skip
    add("--compute", type=positive_float, default=None, metavar="S",
        help="resnet50's compute per iteration, s (default: from --rate and --ratio)")  # fmt: skip
    add("--cnn-batch", type=positive_int, default=DEFAULT_CNN_BATCH, metavar="B",
        help=f"images per rank per cnn iteration (default {DEFAULT_CNN_BATCH})")  # fmt: skip
    add("--backend", choices=("native", "mpi"), default="native",
        help="mpi: one mpirun starts the ranks and every DataParallel mode runs twice, over "
        "native and over MPI (methods MODE@mpi), beside ddp, in the same run")  # fmt: skip


def _run_options(parser: argparse.ArgumentParser) -> None:
    """How long and what to write."""
    add = parser.add_argument
    add("--warmup", type=positive_int, default=None, metavar="W",
        help=f"untimed iterations (default {DEFAULT_WARMUP}; quick {QUICK_WARMUP})")  # fmt: skip
    add("--iterations", type=positive_int, default=None, metavar="N",
        help=f"timed resnet50 iterations (default {DEFAULT_ITERATIONS}; quick "
        f"{QUICK_ITERATIONS}); the cnn runs {CNN_ITERATIONS}x as many")  # fmt: skip
    add("--tcp-seconds", type=float, default=None, metavar="S",
        help="one TCP stream h0 -> h1 first, to check the link (0: skip)")  # fmt: skip
    add("--trace", type=Path, default=None, metavar="DIR",
        help="write each rank's timeline (Chrome trace JSON) per model, mode and K")  # fmt: skip
    add("--quick", action="store_true", help="smoke run: 1 and 2 hosts, 4x the rate and 1/4 "
        "of the compute, few iterations (~1-2 min)")  # fmt: skip
    add("--json", type=Path, metavar="PATH", help="write every result here")
    add("--plot", type=Path, metavar="PATH", help="PNG: scaling vs hosts (needs matplotlib)")
    add("--from-json", type=Path, metavar="PATH", help="run nothing: report a saved --json run")
    add("--timeout", type=positive_float, default=None, metavar="S",
        help="hard limit per worker set (default: scaled to the work)")  # fmt: skip


@dataclass(frozen=True)
class Settings:
    hosts: list[int]
    models: list[str]
    methods: list[str]
    rate: str
    rate_bps: float
    ratio: float
    compute_s: float  # resnet50's emulated compute per iteration
    cnn_batch: int
    warmup: int
    iterations: int  # resnet50's; the cnn runs CNN_ITERATIONS x as many
    tcp_seconds: float
    trace: str | None
    timeout: float | None
    quick: bool
    backend: str = "native"


def _settings(args: argparse.Namespace) -> Settings:
    quick = bool(args.quick)
    rate = args.rate or (QUICK_RATE if quick else DEFAULT_RATE)
    rate_bps = float(cluster.parse_rate(rate))
    tcp = args.tcp_seconds
    if tcp is None:
        tcp = QUICK_TCP_S if quick else DEFAULT_TCP_S
    return Settings(
        hosts=args.hosts or list(QUICK_HOSTS if quick else DEFAULT_HOSTS),
        models=args.models,
        methods=args.methods,
        rate=rate,
        rate_bps=rate_bps,
        ratio=args.ratio,
        compute_s=args.compute or compute_for(rate_bps, args.ratio),
        cnn_batch=args.cnn_batch,
        warmup=args.warmup or (QUICK_WARMUP if quick else DEFAULT_WARMUP),
        iterations=args.iterations or (QUICK_ITERATIONS if quick else DEFAULT_ITERATIONS),
        tcp_seconds=max(0.0, tcp),
        trace=None if args.trace is None else str(args.trace.resolve()),
        timeout=args.timeout,
        quick=quick,
        backend=args.backend,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one rank of it); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = harness.parse(_parser(), argv)
    if isinstance(args, int):
        return args
    if args.worker:
        return harness.worker_main(args, worker)
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        print(f"{_SAY}--plot needs matplotlib (pip install 'asyncreduce[plot]')", file=sys.stderr)
        return 2
    if args.from_json is not None:
        return harness.replay(_benchmark(), args.from_json, args.plot)
    why = cluster.available()
    if why:
        print(f"{_SAY}cannot emulate hosts here: {why}", file=sys.stderr)
        return 2
    return _parent(_settings(args), argv, args)


# ---- the parent: one cluster per K, one worker set in each --------------------------------------


def _expected_iteration_s(settings: Settings, model: str, hosts: int) -> float:
    """A generous guess of one iteration (for time limits only)."""
    if model == "cnn":
        return 1.0
    comm = ideal_comm_s(resnet50_bytes(), hosts, settings.rate_bps) if hosts > 1 else 0.0
    return 1.3 * settings.compute_s + 0.3 + comm


def _limit(settings: Settings, hosts: int) -> float:
    """Seconds one set may take: start-up, then ~3x the expected time of every method."""
    total = harness.STARTUP_S
    for model in settings.models:
        n = settings.warmup + settings.iterations * (CNN_ITERATIONS if model == "cnn" else 1)
        per = _expected_iteration_s(settings, model, hosts)
        runs = len(settings.methods) + (
            sum(m in MODES for m in settings.methods) if settings.backend == "mpi" else 0
        )
        total += runs * (_SET_UP_S + 3 * n * per)
    return settings.timeout or total


def _worker_argv(settings: Settings, limit: float) -> list[str]:
    return [
        sys.executable, str(Path(__file__).resolve()), "--worker", "asyncreduce",
        "--settings", json.dumps(asdict(settings)), "--parent-pid", str(os.getpid()),
        "--deadline", f"{limit + 30:.0f}",
    ]  # fmt: skip


def _run_set(c: harness.Hosts, settings: Settings, run: harness.Run, progress: Any) -> None:
    """The worker set of cluster ``c``; its results (or its failure) go to ``run``."""
    tag = f"[K={c.hosts}]"
    limit = _limit(settings, c.hosts)

    def take(message: dict[str, Any]) -> None:
        if message.get("event") == "start":
            progress.show(f"{tag} {message.get('step', '')} ...")
        elif message.get("event") == "result":
            fields = {k: v for k, v in message.items() if k != "event"}
            lib = "gloo" if fields.get("method") == "ddp" else "asyncreduce"
            if str(fields.get("method", "")).endswith("@mpi"):
                lib = "asyncreduce-mpi"
            run.results.append({"lib": lib, "hosts": c.hosts, "rate": settings.rate, **fields})

    def env(host: int) -> dict[str, str]:
        return {**harness.cluster_env(c, host, ASYNCREDUCE_PORT), "OMP_NUM_THREADS": "1"}

    argv, on = _worker_argv(settings, limit), None
    if settings.backend == "mpi":  # one mpirun in host 0 starts a rank in every host
        shared = {k: v for k, v in env(0).items() if k not in ("RANK", "ASYNCREDUCE_ADDR")}
        argv, on = harness.cluster_mpirun(c, argv, list(shared)), [0]
        env = lambda host: shared  # noqa: E731
    progress.show(f"{tag} starting {c.hosts} ranks (hard limit {limit:.0f} s) ...")
    started = time.monotonic()
    try:
        harness.run_cluster_set(c, argv, env, limit, take, on=on)
    except (harness.WorkerSetError, cluster.ClusterError) as exc:
        _failed(run, c.hosts, str(exc))
        progress.end(f"{tag} FAILED: {exc}")
        return
    took = time.monotonic() - started
    run.set_seconds[f"K={c.hosts}"] = round(took, 2)
    progress.end(f"{tag} done in {took:.1f} s")


def _link_check(c: Any, settings: Settings, run: harness.Run) -> None:
    if c.hosts < 2 or settings.tcp_seconds <= 0:
        return
    try:
        found = c.measure_tcp(0, 1, seconds=settings.tcp_seconds)
    except (cluster.ClusterError, OSError, ValueError) as exc:
        run.notes.append(f"link check at K={c.hosts} failed: {exc}")
        return
    run.notes.append(
        f"link check K={c.hosts}: one TCP stream h0 -> h1 for {settings.tcp_seconds:g} s: "
        f"{found['bits_per_s'] / 1e9:.3f} Gbit/s = {found['share']:.1%} of {settings.rate}"
    )


def _run_hosts(hosts: int, settings: Settings, run: harness.Run, progress: Any) -> None:
    try:
        with cluster.Cluster(hosts, settings.rate) as c:
            _link_check(c, settings, run)
            _run_set(c, settings, run, progress)
    except cluster.ClusterError as exc:
        _failed(run, hosts, str(exc))
        progress.end(f"{_SAY}cluster of {hosts} failed: {exc}")


def _failed(run: harness.Run, hosts: int, error: str) -> None:
    """Record a failed K (``lib`` and ``nprocs`` as ``harness.preamble`` reports failures)."""
    run.failures.append({"lib": "all methods", "nprocs": hosts, "hosts": hosts, "error": error})


def _parent(settings: Settings, argv: Sequence[str], args: argparse.Namespace) -> int:
    started, load = time.monotonic(), harness.LoadWatch()
    run = harness.Run("scaling", asdict(settings))
    progress = harness.Progress()
    interrupted = False
    try:
        for hosts in settings.hosts:
            _run_hosts(hosts, settings, run, progress)
    except KeyboardInterrupt:  # the cluster is torn down already; report what we have
        interrupted = True
        progress.end(f"{_SAY}interrupted; partial results follow")
    elapsed = time.monotonic() - started
    machine = {**harness.machine_info(), "library": harness.library_state()}
    machine.update(load.ended())
    return harness.finish(
        report(run, machine), elapsed, interrupted, bool(run.failures),
        args.json, lambda path: harness.write_json(path, run, machine, argv, elapsed, summary(run)),
        args.plot if run.results else None, lambda path: plot(path, run),
    )  # fmt: skip


def _benchmark() -> harness.Benchmark:
    def no_spec(lib: str, n: int) -> harness.SetSpec:
        raise NotImplementedError("the scaling benchmark runs its sets in a cluster")

    return harness.Benchmark("scaling", Path(__file__), no_spec, report, summary, plot)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
