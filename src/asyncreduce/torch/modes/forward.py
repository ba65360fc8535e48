"""``forward``: each layer's update is applied just before that layer's next forward.

Theory of operation. There is one bucket per layer (the module that owns the parameters),
the layers nearest the input first in priority, since the next forward needs them first.
Nothing waits in backward or in ``step()``: ``step()`` closes the step, making each bucket's
post its pending update together with the hyper-parameters (lr, momentum, ...) that
``step()`` saw, and a forward pre-hook on the layer waits for that allreduce and steps the
layer's parameters alone with them (``DataParallelOptimizer.step_subset``). Communication
thus overlaps the rest of backward and the next forward, and ``p.grad`` still holds this
rank's own gradient after backward.

* A layer whose parameters its parent uses without the layer itself running
  (MultiheadAttention's ``out_proj``) gets its update from the pre-hook of the nearest
  ancestor that ran in the first forward (``watch_forward``).
* A bucket about to be sent again with its update still pending (its layer did not run since
  its last step) applies that update first. A parameter whose gradient arrives while its
  update is pending was used before its layer ran: an error, since it was used stale.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...errors import UsageError
from ..buckets import Bucket, Group, layer_groups
from ..reducer import Reducer
from .base import Mode, make_pending, refuse_changed_gradients

__all__ = ["Forward", "apply_update"]


class Forward(Mode):
    """Apply each layer's update in its forward pre-hook (see the module docstring)."""

    name = "forward"

    def __init__(self) -> None:
        self._first_forward = True  # see watch_forward

    def groups(self, module: nn.Module, params: list[nn.Parameter], bucket_bytes: int
               ) -> list[Group]:  # fmt: skip
        return layer_groups(module)

    def priority(self, index: int, count: int) -> int:
        return count - index  # nearest the input first

    def install_hooks(self, reducer: Reducer) -> list[Any]:
        me = weakref.ref(reducer)  # hooks must not keep its buffers alive past the wrapper
        holders = _holders(reducer.module)
        hooks = []
        for bucket in reducer.buckets:
            modules = {id(m): m for p in bucket.params for m in holders[id(p)]}
            for module in modules.values():
                hooks.append(_hook_layer(module, _LayerHook(me, bucket)))
        return hooks

    def watch_forward(self, reducer: Reducer) -> Callable[[], None] | None:
        """The first forward: note which modules run. A layer whose parameters are used by
        its parent without the layer itself running gets its update from the pre-hook of the
        nearest ancestor that ran instead."""
        if not self._first_forward:
            return None
        self._first_forward = False
        ran: set[int] = set()
        watching = [m.register_forward_pre_hook(lambda m, a: ran.add(id(m)))
                    for m in reducer.module.modules()]  # fmt: skip
        me = weakref.ref(reducer)

        def settle() -> None:
            for hook in watching:
                hook.remove()
            parents = _parents(reducer.module)
            holders = _holders(reducer.module)
            for bucket in reducer.buckets:
                layers = {id(m): m for p in bucket.params for m in holders[id(p)]}
                if ran & set(layers):
                    continue
                ancestor = next(iter(layers.values()))
                while id(ancestor) not in ran and id(ancestor) in parents:
                    ancestor = parents[id(ancestor)]
                reducer.hooks.append(_hook_layer(ancestor, _LayerHook(me, bucket)))

        return settle

    def used_while_pending(self, reducer: Reducer, param: torch.Tensor) -> None:
        raise UsageError(
            f"{reducer.names[id(param)]!r} was used in this forward while the update of its "
            "last step was still pending: mode='forward' applies a layer's update just "
            "before that layer (the module that owns the parameter) runs, and it did not "
            "run before this use. Use the parameter only inside its own module's forward, "
            "or use mode='backward'"
        )

    def before_post(self, reducer: Reducer, bucket: Bucket) -> None:
        apply_update(reducer, bucket)  # its layer did not run since its last step

    def step(self, reducer: Reducer, closure: Callable[[], float] | None) -> Any:
        """This step's gradients become the pending updates, with the hyper-parameters in
        force now (the previous ones were all applied before their buckets were sent again)."""
        refuse_changed_gradients(reducer)
        previous = make_pending(reducer, reducer.optimizer.snapshot())
        assert not any(previous), "forward mode left an update unapplied"
        return None

    def synchronize(self, reducer: Reducer) -> None:
        for bucket in reducer.buckets:
            apply_update(reducer, bucket)


def apply_update(reducer: Reducer, bucket: Bucket) -> None:
    """The bucket's pending update, stepped by itself with its recorded hyper-parameters;
    ``p.grad`` is left as it was."""
    update, bucket.update = bucket.update, None
    if update is None:
        return
    grads = reducer.gradients(bucket, update)
    saved = [p.grad for p in bucket.params]
    for p, g in zip(bucket.params, grads, strict=True):
        p.grad = g
    try:
        reducer.optimizer.step_subset(bucket.params, update.hyper)
    finally:
        for p, g in zip(bucket.params, saved, strict=True):
            p.grad = g


class _LayerHook:
    """The pre-hook of one layer: its pending update, just before it runs."""

    def __init__(self, reducer: weakref.ref[Reducer], bucket: Bucket) -> None:
        self._reducer = reducer
        self._bucket = bucket

    def __call__(self, module: nn.Module, args: Any) -> None:
        reducer = self._reducer()
        if reducer is not None and self._bucket.update is not None:
            apply_update(reducer, self._bucket)


def _holders(module: nn.Module) -> dict[int, list[nn.Module]]:
    """{id(parameter): every module holding it directly} (a tied weight has several)."""
    found: dict[int, list[nn.Module]] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            found.setdefault(id(p), []).append(sub)
    return found


def _parents(module: nn.Module) -> dict[int, nn.Module]:
    """{id(child): its parent} (a module used in two places: its first parent)."""
    found: dict[int, nn.Module] = {}
    for parent in module.modules():
        for child in parent.children():
            found.setdefault(id(child), parent)
    return found


def _hook_layer(module: nn.Module, hook: _LayerHook) -> Any:
    """Before every other pre-hook (weight_norm's computes the weight from the parameters)."""
    return module.register_forward_pre_hook(hook, prepend=True)
