"""asyncreduce.torch.DataParallel against PyTorch's DDP over Gloo, in the same processes.

A DDP user's habits, ported as they are: a CNN with BatchNorm, SGD with momentum and Adam, a
StepLR and a LambdaLR, ``clip_grad_norm_``, accumulation with and without ``no_sync``, a
DataLoader with forked workers and a DistributedSampler, checkpoints and resume. On every rank
the same loop (``train`` below, one function for both) drives a DDP model over a Gloo process
group and our wrapper over an asyncreduce communicator, on the same data, and the two must
end within 1e-6 (parameters and buffers) after 10 steps in every exact mode. ``double_buffer``
is compared with DDP whose gradients are applied one step late (the same loop, with the
gradients of each step held back for the next). Clipping in forward and double_buffer mode
must raise UsageError naming a parameter. The loop also runs under ``warnings.catch_warnings``:
no "lr_scheduler.step() before optimizer.step()" may appear.

As in test_torch_dp.py, the scenarios of a world size run in one ``run_ranks`` call (process
start-up and ``import torch`` cost seconds) and are cached for the tests that check them.
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
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

pytestmark = [pytest.mark.torch]

STEPS = 10
PER_RANK = 4
ATOL = 1e-6
EXACT = ("blocking", "backward", "forward")
MODES = (*EXACT, "double_buffer")
CLIP = 0.05  # well below the gradients' norm here, so clipping changes every step


class BNNet(nn.Module):
    """Convolutions with BatchNorm (running statistics are buffers), then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6 * 2 * 2, 3)

    def forward(self, x: Any) -> Any:
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = F.max_pool2d(F.relu(self.bn2(self.conv2(h))), 2)
        return self.fc(h.flatten(1))


def make_model(rank: int) -> nn.Module:
    """Each rank starts from different values: both wrappers must broadcast rank 0's."""
    torch.manual_seed(100 + 17 * rank)
    return BNNet().double()


def make_optimizer(kind: str) -> Callable[[Any], Any]:
    if kind == "adam":
        return lambda ps: torch.optim.Adam(ps, lr=0.01)
    return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def make_scheduler(kind: str, optimizer: Any) -> Any:
    if kind == "adam":  # LambdaLR [1, 0, 0.5, 1, ...]: a late schedule loses the first update
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: [1.0, 0.0, 0.5, 1.0][e % 4])
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def batch(world: int, step: int, micro: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(7919 * step + 104_729 * micro + 1)
    n = world * PER_RANK
    x = torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=g)


def shard(t: Any, rank: int) -> Any:
    return t[rank * PER_RANK : (rank + 1) * PER_RANK]


class Habits:
    """What a scenario's loop does, parsed from its key: optimizer/schedule, accumulation
    ("acc": two backward passes a step, "nosync": the first inside no_sync), clipping."""

    def __init__(self, key: str) -> None:
        parts = key.split("/")
        self.optimizer = "adam" if "adam" in parts else "sgd"
        self.micro = 2 if ("acc" in parts or "nosync" in parts) else 1
        self.nosync = "nosync" in parts
        self.clip = "clip" in parts
        self.buffers = "nobuffers" not in parts


def train(model: Any, optimizer: Any, scheduler: Any, habits: Habits, steps: range,
          delayed: list[Any] | None = None) -> None:  # fmt: skip
    """The DDP user's loop, the same for DDP and DataParallel. ``delayed`` (DDP only): hold
    each step's gradients back and apply the previous step's (double_buffer's reference)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for t in steps:
        optimizer.zero_grad()
        for m in range(habits.micro):
            x, y = batch(world, t, m)
            sync = contextlib.nullcontext()
            if habits.nosync and m < habits.micro - 1:
                sync = model.no_sync()
            with sync:
                loss = F.cross_entropy(model(shard(x, rank)), shard(y, rank)) / habits.micro
                loss.backward()
        if habits.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if delayed is None:
            optimizer.step()
        else:
            grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            previous = delayed[0] if delayed else None
            delayed[:] = [grads]
            if previous is not None:
                for p, g in zip(model.parameters(), previous, strict=True):
                    p.grad = g
                optimizer.step()
        scheduler.step()


def state_of(module: nn.Module) -> dict[str, Any]:
    return {k: v.detach().clone().numpy() for k, v in module.state_dict().items()}


def ddp_reference(key: str, mode: str) -> dict[str, Any]:
    """DDP over Gloo trained the scenario's way (gradients one step late for double_buffer)."""
    habits = Habits(key)
    module = make_model(dist.get_rank())
    ddp = DDP(module, broadcast_buffers=habits.buffers)
    optimizer = make_optimizer(habits.optimizer)(ddp.parameters())
    scheduler = make_scheduler(habits.optimizer, optimizer)
    delayed: list[Any] | None = [] if mode == "double_buffer" else None
    train(ddp, optimizer, scheduler, habits, range(STEPS), delayed)
    if delayed:  # the last held-back gradients, as synchronize() applies them
        for p, g in zip(ddp.parameters(), delayed[0], strict=True):
            p.grad = g
        optimizer.step()
    return state_of(module)


