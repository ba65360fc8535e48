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

Needs root, ``ip`` and ``tc``. Run it as ``asyncreduce bench scaling [options]`` or
``python benchmarks/scaling.py``; ``--quick`` is a smoke run (1 and 2 hosts, faster link and
less compute in the same ratio, few iterations).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncreduce.argtypes import positive_float, positive_int

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # the harness and scaling_models.py, next to this file
import harness  # noqa: E402

cluster: Any = harness.load_module(
    "asyncreduce_scripts.cluster", _HERE.parent / "scripts/cluster.py"
)

__all__ = ["METHODS", "MODELS", "main", "ring_bytes"]

MODES = ("blocking", "backward", "forward", "double_buffer")  # asyncreduce.torch.DataParallel
METHODS = (*MODES, "ddp", "local")
MODELS = ("resnet50", "cnn")
DEFAULT_HOSTS, QUICK_HOSTS = (1, 2, 4), (1, 2)
DEFAULT_RATE, QUICK_RATE = "1gbit", "4gbit"  # quick: 4x the rate, so 1/4 of the compute
REFERENCE_HOSTS = 4  # where blocking communication is --ratio of compute, as in the issue
DEFAULT_RATIO = 0.5  # the seed: 66.7% = 1 / (1 + 0.5)
TCP_SHARE = 0.95  # TCP payload over the tbf rate at MTU 1500 (docs/cluster.md)
DEFAULT_WARMUP, QUICK_WARMUP = 2, 1
DEFAULT_ITERATIONS, QUICK_ITERATIONS = 3, 1
CNN_ITERATIONS = 3  # the cnn's iterations are ~10x shorter: this many times --iterations
DEFAULT_CNN_BATCH = 16
DEFAULT_TCP_S, QUICK_TCP_S = 1.0, 0.5
ASYNCREDUCE_PORT, GLOO_PORT = 29500, 29600  # rank 0's stores (the hosts are private)
LR = 0.01
TARGET = 0.95  # the target for forward mode
SEED = {"blocking": 0.6672, "forward": 0.924}  # ResNet-50, 16 nodes, 10 GbE
_SET_UP_S = 30.0  # per (model, method): wrapping broadcasts the parameters, DDP too
_SAY = "scaling bench: "


# ---- model sizes and the link --------------------------------------------------------------------


def resnet50_bytes() -> int:
    """float32 bytes of ResNet-50's gradients: what one allreduce of model A carries."""
    import scaling_models

    return 4 * sum(layer.params for layer in scaling_models.resnet50_layers())


def ring_bytes(nbytes: int, hosts: int) -> float:
    """Bytes a ring allreduce sends (and receives) over each host's link: 2 (K-1)/K x size."""
    return 2 * (hosts - 1) / hosts * nbytes


def ideal_comm_s(nbytes: int, hosts: int, rate_bps: float) -> float:
    """Seconds of a ring allreduce of ``nbytes`` at the TCP payload ceiling of the link."""
    return ring_bytes(nbytes, hosts) * 8 / (TCP_SHARE * rate_bps)


def compute_for(rate_bps: float, ratio: float) -> float:
    """Model A's compute per iteration: blocking comm at K = 4 is ``ratio`` of it."""
    return ideal_comm_s(resnet50_bytes(), REFERENCE_HOSTS, rate_bps) / ratio


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
        return harness.worker_main(args, _worker)
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


# ---- the worker: one rank in one host ------------------------------------------------------------


