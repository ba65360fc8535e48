"""The staged-allreduce rows of ``bench gpu``: what one staged allreduce costs, and its parts.

For every size, on one float32 tensor on the device (the stand-in's: a CPU tensor) and a pinned
host tensor of the same size, in interleaved repetitions (each after a barrier; the first is
a warm-up), each rank times:

* ``d2h``: the copy device -> pinned host, through the ``Device`` of staging (its stream, then
  waited for);
* ``h2d``: the copy pinned host -> device, the same way;
* ``ours_host``: our allreduce of the pinned host tensor (``comm.allreduce``);
* ``ours_staged``: our allreduce of the device tensor (``asyncreduce.torch.iallreduce``,
  staged and pipelined in chunks), waited for, the device drained;
* ``gloo``: Gloo's ``all_reduce`` of the same device tensor, the device drained.

The tensors hold zeros, so repeated sums change nothing. A kind that fails on any rank is
reported with its error and left out of the later repetitions. Each kind's figure is the
slowest rank's median, in ms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["KINDS", "KIND_LABELS", "staged_rows"]

KINDS = ("d2h", "h2d", "ours_host", "ours_staged", "gloo")
KIND_LABELS = {
    "d2h": "D2H to pinned",
    "h2d": "H2D from pinned",
    "ours_host": "ours, pinned host tensor",
    "ours_staged": "ours, device tensor (staged)",
    "gloo": "Gloo, device tensor",
}


def staged_rows(env: Any, guard: Callable[[int], AbstractContextManager[None]]) -> None:
    """Every size of ``env.settings["sizes"]``, each under ``guard(size)``; rank 0 tells."""
    for size in env.settings["sizes"]:
        with guard(size):
            result = _one_size(env, size)
        env.tell("staged", **result)


def _ops(env: Any, size: int) -> dict[str, Callable[[int], None]]:
    """The five operations on one device tensor and one pinned host tensor of ``size``."""
    import torch
    import torch.distributed as dist

    import asyncreduce.torch as art
    from asyncreduce.torch.device import CudaDevice

    dev = env.standin if env.standin is not None else CudaDevice(env.device)
    n = size // 4
    tensor = torch.zeros(n, device=env.device)
    host = dev.host_buffer(n, torch.float32)
    host.zero_()
    stream = dev.new_stream()

    def d2h(_: int) -> None:
        dev.to_host(host, tensor, stream)
        dev.synchronize(dev.record(stream))

    def h2d(_: int) -> None:
        dev.to_device(tensor, host, stream)
        dev.synchronize(dev.record(stream))

    def staged(rep: int) -> None:
        art.iallreduce(env.comm, tensor, name=f"bench-gpu-staged-{size}-{rep}").wait()
        env.sync_device()

    def gloo(_: int) -> None:
        dist.all_reduce(tensor)
        env.sync_device()

    return {"d2h": d2h, "h2d": h2d, "ours_host": lambda _: env.comm.allreduce(host),
            "ours_staged": staged, "gloo": gloo}  # fmt: skip


def _one_size(env: Any, size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from gpu_setup import agree, error_text

    ops = _ops(env, size)
    reps = int(env.settings["reps"][str(size)])
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    errors: dict[str, str] = {}
    for rep in range(reps + 1):  # the first one warms up
        for kind in KINDS:
            if kind in errors:
                continue
            dist.barrier()
            error = None
            try:
                started = time.perf_counter()
                ops[kind](rep)
                took = time.perf_counter() - started
            except Exception as exc:  # noqa: BLE001 - reported for this kind, the others go on
                error = error_text(exc)
            error = agree(error)
            if error is not None:
                errors[kind] = error
            elif rep:
                times[kind].append(took)
    mine = [statistics.median(times[k]) if k not in errors else 0.0 for k in KINDS]
    slowest = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    ms = {k: (None if k in errors else round(v * 1e3, 4))
          for k, v in zip(KINDS, slowest.tolist(), strict=True)}  # fmt: skip
    return {"bytes": size, "ms": ms, "errors": errors, "reps": reps}
