"""Keeping every rank's copy of the module the same: parameters at construction, buffers
(BatchNorm's running statistics, ...) at construction and before forwards, as DDP does.

Theory of operation. At construction every rank must wrap the same architecture (the names
and shapes of parameters, and of buffers when they are broadcast, are compared on every rank)
and then takes rank 0's values. Before a forward, ``BufferSync`` makes every buffer rank 0's,
under DDP's rule (``DistributedDataParallel._pre_forward``/``_post_forward``): a forward
broadcasts when the forward before it ran with gradients enabled and outside ``no_sync``, and
the first forward always does. All tensors of one device and dtype travel as one broadcast of
one flat tensor (a device's through its stager: the training thread moves no bytes between
host and device itself); they are written through ``.data``, so, as in DDP, their version
counters do not move.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..comm import Communicator
from ..errors import MismatchError
from .staging import stager_for

__all__ = ["BufferSync", "broadcast_tensors", "check_same_everywhere"]

_MAX_DIMS = 8


def check_same_everywhere(
    comm: Communicator, named: Sequence[tuple[str, torch.Tensor]], what: str
) -> None:
    """Every rank must wrap the same architecture: compare the names' shapes."""
    count = comm.allgather(np.array([len(named)], np.int64))
    if len(set(count.reshape(-1).tolist())) != 1:
        raise MismatchError(
            f"ranks wrap modules with different numbers of {what}s: {count.reshape(-1).tolist()}"
        )
    table = np.full((len(named), _MAX_DIMS + 1), -1, np.int64)
    for i, (_, t) in enumerate(named):
        table[i, 0] = t.dim()
        table[i, 1 : 1 + min(t.dim(), _MAX_DIMS)] = list(t.shape)[:_MAX_DIMS]
    everyone = comm.allgather(table)
    for i, (name, t) in enumerate(named):
        for rank, theirs in enumerate(everyone):
            if not np.array_equal(theirs[i], table[i]):
                shape = tuple(int(d) for d in theirs[i, 1 : 1 + theirs[i, 0]])
                raise MismatchError(
                    f"{what} {name!r} has shape {tuple(t.shape)} on rank {comm.rank} but "
                    f"{shape} on rank {rank}: every rank must wrap the same model"
                )


def broadcast_tensors(
    comm: Communicator, params: Sequence[torch.Tensor], name: str, root: int = 0
) -> None:
    """``root``'s values of ``params`` everywhere (blocking): one broadcast per device and dtype,
    of one flat tensor; a staged device's through its stager, so this thread moves no bytes
    between host and device and never synchronizes with one. Written through ``.data``: as in
    DDP, no version counter moves."""
    pending = []
    with torch.no_grad():
        for (device, dtype), group in _by_kind(params):
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            label = f"{name}.{device}.{str(dtype).removeprefix('torch.')}"
            stager = stager_for(comm, device)
            if stager is None:
                request: Any = comm.ibroadcast(flat.view(torch.uint8), root=root, name=label)
            else:
                request = stager.pooled_broadcast(flat, root, name=label)
            pending.append((request, flat, group))
        for request, flat, group in pending:
            request.wait()
            if comm.rank == root:
                continue  # (its tensors hold the values already)
            offset = 0
            for t in group:
                t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _by_kind(tensors: Sequence[torch.Tensor]
             ) -> list[tuple[tuple[torch.device, torch.dtype], list[torch.Tensor]]]:  # fmt: skip
    """The tensors by device and dtype, in an order every rank shares."""
    found: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        found.setdefault((t.device, t.dtype), []).append(t)
    return sorted(found.items(), key=lambda item: (str(item[0][0]), str(item[0][1])))


class BufferSync:
    """Rank 0's buffers on every rank before the forwards DDP would sync them before."""

    def __init__(self, comm: Communicator, module: nn.Module, prefix: str, enabled: bool) -> None:
        self._comm = comm
        self._module = module
        self._name = f"{prefix}.buffers"
        self.enabled = enabled
        self._due = True  # DDP's require_forward_param_sync: the first forward syncs

    def buffers(self) -> list[torch.Tensor]:
        return [b for _, b in self._module.named_buffers()]

    @property
    def due(self) -> bool:
        """Whether the next forward broadcasts (DDP's rule, see the module docstring)."""
        return self.enabled and self._due

    def before_forward(self, root: int = 0) -> None:
        """``root``: rank 0, or under ``join()`` the highest rank still training (DDP's)."""
        if self.due:
            self.broadcast(root)

    def broadcast(self, root: int) -> None:
        found = self.buffers()  # looked up each time: a buffer may have been reassigned
        if found:
            broadcast_tensors(self._comm, found, self._name, root)

    def after_forward(self, synced_backward: bool) -> None:
        self._due = torch.is_grad_enabled() and synced_backward