def _join_gloo() -> harness.Rank:
    """Gloo (torch.distributed) with ``tcp://`` on host 0's address, for ddp."""
    for ours, mpi in (("RANK", "OMPI_COMM_WORLD_RANK"), ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")):
        if mpi in os.environ:  # started by mpirun (--backend mpi)
            os.environ[ours] = os.environ[mpi]
    return harness.GlooRank(init_method=f"tcp://{os.environ['MASTER_ADDR']}:{GLOO_PORT}")


@dataclass
class Trainer:
    """One (model, method) ready to train: ``step`` is one iteration, ``finish`` applies what is
    still in flight, ``stats`` is DataParallel's (None for ddp and local)."""

    step: Callable[[], None]
    finish: Callable[[], None]
    stats: Callable[[], dict[str, float]] | None = None
    timeline: Any = None


def _model(name: str, settings: dict[str, Any], rank: int) -> tuple[Any, Callable[[Any], Any]]:
    """The module (same initial parameters on every rank) and its loss as a function of the
    wrapper to call; the cnn's data differs per rank, as in data parallelism."""
    import torch

    import scaling_models

    torch.manual_seed(0)
    if name == "resnet50":
        module: Any = scaling_models.EmulatedResNet50(settings["compute_s"])
        x = module.example_input()
        return module, lambda model: model(x).sum()
    module = scaling_models.small_cnn()
    images, labels = scaling_models.cifar_batch(settings["cnn_batch"], seed=rank)
    loss = torch.nn.CrossEntropyLoss()
    return module, lambda model: loss(model(images), labels)


def _optimizer(model: str) -> Callable[[list[Any]], Any]:
    """Plain SGD for resnet50 (least real CPU work next to the emulated compute), SGD with
    momentum for the cnn (as it would be trained)."""
    import torch

    momentum = 0.0 if model == "resnet50" else 0.9
    return lambda params: torch.optim.SGD(params, lr=LR, momentum=momentum)


def _trainer(rank: Any, model: str, method: str, settings: dict[str, Any]) -> Trainer:
    import torch

    module, loss = _model(model, settings, rank.rank)
    factory = _optimizer(model)
    if method in ("local", "ddp"):
        wrapped = module
        if method == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(module)  # bucket_cap_mb=25
        optimizer = factory(list(wrapped.parameters()))

        def plain_step() -> None:
            loss(wrapped).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return Trainer(plain_step, lambda: None)
    import asyncreduce.torch as art
    from asyncreduce.trace import Timeline

    timeline = Timeline(rank.rank) if settings.get("trace") else None
    mode = method.split("@")[0]  # forward@mpi: forward mode over backend="mpi"
    dp = art.DataParallel(module, rank.comm, optimizer=factory, mode=mode, timeline=timeline)

    def dp_step() -> None:
        loss(dp).backward()
        dp.step()

    return Trainer(dp_step, dp.synchronize, dp.stats, timeline)


def _measure(rank: Any, trainer: Trainer, warmup: int, iterations: int) -> dict[str, Any]:
    """Warm up, time ``iterations`` steps (the slowest rank's), then apply what is in flight."""
    from scaling_models import SleepClock

    for _ in range(warmup):
        trainer.step()
    before = trainer.stats() if trainer.stats else None
    times, late = [], SleepClock.late()
    start = time.perf_counter()
    for _ in range(iterations):
        began = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - began)
    mine = time.perf_counter() - start
    late = SleepClock.late() - late
    after = trainer.stats() if trainer.stats else None
    trainer.finish()
    result: dict[str, Any] = {
        "iterations": iterations,
        "warmup": warmup,
        "seconds": rank.max(mine),
        "iteration_s": [round(t, 4) for t in times],  # rank 0's
        "late_s": late / iterations,  # rank 0's emulated sleeps' overrun per iteration
    }
    if before is not None and after is not None:
        result.update(_hidden(before, after, iterations))
    return result


def _hidden(before: dict[str, float], after: dict[str, float], iterations: int) -> dict[str, Any]:
    """Exposed and communication time per iteration, and the hidden share, of the timed part."""
    exposed = after["exposed_s"] - before["exposed_s"]
    comm = after["comm_s"] - before["comm_s"]
    return {
        "exposed_s": exposed / iterations,
        "comm_s": comm / iterations,
        "hidden_share": min(1.0, max(0.0, 1.0 - exposed / comm)) if comm > 0 else None,
    }


