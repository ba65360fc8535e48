"""The public communicator: non-blocking collectives that any thread may post.

Theory of operation. A call checks its arguments in the calling thread (a bad call raises
``UsageError`` before anything is numbered or sent, so ranks stay in step), gives the
operation its key, builds the algorithm's state machine over the caller's memory and hands it
to the engine. The key is the ``name`` plus how many times this rank posted that name before,
or, for unnamed operations, the count of unnamed ones: named operations may be posted in any
order on each rank; unnamed ones, as in MPI, in the same order everywhere.

The caller must not touch the buffer until the request completes; afterwards the result is
in place (or in a new object, for ``inplace=False``, allgather and reduce_scatter).
"""

from __future__ import annotations

import atexit
import logging
import operator
import os
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np

from . import forks
from .algorithms import (
    CROSS_MEMORY,
    CROSS_MEMORY_BYTES,
    KINDS,
    REDUCTION_CODES,
    REDUCTIONS,
    SMALL_ALLREDUCE_BYTES,
    Array,
    PeerMemory,
    build,
)
from .buffers import Buffer, as_buffer
from .cma import CrossMemory
from .engine import Engine, Operation
from .errors import BrokenError, ClosedError, UsageError
from .request import CallbackRunner, Request
from .transport.frame import MAX_NAME_BYTES, Descriptor
from .window import WindowError, Windows

__all__ = ["Communicator"]

log = logging.getLogger("asyncreduce.comm")
log_ops = logging.getLogger("asyncreduce.ops")  # a line per operation, when asked for:
if log_ops.level == logging.NOTSET:  # off even under logging.basicConfig(level=DEBUG),
    log_ops.setLevel(logging.INFO)  # unless the program set this logger's level first
_EMPTY = np.empty(0, dtype=np.uint8)
_WINDOW = "asyncreduce/window"  # the key of shared_empty's own collectives
_OPEN: weakref.WeakSet[Communicator] = weakref.WeakSet()


@atexit.register
def _close_forgotten() -> None:
    """A program that ends without close() still says goodbye, so its peers see an orderly close."""
    for comm in list(_OPEN):
        comm.close()


