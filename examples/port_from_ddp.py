"""A DDP training script, ported to asyncreduce.torch.DataParallel (docs/porting.md).

The same loop runs on PyTorch's DDP over Gloo (``--mode ddp``) or on asyncreduce in any of
its four modes, under ``asyncreduce run -n 2`` (or torchrun). It has what a real DDP script has:
a CNN with BatchNorm, a DataLoader with worker processes and a DistributedSampler, SGD with
momentum and a StepLR, gradient accumulation with ``no_sync()``, ``clip_grad_norm_``,
evaluation, and a checkpoint after every epoch that ``--resume`` continues from. Rank 0 prints
one line per epoch; the exact modes print what DDP prints.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import asyncreduce as ar
import asyncreduce.torch as art


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1))


def data(n: int, seed: int) -> TensorDataset:
    """Images whose label is which quadrant is brightest, with noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (n,), generator=g)
    for i, label in enumerate(y.tolist()):
        r, c = divmod(label, 2)
        x[i, 0, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] += 1.0
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", default="forward",
                        choices=["ddp", "blocking", "backward", "forward", "double_buffer"])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--checkpoint", default="results/port_from_ddp.pt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    # --- the only lines that differ from the DDP script --------------------------------------
    if args.mode == "ddp":
        dist.init_process_group("gloo")  # env:// from the launcher
        rank, world = dist.get_rank(), dist.get_world_size()
        model: Any = nn.parallel.DistributedDataParallel(Net().double())
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05,
                                                           momentum=0.9)  # fmt: skip
        total = dist.all_reduce
    else:
        comm = ar.init()
        rank, world = comm.rank, comm.world_size
        model = art.DataParallel(Net().double(), comm, mode=args.mode,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
        optimizer = model.optimizer  # one torch optimizer, in every mode
        total = comm.allreduce
    # ------------------------------------------------------------------------------------------

    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train_set, eval_set = data(256, seed=1), data(64, seed=2)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(train_set, batch_size=8, sampler=sampler, num_workers=2)
    eval_loader = DataLoader(eval_set, batch_size=16,
                             sampler=DistributedSampler(eval_set, world, rank, shuffle=False))
    clip = args.mode not in ("forward", "double_buffer")  # they send gradients during backward
    first = 0
    if args.resume and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        if saved["wrapper"] is not None:
            model.load_wrapper_state_dict(saved["wrapper"])
        first = saved["epoch"] + 1

    for epoch in range(first, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(1, dtype=torch.float64)
        for i, (x, y) in enumerate(loader):
            accumulate = i % 2 == 0  # two micro-batches per optimizer step
            with model.no_sync() if accumulate else contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y) / 2
                loss.backward()
            loss_sum += loss.detach()
            if accumulate:
                continue
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=20.0)
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()

        if args.mode != "ddp":
            model.synchronize()  # parameters final before evaluation (forward, double_buffer)
        model.eval()
        right = torch.zeros(2, dtype=torch.float64)  # correct, seen
        with torch.no_grad():
            for x, y in eval_loader:
                right += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
        total(right)
        total(loss_sum)
        if rank == 0:
            mean = 2 * loss_sum.item() / (world * len(loader))  # each micro-batch's loss was / 2
            print(f"epoch {epoch + 1}: train loss {mean:.4f}, "
                  f"eval accuracy {right[0].item() / right[1].item():.4f}")  # fmt: skip
            wrapper = model.wrapper_state_dict() if args.mode != "ddp" else None
            torch.save({"epoch": epoch, "model": model.state_dict(), "wrapper": wrapper,
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, args.checkpoint)  # fmt: skip


if __name__ == "__main__":
    main()
