"""The "asyncreduce" torch.distributed backend, through torch's own API, on real processes.

Every collective of ``torch.distributed`` against what it must give (and, for DDP, against DDP
over Gloo in the same processes); the init methods; groups that share the process's
connections (Gloo's do not: measured in the same run); Works and futures as Gloo's; ``ar.init``
inside a torch job; and a representative part of PyTorch's own suite
(``scripts/torch_suite.py`` runs all of it). What PyTorch's suite gates to named backends
(``get_future``, the coalesced allreduce, some object collectives) is covered here.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path
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
from spmd import run_ranks  # noqa: E402

pytestmark = [pytest.mark.torch]
ROOT = Path(__file__).resolve().parents[1]


def _init(rank: int, n: int, port: int, how: str, tmp: str = "") -> None:
    torch.set_num_threads(1)
    if how == "env":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("asyncreduce", rank=rank, world_size=n)
    elif how == "tcp":
        dist.init_process_group("asyncreduce", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=n)  # fmt: skip
    else:
        dist.init_process_group("asyncreduce", init_method=f"file://{tmp}/store",
                                rank=rank, world_size=n)  # fmt: skip


def _sockets() -> int:
    fds = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
    return sum(os.readlink(fd).startswith("socket:") for fd in fds if os.path.exists(fd))


# ---- every collective --------------------------------------------------------------------------

DTYPES = [
    torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
]  # fmt: skip
OPS = {
    "SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX, "BAND": dist.ReduceOp.BAND,
    "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR,
}  # fmt: skip


def _reduce_value(name: str, dtype: Any, values: list[Any]) -> Any:
    """What torch itself computes for the reduction of ``values`` (one tensor per rank)."""
    acc = values[0].clone()
    for v in values[1:]:
        if name in ("SUM", "AVG"):
            acc = acc + v if dtype != torch.bool else acc | v
        elif name == "PRODUCT":
            acc = acc * v if dtype != torch.bool else acc & v
        elif name == "MIN":
            acc = torch.minimum(acc, v)
        elif name == "MAX":
            acc = torch.maximum(acc, v)
        else:
            acc = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
                   "BXOR": torch.bitwise_xor}[name](acc, v)  # fmt: skip
    return acc / len(values) if name == "AVG" else acc


def _valid(name: str, dtype: Any) -> bool:
    if dtype.is_complex:  # torch itself allows SUM and AVG only (then sends pairs of reals)
        return name in ("SUM", "AVG")
    if name in ("BAND", "BOR", "BXOR"):
        return not (dtype.is_floating_point or dtype.is_complex)
    if name == "AVG":
        return dtype.is_floating_point or dtype.is_complex
    if name in ("MIN", "MAX"):
        return not dtype.is_complex
    return True


def _values(rank: int, dtype: Any) -> Any:
    base = torch.tensor([rank + 1, 2 * rank + 1, 3 - rank, 1])
    if dtype == torch.bool:
        return torch.tensor([rank == 0, True, False, rank % 2 == 1])
    if dtype.is_complex:
        return (base + 1j * (base - 1)).to(dtype)
    return base.to(dtype)


def body_collectives(rank: int, n: int, port: int, how: str, tmp: str) -> dict[str, Any]:
    _init(rank, n, port, how, tmp)
    out: dict[str, Any] = {}
    try:
        everyone = [_values(r, torch.float64) for r in range(n)]
        for name, op in OPS.items():
            for dtype in DTYPES:
                if not _valid(name, dtype):
                    continue
                t = _values(rank, dtype)
                dist.all_reduce(t, op=op)
                want = _reduce_value(name, dtype, [_values(r, dtype) for r in range(n)])
                assert torch.equal(t, want.to(dtype)), (name, dtype, t, want)
        for root in range(n):
            b = torch.full((5,), float(rank))
            dist.broadcast(b, src=root)
            assert torch.equal(b, torch.full((5,), float(root)))
            r = _values(rank, torch.float64)
            dist.reduce(r, dst=root)
            assert torch.equal(r, sum(everyone) if rank == root else everyone[rank])
            g = [torch.zeros(4, dtype=torch.float64) for _ in range(n)] if rank == root else None
            dist.gather(_values(rank, torch.float64), g, dst=root)
            assert g is None or all(torch.equal(g[q], everyone[q]) for q in range(n))
            s = torch.zeros(3)
            chunks = [torch.full((3,), float(q + 10)) for q in range(n)] if rank == root else None
            dist.scatter(s, chunks, src=root)
            assert torch.equal(s, torch.full((3,), float(rank + 10)))
        gathered = [torch.zeros(4, dtype=torch.float64) for _ in range(n)]
        dist.all_gather(gathered, _values(rank, torch.float64))
        assert all(torch.equal(gathered[q], everyone[q]) for q in range(n))
        flat = torch.zeros(4 * n, dtype=torch.float64)
        dist.all_gather_into_tensor(flat, _values(rank, torch.float64))
        assert torch.equal(flat, torch.cat(everyone))
        mine = torch.zeros(2)
        dist.reduce_scatter(mine, [torch.full((2,), float(q + rank)) for q in range(n)])
        assert torch.equal(mine, torch.full((2,), float(n * rank + sum(range(n)))))
        rs = torch.zeros(2)
        dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n) + rank)
        assert torch.equal(rs, (torch.arange(2.0 * n) * n + sum(range(n)))[2 * rank : 2 * rank + 2])
        a2a = [torch.zeros(2) for _ in range(n)]
        dist.all_to_all(a2a, [torch.full((2,), float(10 * rank + q)) for q in range(n)])
        assert all(torch.equal(a2a[q], torch.full((2,), float(10 * q + rank))) for q in range(n))
        sizes_in = [q + 1 for q in range(n)]  # rank sends q+1 rows to rank q
        single = torch.cat([torch.full((k,), float(rank)) for k in sizes_in])
        sizes_out = [rank + 1] * n
        got = torch.zeros(sum(sizes_out))
        dist.all_to_all_single(got, single, sizes_out, sizes_in)
        assert torch.equal(got, torch.cat([torch.full((rank + 1,), float(q)) for q in range(n)]))
        even = torch.zeros(2 * n)
        dist.all_to_all_single(even, torch.arange(2.0 * n) + 100 * rank)
        want = torch.cat([torch.arange(2.0 * rank, 2.0 * rank + 2) + 100 * q for q in range(n)])
        assert torch.equal(even, want)
        dist.barrier()
        # coalesced: the manager's fast path and the coalesced calls
        parts = [torch.full((3,), float(rank + i)) for i in range(4)]
        with dist.distributed_c10d._coalescing_manager(async_ops=True) as cm:
            for p in parts:
                dist.all_reduce(p)
        cm.wait()
        assert all(torch.equal(p, torch.full((3,), float(sum(range(n)) + n * i)))
                   for i, p in enumerate(parts))  # fmt: skip
        lists = [[torch.zeros(2), torch.zeros(1)] for _ in range(n)]
        dist.all_gather_coalesced(lists, [torch.full((2,), float(rank)), torch.full((1,), -1.0)])
        assert all(torch.equal(lists[q][0], torch.full((2,), float(q))) for q in range(n))
        # objects (torch pickles them into tensors, as it does for every backend)
        objs: list[Any] = [None] * n
        dist.all_gather_object(objs, {"rank": rank})
        assert objs == [{"rank": q} for q in range(n)]
        box = [{"from": rank}]
        dist.broadcast_object_list(box, src=n - 1)
        assert box == [{"from": n - 1}]
        one: list[Any] = [None]
        dist.scatter_object_list(one, [f"to {q}" for q in range(n)] if rank == 0 else None, src=0)
        assert one == [f"to {rank}"]
        at_root: list[Any] | None = [None] * n if rank == 0 else None
        dist.gather_object(rank * 10, at_root, dst=0)
        assert at_root is None or at_root == [q * 10 for q in range(n)]
        # batch_isend_irecv around a ring, with tags
        right, left = (rank + 1) % n, (rank - 1) % n
        inbox = torch.zeros(3)
        ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank)), right, tag=7),
               dist.P2POp(dist.irecv, inbox, left, tag=7)]  # fmt: skip
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert inbox.tolist() == [float(left)] * 3
        # point-to-point with tags, posted out of order on the receiving side
        if rank == 0:
            works = [dist.isend(torch.full((2,), float(t)), 1, tag=t) for t in (5, 6)]
            for w in works:
                w.wait()
        elif rank == 1:
            six, five = torch.zeros(2), torch.zeros(2)
            w6 = dist.irecv(six, 0, tag=6)
            dist.recv(five, 0, tag=5)
            w6.wait()
            assert five.tolist() == [5.0, 5.0] and six.tolist() == [6.0, 6.0]
        # Works and futures: completed with the tensors
        t = torch.ones(3)
        work = dist.all_reduce(t, async_op=True)
        value = work.get_future().wait()
        assert isinstance(value, list) and value[0] is t and t.tolist() == [float(n)] * 3
        assert work.is_completed() and work.wait()
        # groups: every one over the same connections
        before = _sockets()
        groups = [dist.new_group([q, (q + 1) % n]) for q in range(n)] * 1
        groups += [dist.new_group(list(range(n))) for _ in range(6)]
        out["sockets_added"] = _sockets() - before
        subs, _ = dist.new_subgroups(group_size=1 if n % 2 else 2)
        x = torch.ones(1)
        dist.all_reduce(x, group=subs)
        out["subgroup"] = x.item()
        for g in groups[n:]:
            y = torch.full((1,), float(rank))
            dist.all_reduce(y, group=g)
            assert y.item() == sum(range(n))
        out["backend"] = dist.get_backend()
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("n", "how"), [(2, "env"), (3, "tcp"), (3, "file")])
def test_every_torch_collective_on_the_backend(n: int, how: str, tmp_path: Path) -> None:
    results = run_ranks(n, body_collectives, how, str(tmp_path), connect=False, timeout=120)
    for rank, out in results.items():
        assert out["backend"] == "asyncreduce"
        assert out["sockets_added"] == 0, f"rank {rank}: groups opened {out['sockets_added']}"
        assert out["subgroup"] == (1 if n % 2 else 2)


def body_gloo_sockets(rank: int, n: int, port: int) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)  # fmt: skip
    try:
        before = _sockets()
        for _ in range(8):
            dist.new_group(list(range(n)))
        return _sockets() - before
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_gloo_groups_open_sockets_and_ours_do_not(tmp_path: Path) -> None:
    """The measured comparison: 8 groups of 3 ranks."""
    gloo = run_ranks(3, body_gloo_sockets, connect=False, timeout=60)
    assert all(added >= 8 for added in gloo.values()), gloo  # Gloo: new sockets per group
    ours = run_ranks(3, body_collectives, "tcp", str(tmp_path), connect=False, timeout=120)
    assert all(out["sockets_added"] == 0 for out in ours.values())


# ---- errors ------------------------------------------------------------------------------------


def body_errors(rank: int, n: int, port: int) -> dict[str, str]:
    _init(rank, n, port, "env")
    out = {}
    try:
        for label, call in (
            ("premul", lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))),
            ("avg-int", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32),
                                                op=dist.ReduceOp.AVG)),
            ("any-source", lambda: dist.recv(torch.ones(2))),
        ):  # fmt: skip
            try:
                call()
                out[label] = "no error"
            except Exception as exc:  # noqa: BLE001
                out[label] = f"{type(exc).__name__}: {exc}"
        # a mismatch sets the error on the future of every rank
        t = torch.ones(3 if rank == 0 else 4)
        future = dist.all_reduce(t, async_op=True).get_future()
        try:
            future.wait()
            out["mismatch"] = "no error"
        except Exception as exc:  # noqa: BLE001
            out["mismatch"] = f"{type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.timeout(90)
def test_what_the_backend_cannot_do_is_a_clear_error() -> None:
    for out in run_ranks(2, body_errors, connect=False, timeout=60).values():
        assert "cannot reduce with" in out["premul"], out
        assert "floating or complex" in out["avg-int"], out
        assert "any source" in out["any-source"], out
        assert "MismatchError" in out["mismatch"] or "float32[3]" in out["mismatch"], out


# ---- DDP unchanged, against DDP over Gloo ------------------------------------------------------


class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.unused = nn.Linear(8, 8) if unused else None

    def forward(self, x: Any) -> Any:
        return self.b(torch.tanh(self.a(x)))


def _ddp_run(group: Any, kind: str, rank: int, n: int) -> dict[str, Any]:
    torch.manual_seed(7 + rank)
    module = Net(unused=kind == "unused").double()
    kwargs: dict[str, Any] = {"process_group": group}
    if kind == "unused":
        kwargs["find_unused_parameters"] = True
    if kind == "static":
        kwargs["static_graph"] = True
    ddp = DDP(module, **kwargs)
    if kind == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif kind == "hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    steps = 3 + 2 * rank if kind == "join" else 10
    joined: Any = contextlib.nullcontext()
    if kind == "join":
        from torch.distributed.algorithms.join import Join

        joined = Join([ddp])
    with joined:
        for t in range(steps):
            g = torch.Generator().manual_seed(1000 * t + rank)
            x = torch.randn(4, 6, generator=g, dtype=torch.float64)
            y = torch.randn(4, 3, generator=g, dtype=torch.float64)
            opt.zero_grad()
            if kind == "no_sync" and t % 2 == 0:
                with ddp.no_sync():
                    F.mse_loss(ddp(x), y).backward()
                x = x * 2
            F.mse_loss(ddp(x), y).backward()
            opt.step()
    return {n_: p.detach().clone().numpy() for n_, p in module.named_parameters()}


KINDS = ["plain", "no_sync", "hook", "fp16", "unused", "static", "join", "staged"]


def _ddp(group: Any, kind: str, rank: int, n: int) -> dict[str, Any]:
    return _ddp_staged(group, rank, n) if kind == "staged" else _ddp_run(group, kind, rank, n)


def _ddp_staged(group: Any, rank: int, n: int) -> dict[str, Any]:
    """DDP over a group whose every tensor is staged, as a CUDA tensor is (through the CPU
    stand-in of a GPU): where Gloo's plain run ends, with its copies and no synchronization
    of the training thread (DDP waits on its own work; staging threads wait on copies)."""
    from asyncreduce.torch.standin import standing_in

    if group is None:
        return _ddp_run(group, "plain", rank, n)
    with standing_in() as device:
        ended = _ddp_run(group, "plain", rank, n)
        counts = device.counts()
    moved = sum(v for (what, _), v in counts.items() if what in ("to_host", "to_device"))
    syncs = sum(v for (what, who), v in counts.items()
                if what == "synchronize" and not who.startswith("asyncreduce-staging"))
    return {**ended, "_moved": np.array(moved > 0), "_syncs": np.array(syncs)}


def body_ddp(rank: int, n: int, port: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)  # fmt: skip
    ours = dist.new_group(backend="asyncreduce")
    try:
        return {kind: {"gloo": _ddp(None, kind, rank, n), "ours": _ddp(ours, kind, rank, n)}
                for kind in KINDS}  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [2, 3])
def test_ddp_over_asyncreduce_ends_where_ddp_over_gloo_ends(n: int) -> None:
    results = run_ranks(n, body_ddp, connect=False, timeout=180)
    for rank, out in results.items():
        assert out["staged"]["ours"].pop("_moved"), f"rank {rank}: nothing was staged"
        assert out["staged"]["ours"].pop("_syncs") == 0, f"rank {rank}: the training thread synced"
        for kind in KINDS:
            for name, want in out[kind]["gloo"].items():
                diff = float(np.abs(out[kind]["ours"][name] - want).max())
                tol = 1e-3 if kind == "fp16" else 1e-6
                assert diff <= tol, f"rank {rank}, {kind}, {name}: {diff:.3g} off Gloo's"


# ---- FSDP2 on the CPU ---------------------------------------------------------------------------


def body_fsdp(rank: int, n: int, port: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)  # fmt: skip
    ours = dist.new_group(backend="asyncreduce")
    out = {}
    try:
        from torch.distributed.device_mesh import DeviceMesh

        for label, group in (("gloo", dist.group.WORLD), ("ours", ours)):
            torch.manual_seed(3)
            model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).double()
            mesh = DeviceMesh.from_group(group, "cpu")
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for t in range(5):
                g = torch.Generator().manual_seed(100 * t + rank)
                loss = model(torch.randn(4, 8, generator=g, dtype=torch.float64)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            out[label] = [p.full_tensor().detach().numpy() for p in model.parameters()]
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.timeout(150)
def test_fsdp2_on_the_cpu_matches_gloo() -> None:
    try:
        results = run_ranks(2, body_fsdp, connect=False, timeout=120)
    except AssertionError as exc:
        if "gloo" in str(exc).lower() and "not supported" in str(exc).lower():
            pytest.skip(f"FSDP2 does not run over Gloo on the CPU here: {exc}")
        raise
    for rank, out in results.items():
        for a, b in zip(out["gloo"], out["ours"], strict=True):
            assert np.abs(a - b).max() <= 1e-6, f"rank {rank}"


# ---- both APIs in one job ------------------------------------------------------------------------


def body_both(rank: int, n: int, port: int) -> dict[str, Any]:
    _init(rank, n, port, "env")
    try:
        behind = art.communicator()
        before = _sockets()
        x = np.full(3, float(rank))
        behind.allreduce(x)
        t = torch.full((3,), float(rank))
        dist.all_reduce(t)  # torch's unnamed ops and the communicator's never mix
        model = art.DataParallel(nn.Linear(3, 1), behind, mode="backward",
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))  # fmt: skip
        model(torch.ones(2, 3)).sum().backward()
        model.step()
        model.close()
        sockets_added = _sockets() - before
        with ar.init(timeout=30) as joined:  # inside a torch job: meets in torch's store
            y = joined.allreduce(np.ones(2))
        return {"sum": x.tolist(), "torch": t.tolist(), "sockets": sockets_added,
                "init": y.tolist(), "same": behind.world_size == n}  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_dataparallel_and_dist_share_one_communicator_and_init_reuses_torchs_store() -> None:
    for out in run_ranks(2, body_both, connect=False, timeout=60).values():
        assert out["sum"] == [1.0] * 3 and out["torch"] == [1.0] * 3, out
        assert out["sockets"] == 0 and out["same"], out
        assert out["init"] == [2.0, 2.0], out


# ---- under torchrun, and PyTorch's own suite --------------------------------------------------

TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
import asyncreduce.torch
dist.init_process_group("asyncreduce")
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} got {t[0].item():g}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_init_process_group_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD"))}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "3", str(script)], capture_output=True, text=True,
                         timeout=100, env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(re.findall(r"rank \d of 3 got 6", out.stdout)) == 3, out.stdout


SUITE = [
    "test_all_reduce_sum_complex", "test_broadcast_full_group", "test_all_gather_coalesced_simple",
    "test_reduce_sum_twice", "test_gather_full_group", "test_scatter_complex",
    "test_barrier_full_group", "test_send_recv_with_tag", "test_DistributedDataParallelCPU",
]


@pytest.mark.timeout(600)
def test_torch_suite_selection(tmp_path: Path) -> None:
    """A representative part of PyTorch's distributed_test suite, on two ranks (each test
    starts its own processes: about 10 s apiece here); every one must pass. All of it, at any
    world size: ``scripts/torch_suite.py`` (docs/launchers.md)."""
    pytest.importorskip("expecttest")
    report = tmp_path / "suite.json"
    chosen = " or ".join(SUITE)
    cmd = [sys.executable, str(ROOT / "scripts/torch_suite.py"), "--backend", "asyncreduce",
           "--world-size", "2", "-k", f"({chosen}) and not any_source", "--json", str(report)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=580)
    import json

    outcomes = json.loads(report.read_text())
    failed = sorted(t for t, o in outcomes.items() if o != "passed")
    assert not failed and len(outcomes) >= len(SUITE), out.stdout[-4000:]


# ---- review mends: futures whose callbacks wait, subgroups, outputs ------------------------------


def body_waiting_callback(rank: int, n: int, port: int) -> list[float]:
    """A ``then`` callback that waits on another Work's future (PowerSGD's hooks do): it must
    not hang, since the callback does not run on the thread that settles futures."""
    _init(rank, n, port, "env")
    try:
        t = torch.full((4,), float(rank + 1))

        def then(fut: Any) -> Any:
            u = fut.value()[0].clone()
            return dist.all_reduce(u, async_op=True).get_future().wait()[0]

        chained = dist.all_reduce(t, async_op=True).get_future().then(then)
        return chained.wait().tolist()
    finally:
        dist.destroy_process_group()


def test_a_future_callback_may_wait_on_another_work() -> None:
    results = run_ranks(2, body_waiting_callback, connect=False, timeout=60)
    assert results[0] == results[1] == [6.0] * 4  # (1 + 2) summed twice over 2 ranks


def body_subgroup_communicator(rank: int, n: int, port: int) -> list[float]:
    """``communicator(subgroup)`` reduces over the subgroup, not over the world."""
    _init(rank, n, port, "env")
    try:
        sub = dist.new_group([0, 1])
        if rank > 1:
            return []  # closes at once: the subgroup goes on without it
        comm = art.communicator(sub)
        assert comm.world_size == 2
        time.sleep(1.0)  # rank 2's goodbye has arrived by now
        return comm.allreduce(np.full(2, rank + 1.0), name="sub").tolist()
    finally:
        dist.destroy_process_group()


def test_the_communicator_of_a_subgroup_is_the_subgroup() -> None:
    results = run_ranks(3, body_subgroup_communicator, connect=False, timeout=60)
    assert results[0] == results[1] == [3.0, 3.0] and results[2] == []