def ours(comm: ar.Communicator, habits: Habits, mode: str, rank: int) -> tuple[Any, Any, Any]:
    model = art.DataParallel(make_model(rank), comm, optimizer=make_optimizer(habits.optimizer),
                             mode=mode, broadcast_buffers=habits.buffers)  # fmt: skip
    return model, model.optimizer, make_scheduler(habits.optimizer, model.optimizer)


def run_plain(comm: ar.Communicator, key: str, mode: str) -> dict[str, Any]:
    habits = Habits(key)
    model, optimizer, scheduler = ours(comm, habits, mode, comm.rank)
    try:
        train(model, optimizer, scheduler, habits, range(STEPS))
        model.synchronize()
        return {"state": state_of(model.module)}
    finally:
        model.close()


def save(model: Any, optimizer: Any, scheduler: Any) -> bytes:
    wrapper = model.wrapper_state_dict() if isinstance(model, art.DataParallel) else None
    out = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "wrapper": wrapper}, out)  # fmt: skip
    return out.getvalue()


def load(blob: bytes, model: Any, optimizer: Any, scheduler: Any) -> None:
    saved = torch.load(io.BytesIO(blob), weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    if saved["wrapper"] is not None and isinstance(model, art.DataParallel):
        model.load_wrapper_state_dict(saved["wrapper"])


def run_checkpoint(comm: ar.Communicator, key: str, mode: str) -> dict[str, Any]:
    """``ckpt/FIRST>SECOND``: 5 steps as FIRST (a mode, or ddp), a checkpoint (after
    synchronize() only where the run moves to DDP), 5 more as SECOND, built from a module
    with other initial values that the checkpoint must overwrite."""
    first, second = key.split("/")[1].split(">")
    habits, rank, half = Habits(key), comm.rank, STEPS // 2

    def build(kind: str, seed_rank: int) -> tuple[Any, Any, Any]:
        if kind == "ddp":
            ddp = DDP(make_model(seed_rank))
            opt = make_optimizer(habits.optimizer)(ddp.parameters())
            return ddp, opt, make_scheduler(habits.optimizer, opt)
        return ours(comm, habits, kind, seed_rank)

    model, optimizer, scheduler = build(first, rank)
    train(model, optimizer, scheduler, habits, range(half))
    if second == "ddp" and isinstance(model, art.DataParallel):
        model.synchronize()
    blob = save(model, optimizer, scheduler)
    if isinstance(model, art.DataParallel):
        model.close()
    model, optimizer, scheduler = build(second, rank + 1000)
    load(blob, model, optimizer, scheduler)
    train(model, optimizer, scheduler, habits, range(half, STEPS))
    if isinstance(model, art.DataParallel):
        model.synchronize()
        model.close()
    return {"state": state_of(model.module)}


def run_clip_refused(comm: ar.Communicator, key: str, mode: str) -> dict[str, Any]:
    habits = Habits(key)
    model, optimizer, scheduler = ours(comm, habits, mode, comm.rank)
    try:
        train(model, optimizer, scheduler, habits, range(1))
    except ar.UsageError as exc:
        return {"refused": str(exc)}
    finally:
        model.close()
    return {"refused": None}


def run_loader(comm: ar.Communicator, key: str, mode: str) -> dict[str, Any]:
    """A DataLoader with two forked workers and a DistributedSampler, feeding both models the
    same batches; the workers are forked while the communicator's threads run."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(64, 1, 8, 8, generator=g, dtype=torch.float64),
                         torch.randint(0, 3, (64,), generator=g))  # fmt: skip
    sampler = DistributedSampler(data, num_replicas=comm.world_size, rank=comm.rank, seed=3)
    loader = DataLoader(data, batch_size=PER_RANK, sampler=sampler, num_workers=2,
                        multiprocessing_context="fork")  # fmt: skip
    habits = Habits(key)
    model, optimizer, scheduler = ours(comm, habits, mode, comm.rank)
    ddp = DDP(make_model(comm.rank))
    ddp_opt = make_optimizer(habits.optimizer)(ddp.parameters())
    ddp_sched = make_scheduler(habits.optimizer, ddp_opt)
    steps = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            for m, opt, sched in ((model, optimizer, scheduler), (ddp, ddp_opt, ddp_sched)):
                opt.zero_grad()
                F.cross_entropy(m(x), y).backward()
                opt.step()
                sched.step()
            steps += 1
    model.synchronize()
    model.close()
    return {"state": state_of(model.module), "ddp": state_of(ddp.module), "steps": steps}


def run_join(comm: ar.Communicator, key: str, mode: str) -> dict[str, Any]:
    """Uneven inputs: rank r trains on 3 + 2r batches, under our join() and under DDP's Join
    (the same loop); both must end with the same parameters and buffers on every rank."""
    from torch.distributed.algorithms.join import Join

    habits, rank, world = Habits(key), comm.rank, comm.world_size
    batches = [batch(world, t, 0) for t in range(3 + 2 * rank)]
    model, optimizer, scheduler = ours(comm, habits, mode, rank)
    ddp = DDP(make_model(rank))
    ddp_opt = make_optimizer(habits.optimizer)(ddp.parameters())
    ddp_sched = make_scheduler(habits.optimizer, ddp_opt)
    for m, opt, sched, joined in ((model, optimizer, scheduler, model.join()),
                                  (ddp, ddp_opt, ddp_sched, Join([ddp]))):  # fmt: skip
        with joined:
            for x, y in batches:
                opt.zero_grad()
                F.cross_entropy(m(shard(x, rank)), shard(y, rank)).backward()
                opt.step()
                sched.step()
    model.close()
    return {"state": state_of(model.module), "ddp": state_of(ddp.module)}


RUNNERS: dict[str, Callable[[ar.Communicator, str, str], dict[str, Any]]] = {
    "ckpt": run_checkpoint,
    "loader": run_loader,
    "join": run_join,
}


def run_one(comm: ar.Communicator, key: str) -> dict[str, Any]:
    mode = key.rsplit("/", 1)[1]
    if mode not in MODES:  # ckpt/A>B: the last mode named
        mode = key.split(">")[-1] if ">" in key else "forward"
    runner = RUNNERS.get(key.split("/")[0])
    if runner is None:
        runner = run_clip_refused if "clip" in key and mode not in EXACT[:2] else run_plain
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = runner(comm, key, mode)
    got["warnings"] = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    if "state" in got and "ddp" not in got and "refused" not in got:  # DDP run here
        reference_mode = "double_buffer" if "double_buffer" in key.split("/")[-1] else mode
        if key.startswith("ckpt/"):
            reference_mode = "double_buffer" if key.endswith("double_buffer") else "backward"
        got["ddp"] = ddp_reference(key, reference_mode)
    return got


def body(comm: ar.Communicator, gloo_port: int, keys: list[str]) -> dict[str, dict[str, Any]]:
    return run_scenarios(comm, gloo_port, keys, run_one)


def run_scenarios(
    comm: ar.Communicator, gloo_port: int, keys: list[str],
    run: Callable[[ar.Communicator, str], dict[str, Any]],
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """``run(comm, key)`` for each scenario inside a Gloo job beside ``comm`` (DDP's side); a
    scenario that raises is reported to its own test, and the others go on."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}",
                            rank=comm.rank, world_size=comm.world_size)  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    try:
        for key in keys:
            try:
                results[key] = run(comm, key)
            except Exception:  # noqa: BLE001 - reported to that scenario's test
                tb = traceback.format_exc()
                print(f"--- {key!r} failed on rank {comm.rank} ---\n{tb}", file=sys.stderr)
                results[key] = {"error": tb}
    finally:
        dist.destroy_process_group()
    return results


def keys_for(world: int) -> list[str]:
    keys = [f"sgd/{m}" for m in MODES] + [f"adam/{m}" for m in MODES]
    keys += [f"clip/{m}" for m in MODES]
    keys += [f"acc/{m}" for m in MODES] + [f"nosync/{m}" for m in MODES]
    keys += ["ckpt/backward>forward", "ckpt/forward>forward", "ckpt/ddp>forward",
             "ckpt/forward>ddp", "ckpt/double_buffer>double_buffer"]  # fmt: skip
    keys += ["nobuffers/backward", "nobuffers/forward", "loader/forward"]
    keys += [f"join/{m}" for m in EXACT]
    if world > 2:  # the costlier world: every rule, fewer repetitions of it
        keys = [k for k in keys if not k.startswith(("adam/blocking", "acc/blocking"))]
    return keys


GROUPS = {2: 240.0, 3: 300.0}
_CACHE: dict[int, Any] = {}


def results(world: int) -> dict[int, dict[str, dict[str, Any]]]:
    if world not in _CACHE:
        try:
            _CACHE[world] = run_ranks(world, body, free_port(), keys_for(world),
                                      timeout=GROUPS[world], daemon=False)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - re-raised for every test of the group
            _CACHE[world] = f"the R{world} group failed:\n{exc}"
    found = _CACHE[world]
    if isinstance(found, str):
        pytest.fail(found, pytrace=False)
    return found


def reports(world: int, key: str) -> list[dict[str, Any]]:
    got = [results(world)[rank][key] for rank in range(world)]
    for rank, report in enumerate(got):
        if "error" in report:
            pytest.fail(f"{key} raised on rank {rank}:\n{report['error']}", pytrace=False)
    return got


def assert_close(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: state_dict keys differ"
    for name in want:
        diff = np.abs(got[name].astype(np.float64) - want[name].astype(np.float64)).max(initial=0)
        assert diff <= ATOL, f"{what}: {name} is {diff:.3g} off DDP's"


CASES = [pytest.param(w, k, id=f"{k}-R{w}") for w in GROUPS for k in keys_for(w)]
MATCHED = [c for c in CASES if not ("clip" in c.values[1] and c.values[1].endswith(
    ("forward", "double_buffer")))]  # fmt: skip
REFUSED = [c for c in CASES if c not in MATCHED]
TIMEOUT = max(GROUPS.values()) + 60


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("world", "key"), MATCHED)
def test_ported_ddp_loop_ends_where_ddp_ends(world: int, key: str) -> None:
    for rank, report in enumerate(reports(world, key)):
        assert_close(report["state"], report["ddp"], f"rank {rank}, {key}")


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("world", "key"), REFUSED)
def test_clipping_where_the_gradient_was_already_sent_is_refused(world: int, key: str) -> None:
    for rank, report in enumerate(reports(world, key)):
        message = report["refused"]
        assert message is not None, f"rank {rank}: clip_grad_norm_ in {key} was silently ignored"
        named = message.split("'")[1]  # the gradient of 'NAME' changed ...
        assert "mode='backward'" in message and named in dict(BNNet().named_parameters()), message


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("world", "key"), MATCHED)
def test_no_scheduler_warning(world: int, key: str) -> None:
    for rank, report in enumerate(reports(world, key)):
        assert not report["warnings"], f"rank {rank}: {report['warnings']}"


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("world", sorted(GROUPS))
def test_dataloader_with_forked_workers_keeps_working(world: int) -> None:
    for rank, report in enumerate(reports(world, "loader/forward")):
        assert report["steps"] == 2 * math.ceil(math.ceil(64 / world) / PER_RANK), report
        assert_close(report["state"], report["ddp"], f"rank {rank}, loader")


