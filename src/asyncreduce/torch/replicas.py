"""Keeping every rank's copy of the module the same: parameters at construction, buffers
(BatchNorm's running statistics, ...) at construction and before forwards, as DDP does.

Theory of operation. At construction every rank must wrap the same architecture (the names
and shapes of parameters, and of buffers when they are broadcast, are compared on every rank)
and then takes rank 0's values. Before a forward, ``BufferSync`` makes every buffer rank 0's,
under DDP's rule (``DistributedDataParallel._pre_forward``/``_post_forward``): a forward
broadcasts when the forward before it ran with gradients enabled and outside ``no_sync``, and
the first forward always does. All buffers of one device travel as one broadcast of their
bytes, whatever their dtypes; they are written through ``.data``, so, as in DDP, their version
counters do not move.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from ..comm import Communicator
from ..errors import MismatchError

__all__ = ["BufferSync", "broadcast_parameters", "check_same_everywhere"]

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


def broadcast_parameters(
    comm: Communicator, params: list[nn.Parameter], name: str, root: int = 0
) -> None:
    """``root``'s values everywhere (blocking), each tensor broadcast as its bytes, in place
    on the CPU (no copy), through a host copy elsewhere."""
    with torch.no_grad():
        hosts = [_bytes_of(p.data if p.device.type == "cpu" else p.detach().cpu()) for p in params]
        requests = [
            comm.ibroadcast(h, root=root, name=f"{name}{i}") for i, h in enumerate(hosts)
        ]
        for r in requests:
            r.wait()
        for p, h in zip(params, hosts, strict=True):
            if p.device.type != "cpu" or not p.is_contiguous():
                _write_bytes(p, torch.from_numpy(h))


def broadcast_bytes(
    comm: Communicator, tensors: list[torch.Tensor], name: str, root: int = 0
) -> None:
    """``root``'s contents of ``tensors`` everywhere: one broadcast per device, of their bytes."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, group in sorted(by_device.items(), key=lambda item: str(item[0])):
        with torch.no_grad():
            flat = torch.cat([torch.from_numpy(_bytes_of(t.data.cpu())) for t in group])
            comm.broadcast(flat.numpy(), root=root, name=f"{name}.{device}")
            offset = 0
            for t in group:
                n = t.numel() * t.element_size()
                _write_bytes(t, flat[offset : offset + n])
                offset += n


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a flat uint8 array (its own memory where it is contiguous)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _write_bytes(t: torch.Tensor, raw: torch.Tensor) -> None:
    """Set ``t`` (any device, through ``.data``: no version bump) from its bytes ``raw``."""
    target = t.data if t.is_contiguous() else t.data.contiguous()
    target.reshape(-1).view(torch.uint8).copy_(raw)
    if target.data_ptr() != t.data.data_ptr():
        t.data.copy_(target)


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
            broadcast_bytes(self._comm, found, self._name, root)

    def after_forward(self, synced_backward: bool) -> None:
        self._due = torch.is_grad_enabled() and synced_backward
