"""Control-channel slots over our own native engine (TCP or shared memory, key-matched).

torch.distributed cannot carry the control channel itself: a Gloo point-to-point work says it
is complete only once somebody blocks in ``wait`` (measured: ``is_completed`` stays False),
and a receive posted on an NCCL communicator would stall the collectives queued behind it. So
over ``backend="torch"`` the agreement travels here, on a native communicator the ranks build
in the torch job's store; over ``backend="mpi"`` it may, for comparison (ASYNCREDUCE_CONTROL).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

__all__ = ["NativeEndpoint", "PointToPoint"]

_TAG = 1 << 40  # far from any tag a user of the same native communicator would pick


class PointToPoint(Protocol):
    """What the endpoint needs of a native communicator (``Communicator`` is one): its tagged
    point-to-point operations, and a close. A protocol, so this level never imports comm."""

    def isend(self, x: Any, dst: int, *, tag: int = 0) -> Any: ...

    def irecv(self, x: Any, src: int, *, tag: int = 0) -> Any: ...

    def close(self) -> None: ...


class NativeEndpoint:
    """Fixed 512-byte slots as native point-to-point operations (their counts must match)."""

    slot = 512
    exact = True

    def __init__(self, native: PointToPoint, to_native: Callable[[int], int]) -> None:
        self.native = native
        self.to_native = to_native  # a rank of the ordered communicator -> the native one

    def isend(self, peer: int, data: bytes) -> Any:
        return self.native.isend(np.frombuffer(data, np.uint8), self.to_native(peer), tag=_TAG), 0

    def irecv(self, peer: int, buffer: bytearray) -> Any:
        request = self.native.irecv(np.frombuffer(buffer, np.uint8), self.to_native(peer), tag=_TAG)
        return request, self.slot

    def test(self, handle: Any) -> int | None:
        request, size = handle
        if not request.done():
            return None
        request.result()  # raises what failed (a lost peer, a broken communicator)
        return int(size)

    def cancel(self) -> None:
        self.native.close()
