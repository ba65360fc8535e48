"""Idle cores for large reductions and copies: a small pool of threads per rank.

Theory of operation. One progress thread per rank does every reduction of every operation,
so on a many-core host a large allreduce runs on as many cores as there are ranks, and the
others sit idle. A ``CorePool`` lends this rank its share of them: the cores this process may
run on (its affinity mask), divided among the ranks on the host, minus one for the caller
(``pool_size``). ``ASYNCREDUCE_POOL_THREADS`` forces the number (0 turns the pool off).

``CorePool.run(work, start, stop)`` cuts the element range [start, stop) into one piece per
thread plus one for the caller, no piece under ``MIN_PIECE_BYTES``, runs ``work(a, b)`` on each
at once and returns when all are done (raising the first error). Every element is still
combined by exactly one thread, with the same operands in the same order, so the result is
bitwise the same whatever the pool's size. The work must release the GIL to gain anything:
numpy's ufuncs and copies do for arrays of this size, and ``process_vm_readv`` (cross-memory
reads, through ctypes) does. On a machine with no spare core the pool has no thread, and
``run`` calls ``work(start, stop)`` once in the caller: nothing changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ..envvars import env_number
from .reduction import quiet_numpy

__all__ = ["MIN_PIECE_BYTES", "CorePool", "pool_size"]

MIN_PIECE_BYTES = 256 << 10  # below this a piece costs more to hand over than it saves
POOL_ENV = "ASYNCREDUCE_POOL_THREADS"


def pool_size(ranks_on_host: int) -> int:
    """The threads this rank's pool gets: ``ASYNCREDUCE_POOL_THREADS`` if set, else its share
    of the cores it may run on, minus one for the caller (0 where there is none to spare)."""
    if os.environ.get(POOL_ENV, "").strip():
        return env_number(POOL_ENV, 0, int, 0)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0, (cores or 1) // max(1, ranks_on_host) - 1)


class CorePool:
    """``size`` threads that take pieces of a large reduction or copy (see the module doc)."""

    def __init__(self, size: int, min_piece_bytes: int = MIN_PIECE_BYTES) -> None:
        self.size, self.min_piece_bytes = size, min_piece_bytes
        self._threads = (
            ThreadPoolExecutor(size, "asyncreduce-core") if size else None
        )  # fmt: skip

    def pieces(self, start: int, stop: int, itemsize: int) -> list[tuple[int, int]]:
        """[start, stop) in at most ``size + 1`` pieces of at least ``min_piece_bytes``."""
        count = stop - start
        parts = min(self.size + 1, max(1, count * itemsize // self.min_piece_bytes))
        edges = [start + count * i // parts for i in range(parts + 1)]
        return list(zip(edges[:-1], edges[1:], strict=True))

    def run(self, work: Callable[[int, int], None], start: int, stop: int, itemsize: int) -> None:
        """``work(a, b)`` over pieces of [start, stop), the first in the caller's thread."""
        pieces = self.pieces(start, stop, itemsize)
        if len(pieces) == 1 or self._threads is None:
            work(start, stop)
            return
        lent: list[Future[None]] = [self._threads.submit(quiet_numpy, work, a, b)
                                    for a, b in pieces[1:]]  # fmt: skip
        try:
            work(*pieces[0])
        finally:
            errors = [f.exception() for f in lent]  # (waits for each: none is left running)
        for error in errors:
            if error is not None:
                raise error

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)
