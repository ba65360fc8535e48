"""Training that goes on when a rank dies (docs/elastic.md): a small regression, 4 ranks, and
one of them (``--kill-rank``) SIGKILLs itself in the middle of a backward pass at
``--kill-step``; the others agree on who remains, take the new rank 0's state and finish the
epochs with the samples that were left, re-sharded.

    asyncreduce run -n 4 --elastic examples/elastic.py --kill-rank 2 --kill-step 5

With ``--max-restarts 1`` the launcher starts rank 2 again, and it rejoins at a step boundary.
Every rank that finishes prints the same final loss and parameter digest.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import asyncreduce as ar
import asyncreduce.torch as art


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((512, 6)))
    y = x @ torch.linspace(-1, 1, 6, dtype=torch.float64).reshape(6, 1) + 0.1
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).double()

    comm = ar.init()
    sampler = art.ElasticSampler(len(x), batch_size=8, seed=1)
    state = art.Elastic(net, comm, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                        sampler, mode="backward")  # fmt: skip
    if comm.rank == args.kill_rank and comm.admission is None:  # (a first start) dies once
        # the last layer's gradient went out
        def die(grad: torch.Tensor) -> None:
            if state.step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)

        net[0].weight.register_hook(die)

    def train(state: art.Elastic) -> float:
        loss = torch.zeros(())
        while state.epoch < args.epochs:
            for batch in _batches(list(state.sampler), 8):
                loss = F.mse_loss(state.model(x[batch]), y[batch])
                loss.backward()
                state.optimizer.step()
                state.optimizer.zero_grad()
                state.commit()
            state.next_epoch()
        return float(loss.detach())

    loss = state.run(train)
    mean = state.comm.allreduce(np.array([loss]), op="avg")[0]  # (the last step's, over ranks)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters()))
    print(f"{state.step} steps on {state.comm.world_size} ranks after {state.recoveries} "
          f"recoveries and {state.rejoins} rejoins; last loss {mean:.6f}; parameters "
          f"{digest.hexdigest()[:16]}", flush=True)  # fmt: skip
    state.close()
    state.comm.close()


def _batches(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


if __name__ == "__main__":
    main()
