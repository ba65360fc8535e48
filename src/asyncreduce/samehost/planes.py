"""Same-host data planes: which memory an allreduce reads its peers' data from.

Theory of operation. Where every rank is on this host, a large allreduce need not send its
payload: each rank reads the peers' buffers in place (algorithms/shared.py). It does so from a
shared window, when the caller's buffer lies in one (``shared_empty``, window.py), or else by
cross-memory attach (cma.py), when every rank could read every peer at init and the buffer is
at least ``CROSS_MEMORY_BYTES``. Small allreduces (up to ``SMALL_ALLREDUCE_BYTES``) take
recursive doubling whatever the memory. The choice travels in the descriptor's ``root``
(the window's number, or ``CROSS_MEMORY``), so every rank runs the same algorithm or the
operation fails with a MismatchError.

A group reads the same memory as its communicator, with the peers renumbered to its ranks;
its windows are its own (``shared_empty`` on the group). ``DataPlane`` is what a
communicator tells its users about all this (``Communicator.data_plane``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..algorithms import (
    CROSS_MEMORY,
    CROSS_MEMORY_BYTES,
    SMALL_ALLREDUCE_BYTES,
    Array,
    PeerMemory,
    RenumberedMemory,
)
from ..kernels.pool import CorePool, pool_size
from .cma import CrossMemory
from .window import Windows

__all__ = ["DataPlane", "SharedPlanes"]


@dataclass(frozen=True)
class DataPlane:
    """Which data plane a communicator's operations use (``Communicator.data_plane``).

    ``engine``: what runs them: "native" (our own engine), "mpi", "torch (nccl)", "torch
    (gloo)", ..., or "local" (a world of one: nothing is sent). ``shared_memory``: every peer
    is reached through shared-memory arenas (the native engine, every rank on this host;
    otherwise the payload goes over TCP, or over the ordered engine's own transport).
    ``cross_memory``: large allreduces of ordinary buffers read the peers' memory in place
    (cross-memory attach). ``windows``: ``shared_empty`` returns shared windows, whose
    allreduces move no payload. ``control``: where an ordered engine's agreement messages
    travel ("mpi" or "native"; "" for the native engine and a world of one). ``lane``:
    unnamed allreduces of up to 64 KiB take the same-host lane (lane.py)."""

    engine: str
    shared_memory: bool = False
    cross_memory: bool = False
    windows: bool = False
    control: str = ""
    lane: bool = False


class SharedPlanes:
    """A communicator's shared windows and cross-memory reader, and the choice between them."""

    def __init__(self, one_host: bool, cross: CrossMemory | None, world_size: int = 1) -> None:
        self.arenas = one_host  # every peer is reached through shared-memory arenas
        self.offers_windows = one_host  # shared_empty makes windows (every peer shares memory)
        self.cross = cross if one_host else None  # ordinary buffers read in place too
        self.reader: PeerMemory | None = self.cross  # a group: in its numbering
        self.windows = Windows()
        # this rank's share of the host's idle cores (every rank is on it: one_host); its
        # threads start at the first large reduction (kernels/pool.py)
        self.pool: CorePool | None = CorePool(pool_size(world_size)) if one_host else None
        self._owns_pool = self.pool is not None

    def for_group(self, engine_ranks: tuple[int, ...], world_size: int) -> SharedPlanes:
        """A group's planes (``engine_ranks``: its members in the engine of ``world_size``
        ranks): the same connections, the same cross-memory reader renumbered, and windows of
        its own (offered only where its members' memory is read in place)."""
        planes = SharedPlanes(False, None)
        planes.arenas, planes.pool = self.arenas, self.pool
        if self.offers_windows and self.cross is not None:  # read the members' memory in place
            planes.offers_windows, planes.cross, planes.reader = True, self.cross, self.cross
            if engine_ranks != tuple(range(world_size)):
                planes.reader = RenumberedMemory(self.cross, engine_ranks)
        return planes

    def data_plane(self, engine: str) -> DataPlane:
        """What ``Communicator.data_plane`` says of a communicator over ``engine``."""
        return DataPlane(engine, self.arenas, self.cross is not None, self.offers_windows)

    def choose(self, kind: str, flat: Array) -> tuple[int, tuple[int, PeerMemory]] | None:
        """An allreduce that reads the peers' memory in place: (descriptor root, (what READY
        says, how peers are read)), or None for the message-passing algorithms."""
        if kind != "allreduce" or flat.nbytes <= SMALL_ALLREDUCE_BYTES:  # small: doubling
            return None
        found = self.windows.find(flat) if self.windows else None
        if found is not None:  # the window's number in the descriptor: all ranks agree
            window, offset = found
            return window.ident, (offset, window.memory)
        if self.reader is not None and flat.nbytes >= CROSS_MEMORY_BYTES:
            assert self.cross is not None
            return CROSS_MEMORY, (self.cross.announce(flat), self.reader)
        return None

    def lent_cores(self) -> CorePool | None:
        """The pool that takes pieces of large reductions and copies, where it has threads."""
        return self.pool if self.pool is not None and self.pool.size else None

    def close(self) -> None:
        """Forget every window (see ``Windows.close``); stop the pool's threads."""
        self.windows.close()
        if self.pool is not None and self._owns_pool:
            self.pool.close()
