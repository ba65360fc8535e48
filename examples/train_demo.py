"""The main job: data-parallel training, blocking against overlapped, on this machine.

Run with ``asyncreduce run -n 2 examples/train_demo.py`` (or ``bash scripts/demo.sh``). Every
rank trains the same MLP on its own shard of synthetic data for a few seconds in each mode;
rank 0 prints steps per second, the share of communication hidden behind computation, and
checks that every rank ends with bitwise identical parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np
import torch
from torch import nn

import asyncreduce as ar
import asyncreduce.torch as art
from asyncreduce.trace import Timeline


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def train(comm: ar.Communicator, mode: str, args: argparse.Namespace) -> tuple[float, float, str]:
    timeline = Timeline(comm)
    model = art.DataParallel(
        make_model(args.width, args.depth), comm, mode=mode, timeline=timeline,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()
    steps, start = 0, time.perf_counter()
    while True:
        loss_fn(model(x), y).backward()
        model.step()
        steps += 1
        done = np.array([time.perf_counter() - start > args.seconds], np.uint8)
        if comm.allreduce(done, "max", name=f"demo.{mode}.done")[0]:  # every rank stops together
            break
    model.synchronize()
    elapsed = time.perf_counter() - start
    timeline.write(f"{args.trace}/{mode}-rank{comm.rank}.json")
    flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:12]
    return steps / elapsed, model.stats()["hidden_share"], digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modes", default="blocking,backward,forward,double_buffer")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--trace", default="results/trace", help="folder for the timelines")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with ar.init() as comm:
        params = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
        if comm.rank == 0:
            mib = params * 4 / 2**20
            model = f"MLP {args.depth}x{args.width} ({params / 1e6:.1f}M parameters"
            print(f"{comm.world_size} ranks, {model}, {mib:.0f} MiB of gradients per step), "
                  f"batch {args.batch} per rank")  # fmt: skip
            print(f"{'mode':<14}{'steps/s':>9}{'vs blocking':>13}{'hidden':>8}  parameters")
        base = None
        for mode in args.modes.split(","):
            rate, hidden, digest = train(comm, mode, args)
            digests = comm.allgather(np.frombuffer(digest.encode(), np.uint8))
            same = "identical on every rank" if len({bytes(d) for d in digests}) == 1 else "DIFFER"
            base = base or rate
            if comm.rank == 0:
                print(f"{mode:<14}{rate:>9.1f}{rate / base:>12.2f}x{hidden:>8.0%}  {same}")
        if comm.rank == 0:
            print(
                f"timelines: {args.trace}/MODE-rankN.json (Chrome trace: open in ui.perfetto.dev)"
            )


if __name__ == "__main__":
    main()
