"""The one public optimizer of a ``DataParallel``, in every mode.

Theory of operation. The user's factory makes one torch optimizer over all of the module's
parameters (``inner``), exactly the optimizer a DDP script builds over ``ddp.parameters()``, so
its ``state_dict()`` has that layout and checkpoints move between our modes and to and from
plain DDP. ``DataParallelOptimizer`` stands in front of it:

* ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's, so torch's LR
  schedulers drive it like any other (they check ``isinstance(opt, torch.optim.Optimizer)``,
  read and write ``param_groups`` and wrap ``opt.step`` to see that it is called).
* ``step()`` is the wrapper's ``step()``: what the mode says, then the gradients are cleared.
  Calling either one is the same; a scheduler stepped after it sees the call.
* ``torch.amp.GradScaler``: in blocking and backward mode ``p.grad`` holds the average when
  ``backward()`` returns, so ``unscale_``, its inf/NaN check and the skipped step are DDP's
  (every rank sees the same average, so every rank skips alike). Its fused path sets
  ``grad_scale`` and ``found_inf`` on the optimizer for its step to read: they are passed to
  the inner optimizer. Where updates are applied later (forward, double_buffer) the scaler
  would unscale and check this rank's own gradient while the average, sent during backward
  and still scaled, is applied later, and ranks could skip different steps: it is refused.
  The hook is ``_step_supports_amp_scaling``, the first thing ``GradScaler.step`` reads from
  the optimizer, with ``getattr(..., False)``, which lets any error but AttributeError
  through: it raises UsageError there, before the optimizer is stepped or its gradients are
  unscaled by ``step`` (an explicit ``unscale_`` before it has changed only this rank's own
  ``p.grad``, which was already sent). The attribute is GradScaler's contract with
  optimizers: nothing else reads it.
* ``step_subset`` lets forward mode update one layer at a time with the same inner optimizer:
  each group's ``params`` is narrowed to that layer's parameters for one inner ``step()`` and
  restored (optimizer state is kept per parameter, so a subset step is the whole step of those
  parameters), with the hyper-parameters (lr, momentum, ...) in effect when the user called
  ``step()`` for those gradients, recorded by ``snapshot()``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ClosedError, UsageError

__all__ = ["DataParallelOptimizer", "Hyper"]

Hyper = list[dict[str, Any]]  # per param group: every entry but "params", as step() saw it
_PASSED_ON = frozenset({"grad_scale", "found_inf"})  # GradScaler's, for the inner step to read


class DataParallelOptimizer(torch.optim.Optimizer):
    """``model.optimizer``: the inner optimizer's groups and state, the wrapper's ``step``."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        step: weakref.WeakMethod[Callable[[Any], Any]],
        deferred: bool,
    ) -> None:
        # Optimizer.__init__ is not called on purpose: groups, state and hooks are the inner
        # optimizer's, looked up on it every time (load_state_dict replaces its groups). The
        # wrapper's step is held weakly, so the wrapper is freed (and unhooked) once dropped.
        # ``deferred``: updates are applied after step() returns (forward, double_buffer).
        self._inner = inner
        self._wrapper_step = step
        self._deferred = deferred
        self._plans: dict[tuple[int, ...], list[list[torch.Tensor]]] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PASSED_ON:
            setattr(self._inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _PASSED_ON:
            delattr(self._inner, name)
        else:
            object.__delattr__(self, name)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a DataParallel's optimizer is not picklable (it steps through its wrapper): "
            "save model.optimizer.state_dict() and load it into the optimizer of the "
            "resumed run"
        )

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """GradScaler.step asks whether it may take the fused path (see the module docstring):
        the inner optimizer's answer, or UsageError where updates are applied later."""
        if self._deferred:
            raise UsageError(_scaler_refused(self._mode_name()))
        return bool(getattr(self._inner, "_step_supports_amp_scaling", False))

    def _mode_name(self) -> str:
        wrapper = getattr(self._wrapper_step(), "__self__", None)
        return str(getattr(wrapper, "mode", "forward or double_buffer"))

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer the factory made (step it only through this object)."""
        return self._inner

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self._inner.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self._inner.state

    @state.setter
    def state(self, state: Any) -> None:
        self._inner.state = state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self._inner.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self._inner.defaults = defaults

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """The wrapper's ``step()`` (see ``DataParallel.step``)."""
        step = self._wrapper_step()
        if step is None:
            raise ClosedError("step: the DataParallel of this optimizer is gone")
        return step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UsageError(
            "add_param_group on a DataParallel's optimizer: its parameters are fixed when the "
            "model is wrapped; build the groups in the optimizer factory instead"
        )

    def __getattr__(self, name: str) -> Any:
        # hooks and anything else torch's Optimizer offers: the inner optimizer's (in forward
        # mode step hooks then run once per layer, seeing that layer's parameters only)
        if name.startswith("__") or name in ("_inner", "_deferred"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"DataParallelOptimizer({self._inner!r})"

    # ---- for the wrapper -------------------------------------------------------------------

    def snapshot(self) -> Hyper:
        """Every group's hyper-parameters now (tensors copied: schedulers fill them in place)."""
        return [
            {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items()
             if k != "params"}
            for g in self._inner.param_groups
        ]  # fmt: skip

    def step_inner(self, closure: Callable[[], float] | None = None) -> Any:
        """One step of the inner optimizer over every parameter that has a gradient."""
        return self._inner.step(closure) if closure is not None else self._inner.step()

    def step_subset(self, params: Sequence[torch.Tensor], hyper: Hyper | None) -> None:
        """Step only ``params`` (with ``hyper`` in force, if given); the groups are restored."""
        groups = self._inner.param_groups
        subsets = self._plan(params)
        saved = [(g["params"], {k: g[k] for k in h} if hyper else {}) for g, h in
                 zip(groups, hyper or [{}] * len(groups), strict=True)]  # fmt: skip
        try:
            for g, subset, h in zip(groups, subsets, hyper or [{}] * len(groups), strict=True):
                g["params"] = subset
                g.update(h)
            self._inner.step()
        finally:
            for g, (members, values) in zip(groups, saved, strict=True):
                g["params"] = members
                g.update(values)

    def _plan(self, params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per group, the members of ``params`` in it (cached per layer and group lists)."""
        groups = self._inner.param_groups
        key = (id(params), *(id(g["params"]) for g in groups))
        plan = self._plans.get(key)
        if plan is None:
            wanted = {id(p) for p in params}
            plan = [[p for p in g["params"] if id(p) in wanted] for g in groups]
            self._plans[key] = plan
        return plan


def _scaler_refused(mode: str) -> str:
    return (
        f"torch.amp.GradScaler cannot step a DataParallel in mode={mode!r}: the scaler "
        "unscales p.grad and skips the step where it finds an inf or NaN there, but in this "
        "mode p.grad is this rank's own gradient, while the average (sent during backward, "
        "still scaled) is applied after step() returns, so the update would not be unscaled "
        "and ranks could skip different steps. This step changed no parameter. Use "
        "mode='backward' or mode='blocking' (p.grad holds the average when backward() "
        "returns, as under DDP), or train without the scaler (bfloat16 autocast needs none; "
        "GradScaler(enabled=False) is accepted in every mode)"
    )