class Communicator:
    """A group of ``world_size`` ranks that run collectives together (see ``init``).

    ``local_rank`` and ``local_world_size``: this rank's place among the ranks on its host
    (from the launcher, or counted at init), e.g. to pick a GPU."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        engine: Engine | None,
        one_host: bool = False,
        cross: CrossMemory | None = None,
        local: tuple[int, int] = (0, 1),
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank, self.local_world_size = local  # among the ranks on this host
        self._engine = engine
        self._one_host = one_host and engine is not None  # every peer shares memory with us
        self._cross = cross if self._one_host else None  # ordinary buffers read in place too
        self._clock_origin = time.perf_counter()  # a world of one: now; else set by init
        self._windows = Windows()
        self._runner = CallbackRunner(f"asyncreduce-callbacks-{rank}")
        self._key_lock = threading.Lock()
        self._posted: defaultdict[str, int] = defaultdict(int)
        self._closed = False
        self._generation = forks.generation()
        self._pid = os.getpid()
        _OPEN.add(self)

    # ---- collectives ---------------------------------------------------------------------

    def iallreduce(
        self, x: Any, op: str = "sum", *, name: str | None = None, priority: int = 0,
        timeout: float | None = None, inplace: bool = True,
    ) -> Request[Any]:  # fmt: skip
        """Start reducing ``x`` over all ranks with ``op`` (sum, avg, max, min, prod)."""
        buf = as_buffer(x, "x", inplace=inplace)
        self._check_reduction(op, buf)
        return self._post("allreduce", buf, lambda: buf.original, op, 0, name, priority, timeout)

    def allreduce(self, x: Any, op: str = "sum", **kwargs: Any) -> Any:
        """``iallreduce(...).wait()``."""
        return self.iallreduce(x, op, **kwargs).wait()

    def ibroadcast(
        self, x: Any, root: int = 0, *, name: str | None = None, priority: int = 0,
        timeout: float | None = None, inplace: bool = True,
    ) -> Request[Any]:  # fmt: skip
        """Start copying ``x`` of rank ``root`` into ``x`` of every rank."""
        buf = as_buffer(x, "x", inplace=inplace)
        if not (isinstance(root, int) and 0 <= root < self.world_size):
            raise UsageError(
                f"root={root!r} is not a rank of this communicator (0..{self.world_size - 1})"
            )
        return self._post(
            "broadcast", buf, lambda: buf.original, None, root, name, priority, timeout
        )

    def broadcast(self, x: Any, root: int = 0, **kwargs: Any) -> Any:
        """``ibroadcast(...).wait()``."""
        return self.ibroadcast(x, root, **kwargs).wait()

    def iallgather(
        self, x: Any, *, name: str | None = None, priority: int = 0, timeout: float | None = None
    ) -> Request[Any]:
        """Start gathering every rank's ``x``; the result has shape (world_size, *x.shape)."""
        buf = as_buffer(x, "x", inplace=False)
        out = np.empty((self.world_size, *buf.shape), dtype=buf.flat.dtype)
        out.reshape(self.world_size, -1)[self.rank] = buf.flat
        gathered = Buffer(out, out.reshape(-1), out.shape, buf.dtype, buf.like)
        return self._post(
            "allgather", gathered, lambda: buf.like(out), None, 0, name, priority, timeout
        )

    def allgather(self, x: Any, **kwargs: Any) -> Any:
        """``iallgather(...).wait()``."""
        return self.iallgather(x, **kwargs).wait()

    def ireduce_scatter(
        self, x: Any, op: str = "sum", *, name: str | None = None, priority: int = 0,
        timeout: float | None = None, inplace: bool = True,
    ) -> Request[Any]:  # fmt: skip
        """Start reducing ``x``; keep block ``rank`` of its first axis (split world_size ways)."""
        buf = as_buffer(x, "x", inplace=inplace)
        self._check_reduction(op, buf)
        if not buf.shape or buf.shape[0] % self.world_size:
            raise UsageError(
                f"reduce_scatter needs the first axis of x divisible by "
                f"world_size={self.world_size}; x has shape {buf.shape}"
            )
        block = (buf.shape[0] // self.world_size, *buf.shape[1:])
        mine = buf.flat.reshape(self.world_size, -1)[self.rank].reshape(block)
        return self._post(
            "reduce_scatter", buf, lambda: buf.like(mine), op, 0, name, priority, timeout
        )

    def reduce_scatter(self, x: Any, op: str = "sum", **kwargs: Any) -> Any:
        """``ireduce_scatter(...).wait()``."""
        return self.ireduce_scatter(x, op, **kwargs).wait()

    def ibarrier(self, *, name: str | None = None, timeout: float | None = None) -> Request[None]:
        """Start a barrier: completes once every rank has entered it."""
        buf = as_buffer(_EMPTY, "barrier")
        return self._post("barrier", buf, lambda: None, None, 0, name, 0, timeout)

    def barrier(self, **kwargs: Any) -> None:
        """``ibarrier(...).wait()``."""
        self.ibarrier(**kwargs).wait()

    # ---- shared windows ------------------------------------------------------------------

    def shared_empty(
        self, shape: int | Sequence[int], dtype: Any = np.float32, *, timeout: float = 30.0
    ) -> Array:
        """A new uninitialised array in a shared window (collective: every rank calls it, in
        the same order, each with its own shape; one call at a time per rank).

        When every rank is on this host, an in-place allreduce of an array that lies in such a
        window (or a part of one, or a torch tensor on it: ``torch.from_numpy``) moves no
        payload: each rank reduces its share reading the peers' arrays in place, then copies
        the others' shares (about two passes over memory instead of the ring's four). Above
        64 KiB (SMALL_ALLREDUCE_BYTES) every rank must then pass a buffer in a window for that
        allreduce, or it fails with MismatchError; smaller ones take recursive doubling anyway.
        Elsewhere (ranks on several hosts, ASYNCREDUCE_SHM=0, a world of one) this returns an
        ordinary array and allreduces take the usual path.

        A rank that cannot make or map a window aborts the communicator (BrokenError here,
        every other rank fails) rather than leave the others waiting; a rank that never calls
        it leaves the others with TimeoutError after ``timeout``. If a window allreduce fails
        (timeout, abort, a lost peer), that operation's buffers are undefined on every rank:
        peers read this rank's buffer in place, maybe after its caller got it back. The memory
        is returned once the communicator is closed and no array uses it.
        """
        if self._closed:
            raise ClosedError("shared_empty: the communicator is closed")
        self._check_process("shared_empty")
        dims, kind = _shape_and_dtype(shape, dtype)
        if not self._one_host:
            return np.empty(dims, kind)
        count = int(np.prod(dims, dtype=np.int64))
        try:
            raw = self._windows.create(
                self.rank,
                count * kind.itemsize,
                lambda record: self.allgather(record, name=_WINDOW, timeout=timeout),
                lambda: self.barrier(name=_WINDOW, timeout=timeout),
            )
        except WindowError as exc:
            self.abort(f"rank {self.rank}: shared_empty: {exc}")
            raise BrokenError(f"shared_empty on rank {self.rank}: {exc}") from exc
        shaped: Array = raw.view(kind).reshape(dims)
        return shaped

    # ---- life cycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Fail pending requests with ClosedError, then close every socket and join every thread.

        In a forked child it only marks this copy closed: the connections are the parent's."""
        self._closed = True
        if self._forked():
            return
        if self._engine is not None:
            self._engine.close()
        self._runner.close()
        self._windows.close()

    def abort(self, reason: str = "") -> None:
        """Give up now, on every rank: pending requests here fail with BrokenError, every other
        rank's communicator breaks within a heartbeat with ``reason`` (an ABORT frame), and
        this one closes without waiting for anybody. Returns within about a second."""
        self._closed = True
        if self._forked():
            return
        if self._engine is not None:
            self._engine.abort(reason)
        self._runner.close()
        self._windows.close()

    def flight_record(self) -> dict[str, Any]:
        """The last operations of this rank as a JSON-ready dict (see ``asyncreduce.flight``)."""
        if self._engine is None:
            return {"rank": 0, "world_size": 1, "records": []}
        return self._engine.flight.snapshot()

    def dump_flight_record(self, path: str) -> str:
        """Write ``flight_record()`` as JSON to ``path`` (a file or a directory); return the file.

        ``asyncreduce culprit DIR`` reads every rank's dump and names what went wrong."""
        if self._engine is None:
            raise UsageError("a world of one records no operations")
        return self._engine.flight.dump(path)

    @property
    def clock_origin(self) -> float:
        """This rank's ``time.perf_counter()`` reading of one instant every rank shares: the
        end of the rendezvous, as rank 0 saw it. Timelines count from it, so the files of all
        ranks line up (exactly on one host, where every process reads the same clock; across
        hosts within about one message latency)."""
        return self._clock_origin

    @property
    def stall_reports(self) -> list[str]:
        """The stall warnings this rank gave (ASYNCREDUCE_STALL_WARNING), newest last."""
        return self._engine.stall_reports if self._engine is not None else []

    def __enter__(self) -> Communicator:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<Communicator rank {self.rank} of {self.world_size}{state}>"

    # ---- internals -----------------------------------------------------------------------

    def _forked(self) -> bool:
        return self._generation != forks.generation()

    def _check_process(self, what: str) -> None:
        if self._forked():
            raise UsageError(
                f"{what}: this communicator belongs to process {self._pid}, and this is a "
                "forked child of it, where its progress thread and connections do not run. "
                "Make a new communicator in the child (ar.init), or start it with the 'spawn' "
                "method; children that do not communicate (DataLoader workers) need nothing"
            )

    def _check_reduction(self, op: str, buf: Buffer) -> None:
        if op not in REDUCTIONS:
            raise UsageError(f"op={op!r} is not a reduction; use one of {', '.join(REDUCTIONS)}")
        if op == "avg" and not buf.dtype.is_float:
            raise UsageError(
                f"op='avg' needs a floating dtype, x is {buf.dtype.name}; use 'sum' and divide"
            )

    def _next_key(self, name: str | None) -> tuple[bytes, int]:
        if name is not None and (not isinstance(name, str) or not name):
            raise UsageError(f"name must be a non-empty string or None, got {name!r}")
        wire = (name or "").encode()
        if len(wire) > MAX_NAME_BYTES:
            raise UsageError(f"name is {len(wire)} bytes long; at most {MAX_NAME_BYTES}")
        with self._key_lock:
            instance = self._posted[name or ""]
            self._posted[name or ""] = instance + 1
        return wire, instance

    def _post(
        self, kind: str, buf: Buffer, result: Any, op: str | None, root: int,
        name: str | None, priority: int, timeout: float | None,
    ) -> Request[Any]:  # fmt: skip
        if not isinstance(priority, int):
            raise UsageError(f"priority must be an int, got {priority!r}")
        if timeout is not None and not timeout > 0:
            raise UsageError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        if self._closed:
            raise ClosedError(f"{kind}: the communicator is closed")
        self._check_process(kind)
        key = self._next_key(name)
        label = f"{kind} {name!r}#{key[1]}" if name else f"{kind} #{key[1]}"
        reduce = REDUCTION_CODES[op] if op else 0
        shared: tuple[int, PeerMemory] | None = None  # (what READY says, how peers are read)
        if kind == "allreduce" and buf.flat.nbytes > SMALL_ALLREDUCE_BYTES:  # small: doubling
            found = self._windows.find(buf.flat) if self._windows else None
            if found is not None:  # the window's number in the descriptor: all ranks agree
                window, offset = found
                root, shared = window.ident, (offset, window.memory)
            elif self._cross is not None and buf.flat.nbytes >= CROSS_MEMORY_BYTES:
                root, shared = CROSS_MEMORY, (self._cross.announce(buf.flat), self._cross)
        desc = Descriptor(KINDS[kind], buf.dtype.code, reduce, root, buf.flat.size)
        algo = build(
            kind, self.rank, self.world_size, buf.flat, buf.dtype, op or "sum", root, shared
        )
        request: Request[Any] = Request(label, self._runner)
        if log_ops.isEnabledFor(logging.DEBUG):
            log_ops.debug("rank %d posts %s: %s", self.rank, label, desc)
        if self._engine is None:  # a world of one: nothing to talk to
            algo.start()
            request.set_result(result())
            return request
        self._engine.submit(Operation(key, label, desc, algo, request, result, priority, timeout))
        return request


def _shape_and_dtype(shape: Any, dtype: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Checked arguments of shared_empty (before anything collective happens)."""
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