# ---- the rest of the contract, one job per world size ---------------------------------------


def probe_fork(comm: ar.Communicator) -> dict[str, Any]:
    """A forked child that posts, and one that waits for its parent's request: both must get
    UsageError at once (never hang); the parent's communicator keeps working. Rank 0's
    barrier "P" cannot complete while its child runs: the others enter it only after "Q",
    which rank 0 enters once its child is done."""
    pending = comm.ibarrier(name="P") if comm.rank == 0 else None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running atexit or pytest machinery
        os.close(read)
        outcome = []
        for attempt in (
            lambda: comm.allreduce(np.ones(4), name="in-child", timeout=5),
            lambda: pending.wait(timeout=5) if pending is not None else None,
        ):
            try:
                attempt()
                outcome.append("no error")
            except ar.UsageError as exc:
                outcome.append("UsageError: " + str(exc))
            except BaseException as exc:  # noqa: BLE001
                outcome.append(f"{type(exc).__name__}: {exc}")
        comm.close()  # must not say goodbye on the parent's connections
        os.write(write, "\n".join(outcome).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        told = pipe.read().split("\n")
    os.waitpid(pid, 0)
    comm.barrier(name="Q", timeout=30)
    if pending is None:
        comm.barrier(name="P", timeout=30)
    else:
        pending.wait(timeout=30)
    x = np.full(4, comm.rank + 1.0)
    comm.allreduce(x, name="after-fork", timeout=30)
    return {"child": told, "after": x.tolist()}


def probe_version_counter(comm: ar.Communicator) -> dict[str, Any]:
    w = torch.ones(3, requires_grad=True)
    x = torch.full((3,), 2.0)
    y = (w * x).sum()  # saves x for backward
    comm.allreduce(x, name="saved-by-autograd")
    try:
        y.backward()
        return {"raised": None, "grad": w.grad.tolist()}
    except RuntimeError as exc:
        return {"raised": str(exc)}


def probe_lifecycle(comm: ar.Communicator) -> dict[str, Any]:
    out: dict[str, Any] = {}
    module = make_model(comm.rank)
    first = art.DataParallel(module, comm, optimizer=make_optimizer("sgd"), mode="backward")
    try:
        art.DataParallel(module, comm, optimizer=make_optimizer("sgd"))
        out["twice"] = None
    except ar.UsageError as exc:
        out["twice"] = str(exc)
    first.close()
    hooks_after_close = sum(len(p._post_accumulate_grad_hooks or {}) for p in module.parameters())
    second = art.DataParallel(module, comm, optimizer=make_optimizer("sgd"), mode="forward")
    del second
    gc.collect()
    out["hooks"] = [hooks_after_close,
                    sum(len(p._post_accumulate_grad_hooks or {}) for p in module.parameters()),
                    sum(len(m._forward_pre_hooks) for m in module.modules())]  # fmt: skip
    third = art.DataParallel(module, comm, optimizer=make_optimizer("sgd"), mode="backward")
    x, y = batch(comm.world_size, 0, 0)
    before = _posts(comm, ".bucket")
    F.cross_entropy(third(shard(x, comm.rank)), shard(y, comm.rank)).backward()
    out["one_post_per_bucket"] = _posts(comm, ".bucket") - before == len(third._buckets)
    third.close()
    try:
        third.step()
        out["closed_step"] = None
    except ar.ClosedError as exc:
        out["closed_step"] = str(exc)
    return out


def _posts(comm: ar.Communicator, prefix: str) -> int:
    return sum(1 for r in comm.flight_record()["records"] if prefix in (r["name"] or ""))


def probe_stats(comm: ar.Communicator) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("blocking", "forward"):
        model = art.DataParallel(make_model(comm.rank), comm, optimizer=make_optimizer("sgd"),
                                 mode=mode)  # fmt: skip
        for t in range(4):
            x, y = batch(comm.world_size, t, 0)
            F.cross_entropy(model(shard(x, comm.rank)), shard(y, comm.rank)).backward()
            model.step()
        model.synchronize()
        out[mode] = model.stats(reset=True)
        out[f"{mode}-after-reset"] = model.stats()
        model.close()
    return out


def probe_averaged_after_backward(comm: ar.Communicator) -> dict[str, Any]:
    """After backward() returns, p.grad is the average in blocking and backward modes (what
    DDP shows), and this rank's own gradient in forward and double_buffer modes."""
    out = {}
    x, y = batch(comm.world_size, 0, 0)
    plain = make_model(0)  # rank 0's initial values, which every wrapper starts from
    F.cross_entropy(plain(shard(x, comm.rank)), shard(y, comm.rank)).backward()
    out["local"] = plain.fc.weight.grad.clone().numpy()
    out["average"] = comm.allreduce(plain.fc.weight.grad.clone().numpy()) / comm.world_size
    for mode in MODES:
        module = make_model(comm.rank)
        model = art.DataParallel(module, comm, optimizer=make_optimizer("sgd"), mode=mode)
        F.cross_entropy(model(shard(x, comm.rank)), shard(y, comm.rank)).backward()
        out[mode] = module.fc.weight.grad.clone().numpy()
        model.step()
        model.synchronize()
        model.close()
    return out


def probe_forward_waits_in_the_layer(comm: ar.Communicator) -> dict[str, Any]:
    """forward mode waits for a layer's gradients in that layer's forward pre-hook, not in
    step(): rank 0's step() returns before any other rank has sent its gradients (they wait
    for it to, by a file, up to 10 s), so nothing rank 0 sent can have been reduced yet; and
    when the next forward reaches fc, every layer before it has been updated and fc has not,
    until its own pre-hook runs."""
    module = make_model(comm.rank)
    model = art.DataParallel(module, comm, optimizer=make_optimizer("sgd"), mode="forward")
    token = comm.broadcast(np.frombuffer(os.urandom(8), np.int64).copy(), root=0)
    step_returned = os.path.join(tempfile.gettempdir(), f"asyncreduce-step-{token[0]:x}")
    x, y = batch(comm.world_size, 0, 0)
    loss = F.cross_entropy(model(shard(x, comm.rank)), shard(y, comm.rank))  # buffers synced
    if comm.rank == 0:
        loss.backward()
        model.step()  # waiting here for the others' gradients would wait for the file's 10 s
        open(step_returned, "w").close()
        before_others_sent = True
    else:
        deadline = time.monotonic() + 10.0
        while not os.path.exists(step_returned) and time.monotonic() < deadline:
            time.sleep(0.01)
        before_others_sent = os.path.exists(step_returned)
        loss.backward()
        model.step()
    state = model.optimizer.state  # SGD makes a parameter's momentum at its first update

    def stepped() -> dict[str, bool]:
        return {n: bool(state.get(p)) for n, p in module.named_parameters()}

    after_step = stepped()
    seen: dict[str, bool] = {}

    def look(m: nn.Module, args: Any) -> None:
        seen.update(stepped())

    handle = module.fc.register_forward_pre_hook(look, prepend=True)  # before ours
    with torch.no_grad():
        model(shard(x, comm.rank))
    handle.remove()
    model.close()
    comm.barrier()  # every rank has looked for the file
    if comm.rank == 0:
        os.remove(step_returned)
    return {
        "rank_0_step_returned_before_this_rank_sent": before_others_sent,
        "stepped_after_step": after_step,
        "stepped_when_fc_runs": seen,
    }


def probe_buffers(comm: ar.Communicator) -> dict[str, Any]:
    """Every rank's running statistics, gathered right after construction and as the first
    layer of a forward starts, after two training steps; ranks start from their own."""
    out: dict[str, Any] = {}
    for broadcast in (True, False):
        module = make_model(comm.rank)
        with torch.no_grad():
            module.bn1.running_mean.fill_(comm.rank)
        model = art.DataParallel(module, comm, optimizer=make_optimizer("sgd"), mode="forward",
                                 broadcast_buffers=broadcast)  # fmt: skip
        seen = [module.bn1.running_mean.clone().numpy()]
        grab = module.conv1.register_forward_pre_hook(
            lambda m, a, seen=seen, bn=module.bn1: seen.append(bn.running_mean.clone().numpy())
        )
        for t in range(3):
            x, y = batch(comm.world_size, t, 0)
            F.cross_entropy(model(shard(x, comm.rank)), shard(y, comm.rank)).backward()
            model.step()
        grab.remove()
        model.close()
        out[str(broadcast)] = [comm.allgather(s) for s in (seen[0], seen[-1])]
    return out


class Functional(nn.Module):
    """Uses its child's weight directly on odd steps, without running the child."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.direct = False

    def forward(self, x: Any) -> Any:
        return F.linear(x, self.fc.weight, self.fc.bias) if self.direct else self.fc(x)


def probe_stale_use(comm: ar.Communicator) -> dict[str, Any]:
    """forward mode applies fc's update in fc's pre-hook; a forward that uses fc's weight
    without running fc would use it stale: that must be an error, not a silent difference."""
    module = Functional().double()
    model = art.DataParallel(module, comm, optimizer=make_optimizer("sgd"), mode="forward")
    x = torch.ones(2, 4, dtype=torch.float64)
    model(x).sum().backward()
    model.step()
    module.direct = True
    try:
        model(x).sum().backward()
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001
        return {"raised": f"{type(exc).__name__}: {exc}"}
    finally:
        model.close()


PROBES: dict[str, Callable[[ar.Communicator], dict[str, Any]]] = {
    "stale_use": probe_stale_use,
    "buffers": probe_buffers,
    "fork": probe_fork,
    "version": probe_version_counter,
    "lifecycle": probe_lifecycle,
    "stats": probe_stats,
    "averaged": probe_averaged_after_backward,
    "forward_waits": probe_forward_waits_in_the_layer,
}


def body_probes(comm: ar.Communicator) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {}
    for name, probe in PROBES.items():
        try:
            out[name] = probe(comm)
        except Exception:  # noqa: BLE001
            out[name] = {"error": traceback.format_exc()}
    return out


_PROBED: dict[int, Any] = {}


def probed(world: int, name: str) -> list[dict[str, Any]]:
    if world not in _PROBED:
        try:
            _PROBED[world] = run_ranks(world, body_probes, timeout=120)
        except Exception as exc:  # noqa: BLE001
            _PROBED[world] = f"the probes failed at R{world}:\n{exc}"
    found = _PROBED[world]
    if isinstance(found, str):
        pytest.fail(found, pytrace=False)
    got = [found[r][name] for r in range(world)]
    for rank, report in enumerate(got):
        if "error" in report:
            pytest.fail(f"{name} raised on rank {rank}:\n{report['error']}", pytrace=False)
    return got


WORLDS = pytest.mark.parametrize("world", [2, 3])


@pytest.mark.timeout(180)
@WORLDS
def test_a_forked_child_gets_usage_error_at_once_and_the_parent_goes_on(world: int) -> None:
    total = float(sum(range(1, world + 1)))
    for rank, report in enumerate(probed(world, "fork")):
        posted = report["child"][0]
        assert posted.startswith("UsageError") and "forked child" in posted, posted
        if rank == 0:
            assert report["child"][1].startswith("UsageError"), report["child"]
        assert report["after"] == [total] * 4, report


@pytest.mark.timeout(180)
@WORLDS
def test_buffers_are_rank0s_before_each_forward_unless_told_not_to(world: int) -> None:
    report = probed(world, "buffers")[0]
    for when, everyone in zip(("at construction", "as a forward starts"), report["True"],
                              strict=True):  # fmt: skip
        assert all(np.array_equal(b, everyone[0]) for b in everyone), f"broadcast, {when}"
    for when, everyone in zip(("at construction", "as a forward starts"), report["False"],
                              strict=True):  # fmt: skip
        assert not np.array_equal(everyone[0], everyone[1]), f"not broadcast, {when}"


@pytest.mark.timeout(180)
@WORLDS
def test_forward_mode_refuses_a_parameter_used_before_its_update(world: int) -> None:
    for report in probed(world, "stale_use"):
        raised = report["raised"]
        assert raised is not None and "UsageError" in raised, report
        assert "'fc." in raised and "mode='backward'" in raised, raised


@pytest.mark.timeout(180)
@WORLDS
def test_an_inplace_collective_bumps_the_version_counter(world: int) -> None:
    for report in probed(world, "version"):
        assert report["raised"] is not None, f"backward used the overwritten tensor: {report}"
        assert "modified by an inplace operation" in report["raised"]


@pytest.mark.timeout(180)
@WORLDS
def test_close_unhooks_and_a_wrapped_module_cannot_be_wrapped_again(world: int) -> None:
    for report in probed(world, "lifecycle"):
        assert report["twice"] is not None and "close()" in report["twice"], report
        assert report["hooks"] == [0, 0, 0], f"hooks left after close / collection: {report}"
        assert report["one_post_per_bucket"], "a closed wrapper's hooks still posted"
        assert report["closed_step"] is not None, report


@pytest.mark.timeout(180)
@WORLDS
def test_stats_count_only_time_that_could_overlap(world: int) -> None:
    for report in probed(world, "stats"):
        blocking = report["blocking"]
        assert blocking["comm_s"] > 0 and blocking["exposed_s"] >= blocking["comm_s"], blocking
        assert blocking["hidden_share"] == 0.0, blocking
        assert report["forward"]["comm_s"] > 0, report
        for mode in ("blocking", "forward"):
            assert report[f"{mode}-after-reset"] == {
                "exposed_s": 0.0, "comm_s": 0.0, "hidden_share": 0.0,
            }, report  # fmt: skip


@pytest.mark.timeout(180)
@WORLDS
def test_grad_is_the_average_when_backward_returns_in_blocking_and_backward(world: int) -> None:
    for rank, report in enumerate(probed(world, "averaged")):
        for mode in ("blocking", "backward"):
            np.testing.assert_allclose(report[mode], report["average"], atol=1e-12,
                                       err_msg=f"rank {rank}, {mode}")  # fmt: skip
        for mode in ("forward", "double_buffer"):  # this rank's own shard's gradient
            np.testing.assert_allclose(report[mode], report["local"], atol=1e-12,
                                       err_msg=f"rank {rank}, {mode}")  # fmt: skip
            assert not np.allclose(report["local"], report["average"]), "shards alike"


@pytest.mark.timeout(180)
@WORLDS
def test_forward_mode_waits_in_the_layers_pre_hook_not_in_step(world: int) -> None:
    for report in probed(world, "forward_waits"):
        assert report["rank_0_step_returned_before_this_rank_sent"], report
        assert not any(report["stepped_after_step"].values()), report["stepped_after_step"]
        seen = report["stepped_when_fc_runs"]
        assert all(seen[n] for n in seen if not n.startswith("fc.")), seen
        assert not any(seen[n] for n in seen if n.startswith("fc.")), seen


# ---- in one process ----------------------------------------------------------------------------


@contextlib.contextmanager
def alone() -> Iterator[ar.Communicator]:
    with ar.init(rank=0, world_size=1) as comm:
        yield comm


def test_the_optimizer_is_one_torch_optimizer_with_ddps_layout() -> None:
    with alone() as comm:
        for mode in MODES:
            module = BNNet().double()
            model = art.DataParallel(module, comm, optimizer=make_optimizer("sgd"), mode=mode)
            assert isinstance(model.optimizer, torch.optim.Optimizer)
            plain = make_optimizer("sgd")(module.parameters())
            assert model.optimizer.state_dict() == plain.state_dict(), mode
            with pytest.raises(ar.UsageError, match="factory"):
                model.optimizer.add_param_group({"params": [torch.zeros(1)]})
            model.close()


def test_a_pending_update_cannot_move_to_another_mode() -> None:
    with alone() as comm:
        module = BNNet().double()
        model = art.DataParallel(module, comm, optimizer=make_optimizer("sgd"), mode="forward")
        F.cross_entropy(model(batch(1, 0, 0)[0]), batch(1, 0, 0)[1]).backward()
        model.step()
        state = model.wrapper_state_dict()
        assert set(state["pending"]) == {n for n, _ in module.named_parameters()}
        model.close()
        other = art.DataParallel(BNNet().double(), comm, optimizer=make_optimizer("sgd"),
                                 mode="double_buffer")  # fmt: skip
        with pytest.raises(ar.UsageError, match="synchronize"):
            other.load_wrapper_state_dict(state)
        other.close()


def test_bad_optimizer_arguments_are_usage_errors() -> None:
    with alone() as comm:
        module = BNNet().double()
        with pytest.raises(ar.UsageError, match="factory"):
            art.DataParallel(module, comm, optimizer=torch.optim.SGD(module.parameters(), lr=1))
        with pytest.raises(ar.UsageError, match="closure"):
            model = art.DataParallel(module, comm, optimizer=make_optimizer("sgd"))
            try:
                model.step(lambda: 0.0)
            finally:
                model.close()


def _losses(model: Any, inputs: Any, steps: int = 4) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = model(inputs).pow(2).mean()
        loss.backward()
        model.step()
        losses.append(float(loss.detach()))
    return losses


def _forward_against_backward(build: Callable[[], nn.Module], inputs: Any) -> None:
    """forward mode must train exactly as backward mode does (one rank: the schedule of
    updates alone is being checked)."""
    with alone() as comm:
        runs = {}
        for mode in ("backward", "forward"):
            torch.manual_seed(0)
            model = art.DataParallel(build(), comm, mode=mode,
                                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))  # fmt: skip
            runs[mode] = _losses(model, inputs)
            model.synchronize()
            runs[mode + "-params"] = [p.detach().clone() for p in model.module.parameters()]
            model.close()
        assert runs["forward"] == runs["backward"]
        for a, b in zip(runs["forward-params"], runs["backward-params"], strict=True):
            assert torch.equal(a, b)


class HeadFirstTiedLM(nn.Module):
    """The output projection registered before the embedding that shares its weight, so the
    weight's owner (head) runs after the embedding used it."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 11)
        self.embed = nn.Embedding(11, 6)
        self.embed.weight = self.head.weight

    def forward(self, x: Any) -> Any:
        return self.head(torch.tanh(self.embed(x)))


def test_forward_mode_updates_a_tied_weight_before_its_first_use() -> None:
    _forward_against_backward(HeadFirstTiedLM, torch.arange(8).reshape(2, 4) % 11)


def test_forward_mode_trains_a_transformer_whose_out_proj_never_runs_itself() -> None:
    def build() -> nn.Module:
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    inputs = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    _forward_against_backward(build, inputs)


def test_forward_mode_runs_before_weight_norms_own_pre_hook() -> None:
    def build() -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the old-style weight_norm is deprecated
            return nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(3, 3)), nn.Linear(3, 1))

    _forward_against_backward(build, torch.ones(2, 3))


