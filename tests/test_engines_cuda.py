"""CUDA tensors over backend="torch": handed to the group as they are (no host staging), ordered
after their producer by an event, and the caller's stream ordered after the result by ``wait``.
Skips without a GPU; scripts/gpu_check.sh runs it. Two ranks share GPU 0 over a Gloo group
(Gloo reduces CUDA tensors; NCCL refuses two ranks on one GPU), and over NCCL where there are
two GPUs. On CPU the same engine code is tested over Gloo by test_engines.py."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import asyncreduce as ar  # noqa: E402
from spmd import run_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _join(rank: int, n: int, port: int, backend: str) -> object:
    """Join the torch.distributed job of this test on this rank's GPU (GPU 0 for both, with one)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=n)
    return device


def _rank(rank: int, n: int, port: int, backend: str) -> tuple[float, float, list[float]]:
    device = _join(rank, n, port, backend)
    try:
        with ar.init(backend="torch") as comm:
            side = torch.cuda.Stream(device)
            with torch.cuda.stream(side):  # a producer on a stream of its own, still running
                x = torch.full((1 << 22,), float(rank + 1), device=device)
                for _ in range(20):
                    x.mul_(1.0)
                req = comm.iallreduce(x, op="avg", name="g")
                req.wait()  # orders `side` after the result: no CPU wait
                y = x * 2
            torch.cuda.synchronize(device)
            b = torch.arange(8.0, device=device) * (rank + 1)
            comm.broadcast(b, root=1, name="b")
            return float(y[0]), float(y[-1]), b.cpu().numpy().tolist()
    finally:
        dist.destroy_process_group()


def _two_ranks(target: Callable[..., Any], backend: str, timeout: float) -> list[Any]:
    """``target(rank, 2, port, backend)`` in two spawned processes; what each returned, by
    rank. A rank that raises fails the test with its traceback, and one that dies (a crash in
    CUDA, NCCL or the engine) fails it at once with its exit code, not after ``timeout``."""
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per rank")
    got = run_ranks(2, target, backend, timeout=timeout, daemon=False, connect=False)
    return [got[r] for r in sorted(got)]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_cuda_tensors_go_to_the_group_ordered_by_events(backend: str) -> None:
    got = _two_ranks(_rank, backend, 120)
    for first, last, b in got:
        assert first == last == 3.0  # avg of 1 and 2, times 2
        assert b == (np.arange(8.0) * 2).tolist()


def _dp_rank(rank: int, n: int, port: int, backend: str) -> dict[str, float]:
    """DataParallel in every mode on CUDA parameters over backend="torch": each rank trains its
    half of a batch; the result must be what one process gets on the whole batch."""
    import asyncreduce.torch as art

    device = _join(rank, n, port, backend)
    try:
        with ar.init(backend="torch") as comm:
            finals = {}
            for mode in ("blocking", "backward", "forward"):
                torch.manual_seed(0)
                model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                            torch.nn.Linear(16, 2)).double().to(device)  # fmt: skip
                reference = [p.detach().clone() for p in model.parameters()]
                dp = art.DataParallel(model, comm, lambda ps: torch.optim.SGD(ps, lr=0.1), mode)
                gen = torch.Generator().manual_seed(1)
                for _ in range(5):
                    x = torch.randn(8, 8, generator=gen, dtype=torch.float64)
                    y = torch.randn(8, 2, generator=gen, dtype=torch.float64)
                    mine = slice(4 * rank, 4 * rank + 4)
                    out_ = dp(x[mine].to(device))
                    torch.nn.functional.mse_loss(out_, y[mine].to(device)).backward()
                    dp.step()
                dp.synchronize()
                finals[mode] = [p.detach().cpu() for p in model.parameters()]
                dp.close()
                ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                          torch.nn.Linear(16, 2)).double()  # fmt: skip
                with torch.no_grad():
                    for p, r in zip(ref.parameters(), reference, strict=True):
                        p.copy_(r.cpu())
                opt = torch.optim.SGD(ref.parameters(), lr=0.1)
                gen = torch.Generator().manual_seed(1)
                for _ in range(5):
                    x = torch.randn(8, 8, generator=gen, dtype=torch.float64)
                    y = torch.randn(8, 2, generator=gen, dtype=torch.float64)
                    torch.nn.functional.mse_loss(ref(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                pairs = zip(finals[mode], ref.parameters(), strict=True)
                finals[mode] = max(float((a - b).abs().max()) for a, b in pairs)
            return finals
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_data_parallel_on_cuda_over_the_torch_backend_is_exact(backend: str) -> None:
    got = _two_ranks(_dp_rank, backend, 180)
    for diffs in got:
        assert all(d < 1e-10 for d in diffs.values()), diffs
