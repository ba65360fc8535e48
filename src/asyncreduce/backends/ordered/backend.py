"""The ordered backend: a communicator's operations as ``Posted`` ones for an ordered engine.

Theory of operation. An engine that needs one order of collectives on every rank (MPI,
torch.distributed) runs our key-matched operations once every rank posted them (engine.py,
agreement.py). What the communicator hands over is checked against what the engine's adapter
takes (its dtypes and reductions, the largest tag, a priority of 64 bits: ``refusal``) before
the operation is numbered, so a call it cannot run raises UsageError in the caller's thread on
every rank alike, and a rank that refused one keeps its keys in step with those that did not.
The operation then goes to the engine's thread as the caller's memory itself (a flat array, or
a CUDA tensor where the adapter takes them as they are: ``devices``); no algorithm is built
here, the engine's own runs. Groups are not offered (make the sub-communicator in the engine).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import UsageError
from ...keys import Key
from ...plans import Plan
from ...protocol.wire import ON_DEVICE
from ...request import Request
from ...samehost.planes import DataPlane, SharedPlanes
from ..common import EngineBackend, log_post
from .engine import OrderedEngine
from .posted import Posted

__all__ = ["OrderedBackend"]


class OrderedBackend(EngineBackend):
    """A communicator over a started ``OrderedEngine`` (its adapter is made)."""

    def __init__(self, engine: OrderedEngine) -> None:
        self.engine = self.ordered = self._runs = engine
        self.rank = engine.rank
        self.members = tuple(range(engine.world_size))
        self.planes = SharedPlanes(False, None)
        adapter = engine.adapter
        self.devices = bool(getattr(adapter, "devices", False))
        self._refuses = getattr(adapter, "refuses", None)
        self._max_tag: int | None = getattr(adapter, "max_tag", None)

    def refusal(self, plan: Plan, priority: int) -> str | None:
        why = self._refuses(plan.kind, plan.buf.dtype, plan.op) if self._refuses else None
        if why is not None:
            return f"{plan.kind}: {why}"
        most = self._max_tag
        if plan.tag is not None and most is not None and plan.tag > most:
            return f"tag={plan.tag} is above what this engine takes ({most})"
        if not -(1 << 63) <= priority < 1 << 63:
            return f"priority must fit in 64 bits, got {priority}"
        return None

    def submit(
        self, plan: Plan, key: Key, label: str, priority: int, timeout: float | None,
        request: Request[Any],
    ) -> None:  # fmt: skip
        """Hand ``plan`` to the engine: it runs there as an engine call once every rank
        posted it."""
        buf = plan.buf
        code = buf.dtype.code + (ON_DEVICE if not isinstance(buf.flat, np.ndarray) else 0)
        desc = plan.descriptor(plan.root, code)
        log_post(self.rank, label, desc)
        self.engine.submit(Posted(key, label, desc, request, plan.result, timeout, plan.kind,
                                  buf.flat, buf.dtype, plan.op, plan.root, priority, plan.sends,
                                  plan.recvs, plan.tag))  # fmt: skip

    def group(self, members: tuple[int, ...]) -> OrderedBackend:
        raise UsageError("groups are not offered over backend='mpi' or 'torch' in this "
                         "release: make the sub-communicator there (MPI Comm.Split, "
                         "torch's new_group) and init a communicator on it")  # fmt: skip

    @property
    def data_plane(self) -> DataPlane:
        adapter = self.engine.adapter
        assert adapter is not None  # the engine made it before it started
        control = type(adapter.endpoint).__name__.replace("Endpoint", "").lower()
        return DataPlane(adapter.name, control=control)
