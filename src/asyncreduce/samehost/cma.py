"""Cross-memory attach: reading a peer process's memory with one copy (``process_vm_readv``).

Theory of operation. Ranks on one host whose kernel lets them (the same user, and no ptrace
restriction against it: Yama's ptrace_scope 0, or CAP_SYS_PTRACE) can read each other's
memory directly: the kernel copies from the peer's pages into this rank's, once, with no
shared file and no arena in between. An allreduce of ordinary buffers (not from
``shared_empty``) then runs as one over shared windows does (algorithms/shared.py): each rank
announces where its buffer is, reduces its chunk reading the peers' parts piece by piece into
a small scratch that stays in the cache, and copies the others' reduced chunks straight into
its own buffer.

Whether it works, and that each peer's pid is really that peer's, is checked once, when the
communicator is built (bootstrap.py): every rank sends every other a fresh random challenge
through the store, each rank keeps the challenges it was sent in its own memory and announces
where, and every rank reads them back from each peer's announced pid (which must be another
process of this user). Only a process that received the challenge can hold it, so a rank
cannot make its peers read some other process; and the ranks use cross-memory attach only
if every rank read every peer right, so all of them pick the same algorithm.

A read that fails later (the peer died: ESRCH; an address not mapped there: EFAULT) raises
``PeerMemoryError`` and fails the operation. Nothing is ever written into a peer: a read lands
only in this rank's own buffer or scratch, sized by this rank. What a peer's buffer holds is
what that peer chose, as with any payload it sends.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from ..algorithms import Array, PeerMemoryError, ProtocolError
from ..kernels.reduction import DTYPES

_WIDEST = max(d.itemsize for d in DTYPES.values())  # complex128: one element of any dtype

__all__ = ["CrossMemory", "PeerMemoryError", "available", "owned_by_me", "probe", "read_into"]

PIECE_BYTES = 256 << 10  # what a reduction reads at a time: stays in the cache it is added from


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


@functools.cache
def _readv() -> Any:
    """libc's process_vm_readv (Linux 3.2 and later), or None; looked up on first use."""
    try:
        readv = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    iov = ctypes.POINTER(_IoVec)
    readv.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong]
    readv.restype = ctypes.c_ssize_t
    return readv


def available() -> bool:
    """Whether this system has process_vm_readv at all (see ``probe`` for permission)."""
    return _readv() is not None


def read_into(pid: int, dest: int, source: int, nbytes: int) -> None:
    """Copy ``nbytes`` at address ``source`` of process ``pid`` to ``dest`` here (with the GIL
    released); OSError if the kernel refuses or reads less (the peer died, or the bytes are
    not mapped there)."""
    readv = _readv()
    if readv is None:
        raise OSError("process_vm_readv is not available on this system")
    local, remote = _IoVec(dest, nbytes), _IoVec(source, nbytes)
    got = readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got != nbytes:
        code = ctypes.get_errno() if got < 0 else errno.EFAULT  # part of it is not mapped
        raise OSError(code, f"reading {nbytes} bytes of process {pid}: {os.strerror(code)}")


def probe(pid: int, address: int, expected: bytes) -> str | None:
    """None if process ``pid`` holds ``expected`` at ``address`` and this process may read it;
    else why not."""
    seen = np.zeros(len(expected), np.uint8)
    try:
        read_into(pid, seen.ctypes.data, address, len(expected))
    except OSError as exc:
        return str(exc)
    return None if seen.tobytes() == expected else f"process {pid} holds other bytes there"


def owned_by_me(pid: int) -> bool:
    """Whether ``pid`` is another live process of this user."""
    try:
        return pid != os.getpid() and os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


class CrossMemory:
    """Reads the peers' buffers for ``SharedAllreduce`` (its ``PeerMemory``): a peer's READY
    carries its buffer's address, read here with ``process_vm_readv`` of the peer's pid."""

    def __init__(self, pids: Mapping[int, int], piece_bytes: int = PIECE_BYTES) -> None:
        self._pids = dict(pids)
        self._piece_bytes = max(piece_bytes, _WIDEST)  # room for one element of any dtype
        self._local = threading.local()  # a scratch buffer per thread that reads (the engine's,
        # and the core pool's: kernels/pool.py)

    def _scratch(self) -> Array:
        found: Array | None = getattr(self._local, "scratch", None)
        if found is None:
            found = self._local.scratch = np.empty(self._piece_bytes, np.uint8)
        return found

    @staticmethod
    def announce(buffer: Array) -> int:
        """What this rank's READY says: its buffer's address."""
        return int(buffer.ctypes.data)

    def buffer(self, peer: int, where: int, like: Array) -> _PeerBuffer:
        """Rank ``peer``'s buffer at address ``where``, of ``like``'s dtype and size."""
        if peer not in self._pids:
            raise ProtocolError(f"cross-memory allreduce: no process known for rank {peer}")
        if where % like.itemsize:
            raise ProtocolError(
                f"cross-memory allreduce: rank {peer} announced {like.nbytes} bytes at {where:#x}"
            )
        return _PeerBuffer(peer, self._pids[peer], where, like.dtype, self._scratch,
                           self._piece_bytes)  # fmt: skip


class _PeerBuffer:
    """One peer's buffer in another process: read in pieces, or copied straight into place."""

    def __init__(self, rank: int, pid: int, address: int, dtype: np.dtype,
                 scratch: Callable[[], Array], piece_bytes: int) -> None:  # fmt: skip
        self._rank, self._pid, self._address, self._dtype = rank, pid, address, dtype
        self._scratch = scratch  # this thread's scratch buffer
        self._piece = max(1, piece_bytes // dtype.itemsize)

    def _read(self, dest: int, start: int, nbytes: int) -> None:
        try:
            read_into(self._pid, dest, self._address + start * self._dtype.itemsize, nbytes)
        except OSError as exc:  # ESRCH: it is gone; anything else: it announced bad memory
            raise PeerMemoryError(
                exc.errno,
                f"could not read rank {self._rank}'s buffer ({exc}); if the kernel stops "
                "cross-memory reads here, set ASYNCREDUCE_CMA=0 on every rank",
            ) from None

    def read(self, start: int, stop: int) -> Iterator[tuple[int, Array]]:
        """Elements [start, stop) as (first element, array) pieces, each valid until the next."""
        scratch = self._scratch()
        for a in range(start, stop, self._piece):
            n = min(self._piece, stop - a) * self._dtype.itemsize
            self._read(scratch.ctypes.data, a, n)
            yield a, scratch[:n].view(self._dtype)

    def copy_to(self, out: Array, start: int) -> None:
        """out[:] = elements [start, start + out.size)."""
        self._read(out.ctypes.data, start, out.nbytes)
