"""A job for tests/test_elastic.py's rejoin test, run by ``asyncreduce run --elastic
--max-restarts 1``: slot ``--victim`` SIGKILLs itself in a backward pass at step 5 of its first
start; the launcher starts it again, it rejoins, and every member trains on until all have
seen the rejoin and taken 3 more steps (one allreduce per step agrees on when; at most 90 s).
Each rank writes what it did to OUT/slot-S-R.json."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import asyncreduce as ar
import asyncreduce.torch as art

SAMPLES, FEATURES, BATCH, LR, KILL_STEP = 192, 6, 4, 0.05, 5


def data() -> tuple[Any, Any]:
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((SAMPLES, FEATURES)))
    y = torch.from_numpy(rng.standard_normal((SAMPLES, 1)))
    return x, y


def net() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 1)).double()  # fmt: skip


def optimizer(params: list[Any]) -> Any:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def sampler() -> art.ElasticSampler:
    return art.ElasticSampler(SAMPLES, BATCH, seed=3)


def main(out: Path, victim: int) -> None:
    x, y = data()
    model = net()
    comm = ar.init(timeout=60)  # (a spare waits in it to be told the rank it restarts)
    slot, restart = int(os.environ["RANK"]), int(os.environ.get("ASYNCREDUCE_RESTART", "0"))
    state = art.Elastic(model, comm, optimizer, sampler(), mode="backward", bucket_bytes=128)
    if slot == victim and restart == 0:
        die = lambda g: os.kill(os.getpid(), signal.SIGKILL) if state.step == KILL_STEP else None  # noqa: E731
        model[0].weight.register_hook(die)
    digests: dict[int, str] = {}
    began = time.monotonic()

    def train(state: art.Elastic) -> None:
        back_at: int | None = None
        while True:
            indices = list(state.sampler)
            for start in range(0, len(indices), BATCH):
                batch = indices[start : start + BATCH]
                torch.nn.functional.mse_loss(state.model(x[batch]), y[batch]).backward()
                state.optimizer.step()
                state.optimizer.zero_grad()
                state.commit()
                flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                digests[state.step] = flat.numpy().tobytes().hex()
                if back_at is None and any(w in ("grown", "joined") for w, _, _ in state.changes):
                    back_at = state.step
                done = back_at is not None and state.step >= back_at + 3
                done = done or time.monotonic() - began > 90
                if state.comm.allreduce(np.array([done], np.int64), op="max")[0]:
                    return
            state.next_epoch()

    state.run(train)
    result = {"slot": slot, "restart": restart, "history": state.history,
              "params": [p.detach().numpy().tolist() for p in model.parameters()],
              "digests": digests, "recoveries": state.recoveries, "rejoins": state.rejoins,
              "changes": [w for w, _, _ in state.changes], "world": state.comm.world_size,
              "rank": state.comm.rank}  # fmt: skip
    (out / f"slot-{slot}-{restart}.json").write_text(json.dumps(result))
    state.close()
    state.comm.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
