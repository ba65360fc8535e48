"""The torch plugin's failure paths and clients (issue 35, items 3, 11, 12 and 13).

* a process group destroyed and made again over the same store meets afresh (torch gives the
  new group the old one's store prefix on purpose);
* ``communicator()`` of a destroyed group is an error, and nothing keeps its communicator;
* ``torch.distributed.checkpoint.async_save`` runs on the backend (a CPU backend is named);
* Lightning's ``Trainer`` with ``DDPStrategy(process_group_backend="asyncreduce")`` ends where
  the same run over Gloo ends (when lightning is installed).
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import asyncreduce.torch as art  # noqa: E402
from asyncreduce.errors import UsageError  # noqa: E402
from spmd import run_ranks  # noqa: E402

pytestmark = [pytest.mark.torch]
ROOT = Path(__file__).resolve().parents[1]


def _init(rank: int, n: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("asyncreduce", rank=rank, world_size=n,
                            timeout=timedelta(seconds=30))  # fmt: skip


# ---- item 3: destroy, then init again over the same store -----------------------------------


def body_reinit(rank: int, n: int, port: int) -> list[tuple[float, list[float]]]:
    """Three rounds of init, all_reduce, destroy over one TCPStore (as under torchrun, whose
    agent store outlives the groups): each round's group must not read the last one's keys.
    The world is ours: a Gloo world with a group of ours in it failed in Gloo itself (seen
    once in five runs: Gloo's next default group dialled an address of the last one,
    "Connection refused"), as Gloo keeps its keys under the reused prefix too."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=timedelta(seconds=30))
    rounds = []
    for attempt in range(3):
        start = time.monotonic()
        # a short group timeout: a stale rendezvous fails (or hangs) within it, not in 30 min
        dist.init_process_group("asyncreduce", store=store, rank=rank, world_size=n,
                                timeout=timedelta(seconds=10))  # fmt: skip
        t = torch.full((4,), float(rank + 1 + attempt))
        dist.all_reduce(t)
        dist.destroy_process_group()
        rounds.append((time.monotonic() - start, t.tolist()))
    return rounds


@pytest.mark.timeout(120)
def test_destroy_then_init_again_over_one_store_meets_afresh() -> None:
    results = run_ranks(2, body_reinit, connect=False, timeout=90)
    for rank, rounds in results.items():
        for attempt, (took, value) in enumerate(rounds):
            assert value == [3.0 + 2 * attempt] * 4, (rank, attempt, value)
            assert took < 5.0, f"rank {rank}, attempt {attempt}: {took:.1f} s"


# ---- item 11: communicator() of a destroyed group ------------------------------------------


def body_destroyed_group(rank: int, n: int, port: int) -> dict[str, Any]:
    _init(rank, n, port)
    pg = dist.distributed_c10d._get_default_group()
    sub = dist.new_group([0, 1])
    comm, sub_comm = art.communicator(pg), art.communicator(sub)
    refs = [weakref.ref(comm), weakref.ref(sub_comm)]
    gloo = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    try:
        art.communicator(gloo)
        out["gloo"] = "no error"
    except UsageError as exc:
        out["gloo"] = str(exc)
    dist.destroy_process_group()
    del comm, sub_comm, gloo
    for label, group in (("world", pg), ("sub", sub)):
        try:
            found = art.communicator(group)
            out[label] = f"no error: got {found!r} (closed: {found._closed})"
            del found
        except UsageError as exc:
            out[label] = f"UsageError: {exc}"
    del pg, sub, group
    gc.collect()
    out["alive"] = [ref() is not None for ref in refs]
    return out


@pytest.mark.timeout(90)
def test_the_communicator_of_a_destroyed_group_is_an_error_and_is_freed() -> None:
    for rank, out in run_ranks(2, body_destroyed_group, connect=False, timeout=60).items():
        assert "not a process group of the asyncreduce backend" in out["gloo"], (rank, out)
        assert out["world"].startswith("UsageError") and "destroyed" in out["world"], (rank, out)
        assert out["sub"].startswith("UsageError") and "destroyed" in out["sub"], (rank, out)
        assert out["alive"] == [False, False], f"rank {rank}: a registry keeps {out['alive']}"


