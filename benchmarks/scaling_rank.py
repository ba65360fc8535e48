"""One rank of the scaling benchmark, in one emulated host: every (model, method) in turn.

``worker`` is the body ``harness.worker_main`` runs: for each model and method it builds the
model (the same seed everywhere), wraps it (``asyncreduce.torch.DataParallel`` in one of its
modes, PyTorch DDP over a Gloo group joined next to asyncreduce, or nothing for ``local``),
runs ``--warmup`` untimed iterations and then the timed ones, and reports the slowest rank's
time with DataParallel's stats of the timed part (``_measure``) and every rank's CPU and link
bytes over the same window (``scaling_usage``, gathered to every rank by ``rank.gather``).
torch and ``scaling_models`` are imported only here, inside the functions, so the parent's
``--help`` needs neither.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness, next to this file
import harness  # noqa: E402
from scaling_setup import CNN_ITERATIONS, GLOO_PORT, MODES  # noqa: E402
from scaling_usage import USAGE_FIELDS, Usage, window  # noqa: E402

__all__ = ["Trainer", "worker"]

LR = 0.01


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
    """Warm up, time ``iterations`` steps (the slowest rank's), then apply what is in flight;
    every rank's CPU and link bytes over the timed steps go into ``usage``."""
    from scaling_models import SleepClock

    for _ in range(warmup):
        trainer.step()
    before = trainer.stats() if trainer.stats else None
    times, late = [], SleepClock.late()
    used = Usage.now()
    start = time.perf_counter()
    for _ in range(iterations):
        began = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - began)
    mine = time.perf_counter() - start
    used_window = window(used, Usage.now())
    late = SleepClock.late() - late
    after = trainer.stats() if trainer.stats else None
    trainer.finish()
    result: dict[str, Any] = {
        "iterations": iterations,
        "warmup": warmup,
        "seconds": rank.max(mine),
        "iteration_s": [round(t, 4) for t in times],  # rank 0's
        "late_s": late / iterations,  # rank 0's emulated sleeps' overrun per iteration
        "usage": _usage(rank, used_window),
    }
    if before is not None and after is not None:
        result.update(_hidden(before, after, iterations))
    return result


def _usage(rank: Any, mine: dict[str, float]) -> dict[str, Any]:
    """``{field: [rank 0's, rank 1's, ...]}`` of ``scaling_usage.window``'s totals over the
    timed window (CPU seconds, link bytes, the window's seconds), and this machine's CPUs."""
    rows = rank.gather([mine[field] for field in USAGE_FIELDS])
    per_rank = {field: [row[i] for row in rows] for i, field in enumerate(USAGE_FIELDS)}
    return {**per_rank, "cpus": os.cpu_count()}


def _hidden(before: dict[str, float], after: dict[str, float], iterations: int) -> dict[str, Any]:
    """Exposed and communication time per iteration, and the hidden share, of the timed part."""
    exposed = after["exposed_s"] - before["exposed_s"]
    comm = after["comm_s"] - before["comm_s"]
    return {
        "exposed_s": exposed / iterations,
        "comm_s": comm / iterations,
        "hidden_share": min(1.0, max(0.0, 1.0 - exposed / comm)) if comm > 0 else None,
    }


def worker(rank: harness.Rank, settings: dict[str, Any], tell: harness.Tell) -> None:
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
