"""Mixed precision as GPU users train: autocast and torch.amp.GradScaler against DDP over Gloo.

On 2 real ranks (processes over real sockets), in the same processes, the same loop drives
DDP over a Gloo process group and our wrapper over an asyncreduce communicator, on the same
data: ``autocast`` (bfloat16 on the CPU), ``scaler.scale(loss).backward()``,
``scaler.unscale_(optimizer)``, ``clip_grad_norm_``, ``scaler.step(optimizer)``,
``scaler.update()``. In the exact modes (blocking, backward) ``p.grad`` holds the average when
``backward()`` returns, so the scaler sees what it sees under DDP: parameters, the scale after
every step and the clipped norms must be bitwise DDP's. They can be: with 2 ranks the average
is one addition and a division by 2 (DDP multiplies each gradient by 1/2 before its sum),
exact and alike unless a gradient is subnormal, and every other operation runs on the same
values in the same order. An inf in one rank's loss at one step must make every rank skip
that step (the inf is in the average) and back the scale off, as under DDP. A fused optimizer
takes the scaler's scale and inf flag through ``model.optimizer`` (the fused path).

Where updates are applied after ``step()`` (forward, double_buffer) ``p.grad`` is this rank's
own gradient: the scaler would unscale and check it, not the average applied later, so
``scaler.step`` is refused with a UsageError naming the mode and the fix, on every rank,
before any parameter changed: also after ``unscale_`` and clipping, and where one rank's own
gradient holds an inf (that rank's scaler would skip the step alone). bfloat16 autocast
without a scaler (``GradScaler(enabled=False)``, the ``enabled=use_amp`` habit) trains in
forward mode as under DDP.

All scenarios run in one ``run_ranks`` call (process start-up and ``import torch`` cost
seconds) and are cached for the tests that check them. The CUDA variant (fp16 and bf16,
``GradScaler("cuda")``, 2 ranks on one GPU if there is only one) skips without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import asyncreduce as ar  # noqa: E402
import asyncreduce.torch as art  # noqa: E402
from spmd import free_port, run_ranks  # noqa: E402
from test_torch_ddp import run_scenarios  # noqa: E402

pytestmark = [pytest.mark.torch]

WORLD = 2
PER_RANK = 4
STEPS = 6
INF_AT = 2  # the step whose loss is inf on rank 1 (skip scenarios)
CLIP = 0.5  # below the unscaled gradients' norm here, so clipping changes the gradients
EXACT = ("blocking", "backward")
LATER = ("forward", "double_buffer")
REFUSALS = ("refuse-step", "refuse-unscale", "refuse-inf")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Net(nn.Module):
    """Linear layers (bfloat16 under autocast) around a LayerNorm (float32 under autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: Any) -> Any:
        return self.fc3(F.relu(self.fc2(self.norm(F.gelu(self.fc1(x))))))


def make_module(rank: int, device: Any = "cpu") -> nn.Module:
    """float32 parameters; each rank starts from other values: both wrappers broadcast rank 0's."""
    torch.manual_seed(500 + 13 * rank)
    return Net().to(device)


