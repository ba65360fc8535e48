"""The rows of ``bench gpu`` and how one rank builds each (shared by the parent and the ranks).

Every training row trains the same model from the same seed on the same fixed batch per rank,
with SGD (momentum 0.9), for the same number of steps, so the digests of the final
parameters compare bit for bit:

* ``blocking``, ``backward``, ``forward``, ``double_buffer``: ``asyncreduce.torch.DataParallel``
  in that mode over ``ar.init()`` (the native engine; CUDA buckets staged through pinned host
  memory);
* ``ddp_gloo``: PyTorch DDP over the Gloo default group, on the same (CUDA) tensors;
* ``ddp_nccl``: DDP over an NCCL group; ``dp_nccl``: DataParallel (backward mode) over
  ``ar.init(backend="torch")`` on that NCCL group; both only where every rank has a GPU of its
  own and there are at least 2;
* ``ddp_asyncreduce``: DDP over a group of the "asyncreduce" torch backend;
* ``ceiling``: the module alone with its optimizer, every rank computing, no allreduce at all.

This module imports torch only inside its functions, so the parent's ``--help`` needs none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LABELS",
    "MODES",
    "ROWS",
    "STANDIN",
    "Trainer",
    "agree",
    "dataset",
    "error_text",
    "make_trainer",
    "skipped_why",
]

MODES = ("blocking", "backward", "forward", "double_buffer")
ROWS = (*MODES, "ddp_gloo", "ddp_nccl", "dp_nccl", "ddp_asyncreduce", "ceiling")
LABELS = {
    "blocking": "DataParallel blocking",
    "backward": "DataParallel backward",
    "forward": "DataParallel forward",
    "double_buffer": "DataParallel double_buffer",
    "ddp_gloo": "DDP over Gloo",
    "ddp_nccl": "DDP over NCCL",
    "dp_nccl": "DataParallel over torch/NCCL",
    "ddp_asyncreduce": "DDP over asyncreduce",
    "ceiling": "no communication (ceiling)",
}
EXACT = ("blocking", "backward", "forward")  # bit for bit equal to DDP over Gloo (2 ranks)
STANDIN = "stand-in, not a GPU"
SEED = 0
LR, MOMENTUM = 0.01, 0.9


@dataclass
class Trainer:
    """One row ready to train: ``step`` is one iteration, ``finish`` applies what is still in
    flight, ``params`` the module's parameters, ``dp`` the DataParallel wrapper if any."""

    step: Callable[[], None]
    finish: Callable[[], None]
    params: Callable[[], list[Any]]
    dp: Any = None


def skipped_why(key: str, env: Any) -> str | None:
    """Why row ``key`` cannot run on this machine (None: it runs)."""
    if key not in ("ddp_nccl", "dp_nccl"):
        return None
    if env.standin is not None:
        return f"needs 2 GPUs ({STANDIN})"
    import torch
    import torch.distributed as dist

    count = torch.cuda.device_count()
    if count < 2:
        return "needs 2 GPUs"
    if count < env.size:
        return f"needs a GPU per rank ({count} GPUs, {env.size} ranks)"
    if not dist.is_nccl_available():
        return "this PyTorch build has no NCCL"
    return None


def dataset(env: Any) -> tuple[Any, Any]:
    """This rank's fixed batch, the same for every row (so the digests compare)."""
    import gpu_models

    s = env.settings
    return gpu_models.batch(s["model"], s["batch"], seed=1000 + env.rank, device=env.device)


def _sgd(params: list[Any]) -> Any:
    import torch

    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _usable(value: Any, what: str) -> Any:
    """A group or communicator made at the start, or the error that made it fail."""
    if isinstance(value, str) or value is None:
        raise RuntimeError(f"{what}: {value or 'not made'}")
    return value


def make_trainer(env: Any, key: str) -> Trainer:
    """Row ``key`` on this rank: the model from ``SEED`` on the device, wrapped."""
    import torch

    import gpu_models

    module, source = gpu_models.build(env.settings["model"], SEED)
    env.tell("model", label=source)
    module = module.to(env.device)
    x, y = dataset(env)
    loss = torch.nn.CrossEntropyLoss()
    params = lambda: list(module.parameters())  # noqa: E731
    if key in MODES or key == "dp_nccl":
        import asyncreduce.torch as art

        comm = env.comm if key in MODES else _usable(env.nccl_comm, "ar.init(backend='torch')")
        dp = art.DataParallel(module, comm, optimizer=_sgd, mode=key if key in MODES else
                              "backward")  # fmt: skip

        def dp_step() -> None:
            loss(dp(x), y).backward()
            dp.step()

        return Trainer(dp_step, dp.synchronize, params, dp)
    wrapped = module if key == "ceiling" else _ddp(env, key, module)
    optimizer = _sgd(list(wrapped.parameters()))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss(wrapped(x), y).backward()
        optimizer.step()

    return Trainer(step, lambda: None, params)


def _ddp(env: Any, key: str, module: Any) -> Any:
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = None  # the default group: Gloo
    if key == "ddp_nccl":
        group = _usable(env.groups.get("nccl"), "the NCCL group")
    elif key == "ddp_asyncreduce":
        group = _usable(env.groups.get("asyncreduce"), "the asyncreduce process group")
    ids = None if env.device.type == "cpu" else [env.device.index]
    return DDP(module, device_ids=ids, process_group=group)


def agree(error: str | None) -> str | None:
    """The first error any rank had in this phase (every rank calls it), else None."""
    import torch.distributed as dist

    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, error)
    for rank, found in enumerate(everyone):
        if found:
            return f"rank {rank}: {found}"
    return None


def error_text(exc: BaseException) -> str:
    """The first line of what ``exc`` says, at most 300 characters: one row's error."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text[:300]
