"""Shared windows: arrays every rank on this host can read, so their allreduce moves no payload.

Theory of operation. ``Communicator.shared_empty`` is collective. Every rank creates a private
anonymous shared-memory segment (mode 0600, like the arenas: samehost/shm.py) and maps it;
the ranks allgather each segment's name and size, map each other's, pass a barrier and close
their own descriptor. Nothing is named in /dev/shm, so nothing is left behind however the job
ends, even a rank killed while it waits here for the others. The caller gets a numpy array on
its own mapping. An allreduce whose buffer lies inside a window runs ``SharedAllreduce``: the ranks
read each other's buffers in place instead of sending them (see algorithms/shared.py). The
window's number travels in the operation's descriptor, so a rank whose buffer is not in the
same window fails the operation with a MismatchError instead of running another algorithm.

Where some rank is on another host (or ASYNCREDUCE_SHM=0), and in a world of one, there is no
window: ``shared_empty`` returns an ordinary array and allreduces take the usual path.
"""

from __future__ import annotations

import mmap
import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..algorithms import Array, WindowMemory
from ..errors import UsageError
from .shm import create_segment, open_segment

__all__ = ["Window", "WindowError", "Windows", "array_layout"]

#: One rank's entry in the allgather: its segment's size and the window's number (8 bytes
#: each), then the segment's name (NUL-padded).
RECORD_BYTES = 256
_HEAD = 16


class WindowError(Exception):
    """This rank could not create or map a window (or the ranks disagree about which one)."""


@dataclass
class Window:
    """One shared window: this rank's mapping and every peer's, as flat uint8 arrays."""

    ident: int
    mine: Array
    peers: dict[int, Array]

    def __post_init__(self) -> None:
        self.base: int = self.mine.__array_interface__["data"][0]  # address of byte 0
        self.memory = WindowMemory(self.peers)  # how SharedAllreduce reads the peers' parts

    def offset_of(self, address: int, nbytes: int) -> int | None:
        """Where ``nbytes`` at ``address`` start in this rank's window, or None if they are
        not wholly inside."""
        start = address - self.base
        return start if start >= 0 and start + nbytes <= self.mine.nbytes else None


def _record(name: str, size: int, ident: int) -> Array:
    encoded = name.encode()
    if len(encoded) > RECORD_BYTES - _HEAD:
        raise WindowError(f"shared-memory segment name too long: {name!r}")
    head = size.to_bytes(8, "little") + ident.to_bytes(8, "little")
    record: Array = np.frombuffer(head + encoded.ljust(RECORD_BYTES - _HEAD, b"\0"), np.uint8)
    owned: Array = record.copy()
    return owned


def _parse(record: Array) -> tuple[str, int, int]:
    """(segment name, size, window number) of one rank's record."""
    raw = record.tobytes()
    name = raw[_HEAD:].rstrip(b"\0").decode(errors="replace")
    return name, int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:16], "little")


class Windows:
    """This rank's windows, looked up by address when an allreduce is posted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one creation at a time: numbers follow the call order
        self._windows: list[Window] = []

    def create(
        self,
        rank: int,
        nbytes: int,
        exchange: Callable[[Array], Array],
        barrier: Callable[[], None],
        listed: bool = True,
    ) -> Window:
        """A new window of ``nbytes`` (collective: ``exchange`` allgathers one record per rank,
        ``barrier`` waits for every rank); its ``mine`` is this rank's part as uint8. An
        unlisted one (the lane's mailboxes) is not looked up for allreduces. Raises
        WindowError if a segment cannot be made or mapped, or the ranks disagree about the
        window's number (they called in different orders); what ``exchange`` and ``barrier``
        raise (a timeout, a broken communicator) passes through."""
        size = max(nbytes, 1)  # an empty file cannot be mapped
        with self._lock:
            ident = len(self._windows) + 1
            try:
                segment, mapping = create_segment(size)
            except OSError as exc:
                raise WindowError(
                    f"could not make a {size}-byte window in shared memory: {exc}"
                ) from exc
            try:
                peers = self._map_peers(rank, ident, exchange(_record(segment.name, size, ident)))
                barrier()
            finally:
                segment.close()
            window = Window(
                ident,
                np.frombuffer(mapping, np.uint8)[:nbytes],
                {p: np.frombuffer(m, np.uint8) for p, m in peers.items()},
            )
            if listed:
                self._windows.append(window)
        return window

    @staticmethod
    def _map_peers(rank: int, ident: int, records: Array) -> dict[int, mmap.mmap]:
        peers: dict[int, mmap.mmap] = {}
        for peer, record in enumerate(records):
            if peer == rank:
                continue
            name, size, theirs = _parse(record)
            if theirs != ident:
                raise WindowError(
                    f"rank {peer} made window {theirs} where rank {rank} made window {ident}: "
                    "call shared_empty in the same order on every rank"
                )
            try:
                peers[peer] = open_segment(name, size)
            except (OSError, ValueError) as exc:
                raise WindowError(f"could not map rank {peer}'s window: {exc}") from exc
        return peers

    def array(
        self, rank: int, dims: tuple[int, ...], kind: np.dtype[Any],
        exchange: Callable[[Array], Array], barrier: Callable[[], None],
    ) -> Array:  # fmt: skip
        """A new array of shape ``dims`` and dtype ``kind`` in a new window (``create``)."""
        count = int(np.prod(dims, dtype=np.int64))
        raw = self.create(rank, count * kind.itemsize, exchange, barrier).mine
        shaped: Array = raw.view(kind).reshape(dims)
        return shaped

    def find(self, flat: Array) -> tuple[Window, int] | None:
        """The window ``flat`` lies in and its offset there, or None."""
        if not flat.flags.c_contiguous:
            return None
        address = flat.__array_interface__["data"][0]
        for window in self._windows:
            offset = window.offset_of(address, flat.nbytes)
            if offset is not None:
                return window, offset
        return None

    def __bool__(self) -> bool:
        return bool(self._windows)

    def close(self) -> None:
        """Forget every window: its memory goes once no array of the caller's uses it."""
        with self._lock:
            self._windows.clear()


def array_layout(shape: Any, dtype: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Checked arguments of shared_empty (before anything collective happens): its shape
    and a dtype that can live in shared memory; UsageError for others."""
    try:
        kind = np.dtype(dtype)
    except TypeError as exc:
        raise UsageError(f"dtype {dtype!r} is not a numpy dtype: {exc}") from None
    if kind.hasobject or kind.itemsize == 0:
        raise UsageError(f"dtype {kind} cannot live in shared memory; use a numeric dtype")
    try:
        dims = (
            (operator.index(shape),)
            if not isinstance(shape, Sequence)
            else tuple(operator.index(d) for d in shape)
        )
    except TypeError:
        raise UsageError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise UsageError(f"shape must be non-negative, got {dims}")
    return dims, kind