def make_optimizer(kind: str) -> Callable[[Any], Any]:
    if kind == "fused":  # takes the scaler's grad_scale and found_inf itself
        return lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True)
    return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def batch(step: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(6151 * (step + 1))
    n = WORLD * PER_RANK
    return torch.randn(n, 12, generator=g), torch.randint(0, 4, (n,), generator=g)


def flat(module: nn.Module) -> Any:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


class Loop:
    """What a scenario's loop does: "amp" (scaler with unscale_ and clipping), "skip" (the
    same, with an inf in rank 1's loss at step INF_AT), "fused" (a fused optimizer, the
    scaler unscales inside its step; inf at INF_AT too), "off" (autocast with a disabled
    scaler, the ``enabled=use_amp`` habit)."""

    def __init__(self, kind: str, dtype: Any = torch.bfloat16) -> None:
        self.kind = kind
        self.dtype = dtype
        self.clip = kind in ("amp", "skip")
        self.inf_at = INF_AT if kind in ("skip", "fused") else -1
        self.scaled = kind != "off"


def train(model: Any, optimizer: Any, loop: Loop, device: Any = "cpu") -> dict[str, Any]:
    """The GPU user's loop, the same for DDP and DataParallel; what each step did."""
    device = torch.device(device)
    rank = dist.get_rank()
    scaler = torch.amp.GradScaler(device.type, enabled=loop.scaled)
    scales, norms, moved = [], [], []
    for t in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(t)
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        x, y = x[rows].to(device), y[rows].to(device)
        with torch.autocast(device_type=device.type, dtype=loop.dtype):
            loss = F.cross_entropy(model(x), y)
        if t == loop.inf_at and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if loop.clip:
            scaler.unscale_(optimizer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        before = flat(model)
        scaler.step(optimizer)
        scaler.update()
        moved.append(not torch.equal(before, flat(model)))
        scales.append(scaler.get_scale())
    if isinstance(model, art.DataParallel):
        model.synchronize()
    return {"params": flat(model).cpu().numpy(), "scales": scales, "norms": norms,
            "moved": moved}  # fmt: skip


def exact_run(comm: ar.Communicator, kind: str, mode: str, device: Any = "cpu",
              dtype: Any = torch.bfloat16) -> dict[str, Any]:  # fmt: skip
    """Ours in ``mode``, then DDP over Gloo, each trained the scenario's way."""
    loop, rank = Loop(kind, dtype), comm.rank
    model = art.DataParallel(make_module(rank, device), comm, mode=mode, bucket_bytes=2048,
                             optimizer=make_optimizer(kind))  # fmt: skip
    try:
        ours = train(model, model.optimizer, loop, device)
    finally:
        model.close()
    module = make_module(rank, device)
    ddp = DDP(module) if torch.device(device).type == "cpu" else DDP(module, device_ids=[device])
    ddp_optimizer = make_optimizer(kind)(ddp.parameters())
    return {"ours": ours, "ddp": train(ddp, ddp_optimizer, loop, device)}


def refused_run(comm: ar.Communicator, mode: str, first: str) -> dict[str, Any]:
    """The scaler's first step in ``mode`` ("step": at once; "unscale": after ``unscale_`` and
    clipping; "inf": rank 1's loss is inf, so its own gradient would make it skip the step
    alone): the error, and whether any parameter changed (also after ``synchronize()``)."""
    rank = comm.rank
    model = art.DataParallel(make_module(rank), comm, mode=mode,
                             optimizer=make_optimizer("sgd"))  # fmt: skip
    try:
        scaler = torch.amp.GradScaler("cpu")
        before = flat(model)
        x, y = batch(0)
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x[rows]), y[rows])
        if first == "inf" and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if first == "unscale":
            scaler.unscale_(model.optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        refused = None
        try:
            scaler.step(model.optimizer)
        except ar.UsageError as exc:
            refused = str(exc)
        unchanged = torch.equal(before, flat(model))
        model.synchronize()
        return {"refused": refused, "unchanged": unchanged,
                "unchanged_after_sync": torch.equal(before, flat(model))}  # fmt: skip
    finally:
        model.close()


def run_one(comm: ar.Communicator, key: str) -> dict[str, Any]:
    kind, mode = key.split("/")
    if kind.startswith("refuse-"):
        return refused_run(comm, mode, kind.split("-")[1])
    return exact_run(comm, kind, mode)


def body(comm: ar.Communicator, gloo_port: int, keys: list[str]) -> dict[str, dict[str, Any]]:
    return run_scenarios(comm, gloo_port, keys, run_one)


KEYS = [f"{kind}/{mode}" for kind in ("amp", "skip") for mode in EXACT]
KEYS += ["fused/backward", "off/forward"]
KEYS += [f"{kind}/{mode}" for kind in REFUSALS for mode in LATER]
_CACHE: dict[str, Any] = {}


def group(name: str, run: Callable[[], dict[int, Any]]) -> dict[int, Any]:
    if name not in _CACHE:
        try:
            _CACHE[name] = run()
        except Exception as exc:  # noqa: BLE001 - re-raised for every test of the group
            _CACHE[name] = f"the {name} group failed:\n{exc}"
    found = _CACHE[name]
    if isinstance(found, str):
        pytest.fail(found, pytrace=False)
    return found


def reports(key: str) -> list[dict[str, Any]]:
    results = group("cpu", lambda: run_ranks(WORLD, body, free_port(), KEYS, timeout=120))
    got = [results[rank][key] for rank in range(WORLD)]
    for rank, report in enumerate(got):
        if "error" in report:
            pytest.fail(f"{key} raised on rank {rank}:\n{report['error']}", pytrace=False)
    return got


def assert_as_ddp(report: dict[str, Any], what: str) -> None:
    ours, ddp = report["ours"], report["ddp"]
    assert ours["scales"] == ddp["scales"], f"{what}: scales {ours['scales']} != {ddp['scales']}"
    assert ours["moved"] == ddp["moved"], f"{what}: steps taken {ours['moved']} != {ddp['moved']}"
    assert np.array_equal(ours["norms"], ddp["norms"], equal_nan=True), (
        f"{what}: clipped norms {ours['norms']} != {ddp['norms']}")  # fmt: skip
    diff = np.abs(ours["params"] - ddp["params"]).max()
    assert ours["params"].tobytes() == ddp["params"].tobytes(), f"{what}: {diff:.3g} off DDP's"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", EXACT)
def test_grad_scaler_with_unscale_and_clipping_ends_bitwise_where_ddp_ends(mode: str) -> None:
    got = reports(f"amp/{mode}")
    for rank, report in enumerate(got):
        assert_as_ddp(report, f"rank {rank}, {mode}")
        ours = report["ours"]
        assert all(ours["moved"]), f"rank {rank}: a step was skipped: {ours['moved']}"
        assert max(ours["norms"]) > CLIP, f"rank {rank}: clipping never clipped {ours['norms']}"
        assert ours["scales"] == [65536.0] * STEPS, ours["scales"]  # no inf: never backed off
    assert got[0]["ours"]["params"].tobytes() == got[1]["ours"]["params"].tobytes()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", EXACT)
def test_an_inf_on_one_rank_skips_that_step_on_every_rank_as_under_ddp(mode: str) -> None:
    got = reports(f"skip/{mode}")
    for rank, report in enumerate(got):
        assert_as_ddp(report, f"rank {rank}, {mode}")
        ours = report["ours"]
        want = [t != INF_AT for t in range(STEPS)]
        assert ours["moved"] == want, f"rank {rank}: steps taken {ours['moved']}, want {want}"
        assert ours["scales"][INF_AT] == ours["scales"][INF_AT - 1] / 2, ours["scales"]
        assert not np.isfinite(ours["norms"][INF_AT]), f"rank {rank}: {ours['norms']}"
    assert got[0]["ours"]["params"].tobytes() == got[1]["ours"]["params"].tobytes()


@pytest.mark.timeout(180)
def test_fused_optimizer_takes_the_scale_and_the_inf_flag_as_under_ddp() -> None:
    got = reports("fused/backward")
    for rank, report in enumerate(got):
        assert_as_ddp(report, f"rank {rank}")
        want = [t != INF_AT for t in range(STEPS)]
        assert report["ours"]["moved"] == want, f"rank {rank}: {report['ours']['moved']}"
    assert got[0]["ours"]["params"].tobytes() == got[1]["ours"]["params"].tobytes()


@pytest.mark.timeout(180)
def test_autocast_with_a_disabled_scaler_in_forward_mode_ends_where_ddp_ends() -> None:
    got = reports("off/forward")
    for rank, report in enumerate(got):
        ours, ddp = report["ours"], report["ddp"]
        assert ours["scales"] == [1.0] * STEPS  # a disabled scaler's
        assert ours["params"].tobytes() == ddp["params"].tobytes(), f"rank {rank}"
    assert got[0]["ours"]["params"].tobytes() == got[1]["ours"]["params"].tobytes()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("first", REFUSALS)
@pytest.mark.parametrize("mode", LATER)
def test_grad_scaler_is_refused_where_updates_are_applied_later(mode: str, first: str) -> None:
    for rank, report in enumerate(reports(f"{first}/{mode}")):
        message = report["refused"]
        assert message is not None, f"rank {rank}: GradScaler in {mode} was not refused"
        assert f"mode={mode!r}" in message and "GradScaler" in message, message
        assert "mode='backward'" in message and "mode='blocking'" in message, message
        assert report["unchanged"] and report["unchanged_after_sync"], f"rank {rank}: {report}"


# ---- CUDA: fp16 and bf16 autocast with GradScaler("cuda"), 2 ranks (on one GPU if one) ------


def body_cuda(comm: ar.Communicator, gloo_port: int) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    device = torch.device("cuda", comm.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}",
                            rank=comm.rank, world_size=comm.world_size)  # fmt: skip
    try:
        return {f"{kind}/{mode}/{name}": exact_run(comm, kind, mode, device, dtype)
                for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16))
                for kind in ("amp", "skip") for mode in EXACT}  # fmt: skip
    finally:
        dist.destroy_process_group()


@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["amp", "skip"])
@pytest.mark.parametrize("mode", EXACT)
def test_cuda_grad_scaler_in_exact_modes_ends_where_ddp_ends(
    mode: str, kind: str, dtype: str
) -> None:
    results = group("cuda", lambda: run_ranks(WORLD, body_cuda, free_port(), timeout=240))
    got = [results[rank][f"{kind}/{mode}/{dtype}"] for rank in range(WORLD)]
    for rank, report in enumerate(got):
        ours, ddp = report["ours"], report["ddp"]
        assert ours["scales"] == ddp["scales"] and ours["moved"] == ddp["moved"], (rank, report)
        if kind == "skip":  # an overflow of fp16 may skip another step too: alike under DDP
            assert not ours["moved"][INF_AT], f"rank {rank}: the inf step was taken"
        # GPU kernels may pick other reduction orders than the CPU's: a tight tolerance
        np.testing.assert_allclose(ours["params"], ddp["params"], rtol=0, atol=1e-6)
    assert got[0]["ours"]["params"].tobytes() == got[1]["ours"]["params"].tobytes()