def _worker(rank: harness.Rank, settings: dict[str, Any], tell: harness.Tell) -> None:
    """Every (model, method) in turn, each on a fresh model: asyncreduce's methods (and local)
    over ``rank``, ddp over a Gloo process group joined next to it (idle while the other runs)."""
    import torch

    torch.set_num_threads(1)  # one rank per host, and the hosts share this machine's cores
    gloo = _join_gloo() if "ddp" in settings["methods"] else None
    over_mpi = harness.AsyncReduceRank("mpi") if settings.get("backend") == "mpi" else None
    try:
        for model in settings["models"]:
            for method in settings["methods"]:
                _run_one(gloo if method == "ddp" else rank, model, method, settings, tell)
                if over_mpi is not None and method in MODES:
                    _run_one(over_mpi, model, f"{method}@mpi", settings, tell)
    finally:
        if over_mpi is not None:
            over_mpi.close()
        if gloo is not None:
            gloo.close()


def _run_one(
    rank: Any, model: str, method: str, settings: dict[str, Any], tell: harness.Tell
) -> None:
    """Build, warm up and time one (model, method); rank 0 reports the result."""
    tell("start", step=f"{model} {method}")
    n = settings["iterations"] * (CNN_ITERATIONS if model == "cnn" else 1)
    began = time.perf_counter()
    trainer = _trainer(rank, model, method, settings)
    set_up = time.perf_counter() - began
    result = _measure(rank, trainer, settings["warmup"], n)
    tell("result", model=model, method=method, set_up_s=round(set_up, 2), **result)
    _write_trace(trainer, settings, model, method, rank)
    del trainer
    gc.collect()


def _write_trace(
    trainer: Trainer, settings: dict[str, Any], model: str, method: str, rank: Any
) -> None:
    if trainer.timeline is not None and settings.get("trace"):
        name = f"{model}-{method}-K{rank.size}-rank{rank.rank}.json"
        trainer.timeline.write(os.path.join(settings["trace"], name))


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


def _run_set(c: Any, settings: Settings, run: harness.Run, progress: Any) -> None:
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
    started, load_before = time.monotonic(), round(os.getloadavg()[0], 2)
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
    machine["load_1min"] = {"before": load_before, "after": round(os.getloadavg()[0], 2)}
    return harness.finish(
        report(run, machine), elapsed, interrupted, bool(run.failures),
        args.json, lambda path: harness.write_json(path, run, machine, argv, elapsed, summary(run)),
        args.plot if run.results else None, lambda path: plot(path, run),
    )  # fmt: skip


def _benchmark() -> harness.Benchmark:
    def no_spec(lib: str, n: int) -> harness.SetSpec:
        raise NotImplementedError("the scaling benchmark runs its sets in a cluster")

    return harness.Benchmark("scaling", Path(__file__), no_spec, report, summary, plot)


# ---- report --------------------------------------------------------------------------------------


def derive(run: harness.Run) -> list[dict[str, Any]]:
    """Each result with ``its`` (iterations per second), ``mean_iteration_s``, ``scaling`` (vs
    the same method on 1 host), ``vs_local`` (vs no communication at the same K) and, for
    resnet50, ``ideal`` (``ideal_scaling``); None where unknown."""
    its = {
        (r["model"], r["method"], r["hosts"]): r["iterations"] / r["seconds"] for r in run.results
    }
    rows = []
    for r in run.results:
        mine = its[(r["model"], r["method"], r["hosts"])]
        one = its.get((r["model"], r["method"], 1))
        local = its.get((r["model"], "local", r["hosts"]))
        ideal = ideal_scaling(run.settings, r["method"], r["hosts"])
        rows.append({
            **r,
            "its": mine,
            "mean_iteration_s": 1 / mine,
            "scaling": mine / one if one else None,
            "vs_local": mine / local if local else None,
            "ideal": ideal if r["model"] == "resnet50" else None,
        })  # fmt: skip
    return rows


def ideal_scaling(settings: dict[str, Any], method: str, hosts: int) -> float:
    """resnet50's scaling if only the link cost time (``scaling_models.ideal_period``): the
    ring allreduce at the TCP ceiling of the link, the emulated compute, the method's
    buckets and order, and no CPU cost at all."""
    import scaling_models

    method = method.split("@")[0]
    if hosts == 1 or method == "local":
        return 1.0
    per_byte = ring_bytes(1, hosts) * 8 / (TCP_SHARE * settings["rate_bps"])
    compute = float(settings["compute_s"])
    return compute / scaling_models.ideal_period(method, compute, per_byte)


