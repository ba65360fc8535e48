"""One rank of ``asyncreduce bench elastic`` (benchmarks/elastic.py), on its emulated host.

It trains a small regression with ``asyncreduce.torch.Elastic`` (mode "backward") until the
file ``--stop`` exists on some member (one allreduce per step asks, so every member stops after
the same step), and prints one JSON line per event on stdout: ``start`` (its slot and restart
count), ``step`` (every committed step: its number, the world size, the time and a digest of
the parameters), ``change`` (each change of membership this rank saw) and ``end``; ``ready``
and ``init`` around ``ar.init()``, which in a restarted rank is its knock and connection (torch's
first optimizer, which imports torch._dynamo for a second, is made before ``ready``, so what
lies between the two is asyncreduce's alone). At the end
it writes its parameters and the committed steps to ``--out``/slot-S-R.npz for the replay.
A restarted rank (``ASYNCREDUCE_RESTART``) rejoins through the doors in ``ar.init()``; a spare
(``ASYNCREDUCE_SPARE=1``) waits in it until the bench tells it the slot it restarts, so the
events of a process are said once it knows its slot.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import asyncreduce as ar
import asyncreduce.torch as art

SAMPLES, FEATURES, HIDDEN, BATCH, LR = 4096, 16, 128, 32, 0.01
STARTED = time.time()  # (after the imports: a process's start is measured by the bench)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((SAMPLES, FEATURES)))
    y = torch.sin(x[:, :1]) + 0.1 * x[:, 1:2]
    return x, y


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                         nn.Tanh(), nn.Linear(HIDDEN, 1)).double()  # fmt: skip


def optimizer(params: list[Any]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def sampler() -> art.ElasticSampler:
    return art.ElasticSampler(SAMPLES, BATCH, seed=1)


def digest(net: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())
                          ).hexdigest()[:16]  # fmt: skip


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stop", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    x, y = data()
    net = model()
    optimizer(list(model().parameters()))  # (torch's first optimizer: see below)
    ready = time.time()
    comm = ar.init(timeout=60)  # (a spare waits in it to be told the slot it restarts)
    restart = int(os.environ.get("ASYNCREDUCE_RESTART", "0"))
    slot = int(os.environ["RANK"])
    say(event="start", slot=slot, restart=restart, t=STARTED)
    say(event="ready", slot=slot, restart=restart, t=ready)
    say(event="init", slot=slot, restart=restart, t=time.time())
    state = art.Elastic(net, comm, optimizer, sampler(), mode="backward")
    told = 0

    def train(state: art.Elastic) -> None:
        nonlocal told
        while True:
            indices = list(state.sampler)
            for start in range(0, len(indices), BATCH):
                batch = indices[start : start + BATCH]
                nn.functional.mse_loss(state.model(x[batch]), y[batch]).backward()
                state.optimizer.step()
                state.optimizer.zero_grad()
                state.commit()
                for what, when, world in state.changes[told:]:
                    say(event="change", slot=slot, what=what, t=when, world=world)
                told = len(state.changes)
                say(event="step", slot=slot, restart=restart, step=state.step,
                    world=state.comm.world_size, t=time.time(), digest=digest(net))  # fmt: skip
                stop = np.array([args.stop.exists()], np.int64)
                if state.comm.allreduce(stop, op="max", name="bench.stop")[0]:
                    return
            state.next_epoch()

    try:
        state.run(train)
    except ar.BrokenError as exc:  # (excluded: it was stopped or cut off too long)
        say(event="excluded", slot=slot, t=time.time(), why=str(exc)[:200])
        return 3
    params = [p.detach().numpy() for p in net.parameters()]
    np.savez(args.out / f"slot-{slot}-{restart}.npz", *params,
             history=np.array(state.history, np.int64).reshape(-1, 3))  # fmt: skip
    say(event="end", slot=slot, restart=restart, t=time.time(), step=state.step,
        digest=digest(net))  # fmt: skip
    state.close()
    state.comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