def test_grad_scaler_fused_or_not_steps_as_it_would_unwrapped() -> None:
    """GradScaler's fused path hands the scale and the inf flag to the optimizer's step."""
    with alone() as comm:
        for fused in (False, True):
            for inf in (False, True):
                got = []
                for wrapped in (False, True):
                    torch.manual_seed(0)
                    module = nn.Linear(3, 1).double()
                    factory = lambda ps, f=fused: torch.optim.SGD(ps, lr=0.1, fused=f)  # noqa: E731
                    if wrapped:
                        model = art.DataParallel(module, comm, optimizer=factory, mode="backward")
                        opt = model.optimizer
                    else:
                        model, opt = module, factory(list(module.parameters()))
                    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
                    loss = model(torch.ones(2, 3, dtype=torch.float64)).sum()
                    scaler.scale(loss * (float("inf") if inf else 1.0)).backward()
                    scaler.step(opt)
                    scaler.update()
                    got.append((module.weight.detach().clone(), scaler.get_scale()))
                    if wrapped:
                        model.close()
                assert torch.equal(got[0][0], got[1][0]) and got[0][1] == got[1][1], (fused, inf)
        fused_sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True)  # noqa: E731
        model = art.DataParallel(nn.Linear(2, 2), comm, mode="forward", optimizer=fused_sgd)
        with pytest.raises(ar.UsageError, match="mode='forward'.*mode='backward'"):
            getattr(model.optimizer, "_step_supports_amp_scaling", False)  # applied later: refused
        model.close()