def summary(run: harness.Run) -> dict[str, Any]:
    """``{model: {method: {K: scaling}}}``, and the measured blocking comm / compute ratio."""
    out: dict[str, Any] = {}
    for r in derive(run):
        per = out.setdefault(r["model"], {}).setdefault(r["method"], {})
        per[str(r["hosts"])] = None if r["scaling"] is None else round(r["scaling"], 4)
    return out


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _model_title(model: str, settings: dict[str, Any]) -> str:
    import scaling_models

    if model == "resnet50":
        layers = scaling_models.resnet50_layers()
        params = sum(layer.params for layer in layers)
        return (
            f"model resnet50: ResNet-50 emulated, {len(layers)} layers, "
            f"{sum(len(layer.shapes) for layer in layers)} tensors, {params / 1e6:.2f}M "
            f"parameters ({4 * params / 1e6:.1f} MB of float32 gradients per step); "
            f"{settings['compute_s']:.3f} s of compute per iteration (sleep, split by FLOPs: "
            "1/3 forward, 2/3 backward)"
        )
    params = sum(p.numel() for p in scaling_models.small_cnn().parameters())
    return (
        f"model cnn: 4 conv+BN+ReLU+pool blocks and 2 linear layers, {params / 1e6:.2f}M "
        f"parameters ({4 * params / 1e6:.1f} MB), batch {settings['cnn_batch']} of 3x32x32 per "
        "rank, real compute on one thread per rank"
    )


def _table(rows: list[dict[str, Any]]) -> str:
    headers = ["method", "hosts", "s/iter", "it/s", "scaling", "ideal", "vs local", "hidden",
               "exposed s/it", "comm s/it", "late s/it"]  # fmt: skip
    cells = []
    for r in rows:
        alone = r["hosts"] == 1  # nothing to communicate: hidden and comm mean nothing
        cells.append([
            r["method"], str(r["hosts"]), f"{r['mean_iteration_s']:.3f}", f"{r['its']:.3f}",
            _pct(r["scaling"]), _pct(r["ideal"]), _pct(r["vs_local"]),
            _pct(None if alone else r.get("hidden_share")),
            _seconds(None if alone else r.get("exposed_s")),
            _seconds(None if alone else r.get("comm_s")),
            _seconds(r.get("late_s")),
        ])  # fmt: skip
    return harness.render_table(headers, cells, left=1)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _link_lines(settings: dict[str, Any]) -> list[str]:
    nbytes = resnet50_bytes()
    ideal = [
        f"K={k} {ideal_comm_s(nbytes, k, settings['rate_bps']):.3f} s "
        f"({ideal_comm_s(nbytes, k, settings['rate_bps']) / settings['compute_s']:.2f}x compute)"
        for k in settings["hosts"]
        if k > 1
    ]
    return [
        f"links: {settings['rate']} each way per host (tc tbf both ends, MTU 1500); one rank "
        f"per host; resnet50's ring allreduce at {TCP_SHARE:.0%} of the link: "
        + (", ".join(ideal) or "(one host only)"),
        f"timing: {settings['warmup']} warm-up iteration(s), then {settings['iterations']} "
        f"timed (cnn: {CNN_ITERATIONS}x), slowest rank; scaling = it/s on K hosts / it/s of "
        "the same method on 1 host (weak scaling); vs local = / it/s with no communication "
        "at the same K; ideal = resnet50's scaling if only the link cost time; hidden = 1 - "
        "exposed / comm (DataParallel.stats()); late = how much rank 0's emulated "
        "sleeps overran (the training thread kept off the CPU or the GIL)"
        + ("; QUICK smoke run" if settings.get("quick") else ""),
        f"the seed (ResNet-50, 16 nodes, 10 GbE): blocking {SEED['blocking']:.1%}, layer-wise "
        f"{SEED['forward']:.1%}; the target here: forward >= {TARGET:.0%} and 10 points above ddp",
    ]