# ---- item 12: torch.distributed.checkpoint.async_save -------------------------------------


def body_async_checkpoint(rank: int, n: int, port: int, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    _init(rank, n, port)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
        saved = {"model": model.state_dict(), "step": torch.tensor(7)}
        devices = dist.distributed_c10d._device_capability()
        future = dcp.async_save(saved, checkpoint_id=path)
        future.result()  # (a Future: the upload ran on a thread, with this group's collectives)
        fresh = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
        for p in fresh.parameters():
            nn.init.zeros_(p)
        loaded = {"model": fresh.state_dict(), "step": torch.tensor(0)}
        dcp.load(loaded, checkpoint_id=path)
        return {"devices": devices, "step": int(loaded["step"]),
                "diff": max(float((loaded["model"][k] - v).abs().max())
                            for k, v in saved["model"].items())}  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_async_checkpoint_saves_and_loads_on_the_backend(tmp_path: Path) -> None:
    results = run_ranks(2, body_async_checkpoint, str(tmp_path / "ckpt"), connect=False,
                        timeout=60)  # fmt: skip
    for rank, out in results.items():
        assert "cpu" in out["devices"], (rank, out)
        assert out["step"] == 7 and out["diff"] == 0.0, (rank, out)


# ---- item 13: Lightning's Trainer, over Gloo and over ours -------------------------------

LIGHTNING_SCRIPT = """
import sys

import numpy as np
import torch
from torch import nn

import asyncreduce.torch  # at module level: a spawned rank imports this module, not main()
import lightning as L
from lightning.pytorch.strategies import DDPStrategy


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Keep(L.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, module):
        import torch.distributed as dist

        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy()
        np.save(f"{self.out}.{trainer.global_rank}.npy", flat)
        print(f"rank {trainer.global_rank} ran on {dist.get_backend()}", flush=True)


def main(backend, start, out):
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g),
                                          torch.randn(64, 1, generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=5, logger=False,
                        strategy=DDPStrategy(process_group_backend=backend, start_method=start),
                        callbacks=[Keep(out)], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main(*sys.argv[1:])
"""


@pytest.mark.timeout(150)
def test_lightning_ddp_over_asyncreduce_ends_where_it_ends_over_gloo(tmp_path: Path) -> None:
    """docs/porting.md's Lightning lines, run: Gloo started as Lightning starts a script
    (popen), ours in spawned processes (where the import must be at module level)."""
    page = (ROOT / "docs/porting.md").read_text()
    section = re.search(r"^## Lightning\n(.*?)(?=^## |\Z)", page, re.M | re.S)
    assert section, "docs/porting.md has no Lightning section"
    shown = "".join(re.findall(r"^```py\n(.*?)^```", section.group(1), re.M | re.S))
    for line in ("import asyncreduce.torch", 'DDPStrategy(process_group_backend="asyncreduce")'):
        assert line in shown, f"the page's Lightning code lacks {line!r}"
    assert re.search(r"^import asyncreduce\.torch\b", shown, re.M), "not at module level"
    assert re.search(r"^import asyncreduce\.torch\b", LIGHTNING_SCRIPT, re.M)
    pytest.importorskip("lightning")
    script = tmp_path / "job.py"
    script.write_text(LIGHTNING_SCRIPT)
    launcher_vars = ("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "NODE_RANK")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher_vars)}
    params = {}
    for backend, start in (("gloo", "popen"), ("asyncreduce", "spawn")):
        out = tmp_path / backend
        argv = [sys.executable, str(script), backend, start, str(out)]
        done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=100)  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        for rank in range(2):
            assert f"rank {rank} ran on {backend}" in done.stdout, done.stdout[-3000:]
        params[backend] = [np.load(f"{out}.{rank}.npy") for rank in range(2)]
    for rank in range(2):
        diff = float(np.abs(params["asyncreduce"][rank] - params["gloo"][rank]).max())
        assert diff <= 1e-6, f"rank {rank}: {diff:.3g} off Gloo's"
    assert np.array_equal(params["asyncreduce"][0], params["asyncreduce"][1])
