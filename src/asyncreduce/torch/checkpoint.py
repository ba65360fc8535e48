"""The wrapper's own share of a checkpoint: the updates still pending, by parameter name.

Theory of operation. In ``forward`` and ``double_buffer`` modes a step's averaged gradients
are applied after ``step()``, so at any point some updates are pending in the buckets
(``Bucket.update``). ``pending_state`` waits for them and saves the averages by parameter
name, with the hyper-parameters they are to be applied with; ``load_pending_state`` puts them
back into the buckets of a fresh wrapper of the same mode, before its first backward. With
``model.state_dict()`` and ``model.optimizer.state_dict()`` saved at the same point, a run
resumed from the three continues exactly where the saved one goes on. The other modes leave
nothing pending, so their state is empty.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from .buckets import Update
from .reducer import Reducer

__all__ = ["load_pending_state", "pending_state"]


def pending_state(reducer: Reducer) -> dict[str, Any]:
    """``wrapper_state_dict()``: the pending updates, averaged (waiting for their allreduces)."""
    pending: dict[str, torch.Tensor | None] = {}
    hyper = None
    for b in reducer.buckets:
        if b.update is None:
            continue
        grads = reducer.gradients(b, b.update)
        hyper = b.update.hyper if b.update.hyper is not None else hyper
        for p, g in zip(b.params, grads, strict=True):
            pending[reducer.names[id(p)]] = None if g is None else g.detach().clone()
    return {"mode": reducer.mode, "pending": pending, "hyper": hyper}


def load_pending_state(reducer: Reducer, state: dict[str, Any]) -> None:
    """``load_wrapper_state_dict()``: what ``pending_state`` saved, pending again."""
    pending: dict[str, torch.Tensor | None] = state.get("pending", {})
    if not pending:
        return
    if state.get("mode") != reducer.mode:
        raise UsageError(
            f"this checkpoint holds updates still pending in mode={state.get('mode')!r}; "
            f"they cannot be applied in mode={reducer.mode!r}. Call synchronize() before "
            "saving to move a run between modes"
        )
    if any(b.update is not None or b.inflight is not None for b in reducer.buckets):
        raise UsageError("load_wrapper_state_dict must come before the first backward")
    unknown = set(pending) - {reducer.names[id(p)] for p in reducer.params}
    if unknown:
        raise UsageError(f"the checkpoint's pending updates name {sorted(unknown)}, "
                         "which this model's trainable parameters do not")  # fmt: skip
    for b in reducer.buckets:
        names = [reducer.names[id(p)] for p in b.params]
        if any(n in pending for n in names):
            grads = [_restored(pending.get(n), p) for n, p in zip(names, b.params, strict=True)]
            b.update = Update(None, None, grads, state.get("hyper"))


def _restored(grad: torch.Tensor | None, param: nn.Parameter) -> torch.Tensor | None:
    if grad is None:
        return None
    if grad.shape != param.shape:
        raise UsageError(f"a pending update of shape {tuple(grad.shape)} for a parameter of "
                         f"shape {tuple(param.shape)}: not this model's checkpoint")  # fmt: skip
    return grad.to(device=param.device, dtype=param.dtype)