def _findings(rows: list[dict[str, Any]], model: str) -> list[str]:
    """The measured blocking comm/compute ratio and forward against blocking, DDP, target."""
    by = {(r["method"], r["hosts"]): r for r in rows}
    top = max((r["hosts"] for r in rows), default=1)
    lines = []
    if ("blocking", 1) in by and ("blocking", top) in by and top > 1:
        one, k = by[("blocking", 1)], by[("blocking", top)]
        ratio = (k["mean_iteration_s"] - one["mean_iteration_s"]) / one["mean_iteration_s"]
        lines.append(f"{model}: blocking at K={top} adds {ratio:.2f}x to the 1-host iteration "
                     f"(the seed's comm/compute: {DEFAULT_RATIO}x)")  # fmt: skip
    fwd, ddp = by.get(("forward", top)), by.get(("ddp", top))
    if fwd is not None and fwd["scaling"] is not None and top > 1:
        text = f"{model}: forward scales {fwd['scaling']:.1%} at K={top} (target {TARGET:.0%})"
        if ddp is not None and ddp["scaling"] is not None:
            text += f", {100 * (fwd['scaling'] - ddp['scaling']):+.1f} points vs ddp"
        if fwd["vs_local"] is not None:
            text += f"; {fwd['vs_local']:.1%} of local (no communication) at K={top}"
        lines.append(text)
    over = by.get(("forward@mpi", top))
    if over is not None and fwd is not None and over["scaling"] and fwd["scaling"] and top > 1:
        lines.append(f"{model}: forward over MPI scales {over['scaling']:.1%} at K={top}, "
                     f"forward over native {fwd['scaling']:.1%}")  # fmt: skip
    return lines


def _row_order(row: dict[str, Any]) -> tuple[int, str, int]:
    """Methods in METHODS' order, each over native before over MPI, then by hosts."""
    base, _, over = str(row["method"]).partition("@")
    return METHODS.index(base), over, row["hosts"]


def report(run: harness.Run, machine: dict[str, Any]) -> str:
    s = run.settings
    lines = harness.preamble(run, machine) + _link_lines(s)
    rows = derive(run)
    for model in s["models"]:
        mine = [r for r in rows if r["model"] == model]
        mine.sort(key=_row_order)
        lines += ["", _model_title(model, s)]
        lines += [_table(mine)] if mine else ["(no results)"]
        lines += _findings(mine, model)
    return "\n".join(lines)


def plot(path: Path, run: harness.Run) -> None:
    """Scaling efficiency vs hosts, one panel per model, one line per method; for resnet50
    also the ideal blocking curve, and the issue's 95% target."""
    plt = harness.pyplot()
    rows = derive(run)
    models = [m for m in run.settings["models"] if any(r["model"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        _plot_panel(ax, model, [r for r in rows if r["model"] == model], run.settings)
    s = run.settings
    fig.suptitle(
        f"weak scaling on emulated hosts: {s['warmup']} warm-up + {s['iterations']} timed "
        f"iteration(s) (cnn {CNN_ITERATIONS}x); resnet50 compute {s['compute_s']:.2f} s/iteration",
        fontsize="medium",
    )
    harness.save_figure(plt, fig, path)


def _plot_panel(ax: Any, model: str, rows: list[dict[str, Any]], settings: dict[str, Any]) -> None:
    for method in dict.fromkeys(r["method"] for r in rows):  # forward@mpi too, where run
        points = sorted(
            (r["hosts"], 100 * r["scaling"])
            for r in rows
            if r["method"] == method and r["scaling"] is not None
        )
        if points:
            style = "--" if method in ("ddp", "local") else "-"
            ax.plot(*zip(*points, strict=True), style, marker="o", label=method)
    if model == "resnet50":
        ideal = [100 * ideal_scaling(settings, "blocking", k) for k in settings["hosts"]]
        ax.plot(settings["hosts"], ideal, ":", color="black", label="blocking, link only")
    ax.axhline(100 * TARGET, color="grey", linestyle=":", linewidth=1)
    ax.set_xticks(settings["hosts"])
    ax.set_xlabel("hosts (one rank each)")
    ax.set_ylabel("scaling efficiency, % (it/s on K / on 1 host)")
    top = max((100 * r["scaling"] for r in rows if r["scaling"] is not None), default=0.0)
    ax.set_ylim(0, max(120.0, top + 10))
    ax.set_title(f"{model}, {settings['rate']} per host")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize="small", ncol=2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