def test_a_backward_that_raised_leaves_nothing_behind() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 1)

        def forward(self, x: Any, fail: bool = False) -> Any:
            y = x * 2
            if fail:
                y.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
            h = self.a(y)
            return h.sum(1, keepdim=True) if fail else self.b(h)

    with alone() as comm:
        torch.manual_seed(0)
        net = Net()
        plain = Net()
        plain.load_state_dict(net.state_dict())
        model = art.DataParallel(net, comm, mode="backward",
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))  # fmt: skip
        x = torch.ones(2, 3, requires_grad=True)
        with pytest.raises(RuntimeError, match="boom"):
            model(x, fail=True).sum().backward()  # a's gradients accumulated, then it raised
        model.optimizer.zero_grad()
        model(x).sum().backward()
        plain(x).sum().backward()
        for (name, p), q in zip(net.named_parameters(), plain.parameters(), strict=True):
            assert p.grad is not None and torch.equal(p.grad, q.grad), name
        model.close()


@pytest.mark.parametrize("mode", ["forward", "double_buffer"])
@pytest.mark.parametrize(
    "change", ["clip_grad_norm_", "clip_grad_value_", "grad.mul_", "grad.data.mul_", "zero_grad"]
)
def test_every_change_to_a_sent_gradient_is_refused(mode: str, change: str) -> None:
    with alone() as comm:
        module = BNNet().double()
        model = art.DataParallel(module, comm, optimizer=make_optimizer("sgd"), mode=mode)
        x, y = batch(1, 0, 0)
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad for p in module.parameters()]
        if change == "clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1e-3)
        elif change == "clip_grad_value_":
            torch.nn.utils.clip_grad_value_(module.parameters(), 1e-4)
        elif change == "grad.mul_":
            with torch.no_grad():
                grads[0].mul_(0.5)
        elif change == "grad.data.mul_":  # moves no version counter
            grads[-1].data.mul_(0.5)
        else:
            model.optimizer.zero_grad()
        with pytest.raises(ar.UsageError, match="changed after backward sent it"):
            model.step()
        model.close()
