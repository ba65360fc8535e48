"""The backends a communicator runs its operations on (the interface: base.py).

``native.py``: our own engine (``local.py``: a world of one); ``ordered/backend.py``:
the engines that need one order on every rank (MPI, torch.distributed). ``backend_for`` picks
the one for the engine a communicator is built over.
"""

from __future__ import annotations

from ..engine import Engine
from ..samehost.cma import CrossMemory
from ..samehost.planes import SharedPlanes
from .base import Backend
from .local import LocalBackend
from .native import NativeBackend
from .ordered.backend import OrderedBackend
from .ordered.engine import OrderedEngine

__all__ = ["Backend", "backend_for"]


def backend_for(
    engine: Engine | OrderedEngine | Backend | None, rank: int, world_size: int,
    one_host: bool = False, cross: CrossMemory | None = None,
) -> Backend:  # fmt: skip
    """The backend over ``engine`` (None: a world of one; a backend: itself) for ``rank`` of
    ``world_size``; ``one_host`` and ``cross``: the native engine's same-host memory."""
    if engine is None:
        return LocalBackend()
    if isinstance(engine, Engine):
        return NativeBackend(engine, rank, world_size,
                             SharedPlanes(one_host, cross, world_size))  # fmt: skip
    if isinstance(engine, OrderedEngine):
        return OrderedBackend(engine)
    return engine
