"""The MPI engine (mpi4py): what ``ar.init(backend="mpi")`` runs on.

Theory of operation. ``meet`` (at init, on the caller's thread) duplicates the caller's
communicator four times (agreed collectives and exchanges; the control channel; the caller's
point-to-point sends and receives, with their own tags; the helper's blocking calls) and
learns where every rank runs, all with non-blocking calls bounded by init's ``timeout``: a
rank that never calls init gives a TimeoutError, not a hang. From then on every MPI call is
made by the ordered engine's thread (or its helper, below): it issues non-blocking calls and
tests them, which is what lets Open MPI progress a posted ``Iallreduce`` while the caller
computes. MPI must therefore run at MPI_THREAD_SERIALIZED or higher (mpi4py asks for
MPI_THREAD_MULTIPLE by default, so the caller's own MPI calls keep working beside ours).

The engine thread never sits in a call that no deadline can end (a stopped peer, a network
partition): every call it makes is non-blocking, so while one waits for a peer the thread
keeps sending heartbeats and keeping deadlines, and can fail requests and close. The calls
that finish in microseconds (allreduces and broadcasts up to ``SMALL_BYTES``, barriers) are
tested in a tight loop for ``SPIN`` seconds first, which keeps most of what a blocking call
gains there. Large allreduces with every rank on one host are the exception that stays
blocking, on a helper thread of their own (``BLOCKING_BYTES``): there the blocking
``Allreduce`` progresses its shared-memory transfer continuously, where the engine's polls
would leave it waiting; if the peer is stopped, the helper waits in MPI, abandoned, while the
engine thread fails the request as for any other call.

Types and reductions MPI has built in go to MPI as they are; the ones it lacks (float16,
bfloat16) reduce through a user-defined operation that combines exactly as the native engine
does (algorithms/reduction.py). bool reduces as torch means it (sum and max are "or").
"""

from __future__ import annotations

import hashlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ...algorithms import DType
from ...errors import MismatchError, UsageError
from ...kernels.reduction import combine
from .channel import Endpoint
from .posted import Posted, Running

__all__ = ["MpiAdapter", "check_thread_level", "meet"]

_SLOT = 64 << 10
#: With every rank on one host, allreduces from this size up are blocking ``Allreduce`` calls
#: made by a helper thread, on a communicator of their own, in the agreed order (mpi4py
#: releases the GIL in them). Through the engine's polls, a non-blocking one took 2-3x as long
#: (10 x 32 MiB one by one, 2 ranks, 2 cores: 260-430 ms against 120-140 ms). It needs
#: MPI_THREAD_MULTIPLE on every rank (mpi4py's default); otherwise they are non-blocking too.
#: Across hosts they stay non-blocking, tested every ``_POLL``: a blocking call over TCP spins a
#: core the caller's computation needs (``bench overlap --hosts``).
BLOCKING_BYTES = 1 << 20
#: Allreduces and broadcasts up to this size, and barriers, are tested in a tight loop for up
#: to ``SPIN`` seconds after they are issued (the engine's usual polling after that): a
#: blocking call takes ~1.6 us at 1 KiB on one host, the non-blocking one tested in a loop
#: ~3 us, and through the engine's polls alone ~25 us (measured, Open MPI 4.1, 2 ranks).
SMALL_BYTES = 64 << 10
SPIN = 50e-6
_EXCHANGE_TAG = 1


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise UsageError(
            "backend='mpi' needs mpi4py: pip install 'asyncreduce[mpi]' (and an MPI library, "
            f"e.g. apt install openmpi-bin libopenmpi-dev): {exc}"
        ) from None
    return MPI


def prefer_ring() -> None:
    """Before MPI starts: Open MPI's non-blocking allreduce takes the ring, unless the caller
    chose (OMPI_MCA_coll_libnbc_iallreduce_algorithm). Its own choice for two ranks across
    hosts halves the bandwidth: 586 ms against 286 ms for 32 MiB at 1 Gbit/s, measured with
    ``bench overlap --hosts 2 --libs mpi``. Too late if the program started MPI already."""

    if "mpi4py.MPI" not in sys.modules:
        os.environ.setdefault("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1")


def check_thread_level() -> None:
    """UsageError unless MPI runs at MPI_THREAD_SERIALIZED or higher (initializing it if not)."""
    mpi = _mpi()
    level = mpi.Query_thread()
    if level < mpi.THREAD_SERIALIZED:
        names = {mpi.THREAD_SINGLE: "SINGLE", mpi.THREAD_FUNNELED: "FUNNELED"}
        raise UsageError(
            f"MPI was initialized at MPI_THREAD_{names.get(level, level)}; asyncreduce's thread "
            "makes every MPI call, which needs MPI_THREAD_SERIALIZED or higher: leave "
            "mpi4py.rc.thread_level at its default ('multiple') before importing mpi4py.MPI"
        )


_ABANDONED: list[Any] = []  # what init gave up waiting for: MPI may still complete it


def meet(comm: Any, deadline: float, timeout: float) -> tuple[list[Any], tuple[int, int], bool]:
    """The four duplicates of ``comm`` the adapter runs on, this rank's place among the ranks
    on its host, and whether every rank runs MPI at MPI_THREAD_MULTIPLE; TimeoutError once
    ``deadline`` (monotonic) passes with a rank missing. Collective over ``comm``."""
    mpi = _mpi()
    dups = [comm.Idup() for _ in range(4)]
    comms = [c for c, _ in dups]
    _wait([r for _, r in dups], deadline, comms,
          f"not every rank of the communicator ({comm.Get_size()} ranks) called "
          f"init(backend='mpi') within its timeout of {timeout} s")  # fmt: skip
    host = hashlib.blake2b(mpi.Get_processor_name().encode(), digest_size=8).digest()
    table = np.zeros((comm.Get_size(), 2), np.uint64)  # every rank: (host, thread level)
    rank = comm.Get_rank()
    table[rank] = (int.from_bytes(host, "little"), mpi.Query_thread())
    _wait([comms[0].Iallgather(mpi.IN_PLACE, table)], deadline, (comms, table),
          f"a rank left init(backend='mpi') before it finished (timeout {timeout} s)")  # fmt: skip
    same = table[:, 0] == table[rank, 0]
    local = (int(same[:rank].sum()), int(same.sum()))
    return comms, local, bool((table[:, 1] >= mpi.THREAD_MULTIPLE).all())


def _wait(requests: list[Any], deadline: float, keep: Any, why: str) -> None:
    """Test ``requests`` until all are done; TimeoutError(``why``) at ``deadline``, when they
    are left to MPI (with ``keep``, what they use: a collective cannot be cancelled)."""
    test = _mpi().Request.Testall
    while not test(requests):
        if time.monotonic() >= deadline:
            _ABANDONED.append((requests, keep))
            raise TimeoutError(why)
        time.sleep(1e-4)


class _Calls:
    """Non-blocking MPI requests that finish together (``done`` tests them all)."""

    def __init__(self, requests: list[Any], keep: Any = None, after: Any = None) -> None:
        self._requests = requests
        self._keep = keep  # buffers MPI reads or writes until done
        self._after = after

    def done(self) -> bool:
        mpi = _mpi()
        if not mpi.Request.Testall(self._requests):
            return False
        if self._after is not None:
            self._after()
        return True

    def spun(self) -> _Calls:
        """Itself, tested in a tight loop for up to ``SPIN`` s (a short call is done by then)."""
        test, end = self._requests[0].Test, time.perf_counter() + SPIN
        while not test() and time.perf_counter() < end:
            pass
        return self


class _Blocking:
    """A blocking call made by the helper thread: done once it returned (or raised). The
    helper wakes the engine thread then, so meanwhile it sleeps until its next beat."""

    wakes = True

    def __init__(self, call: Any, keep: Any) -> None:
        self._call, self._keep = call, keep
        self._error: BaseException | None = None
        self._finished = False

    def run(self) -> None:  # (the helper thread)
        try:
            self._call()
        except BaseException as exc:
            self._error = exc
        self._finished = True

    def done(self) -> bool:
        if not self._finished:
            return False
        if self._error is not None:
            raise self._error
        return True


class _Helper:
    """One thread that makes blocking calls, one at a time, in the order they are given."""

    def __init__(self, rank: int, adapter: Any) -> None:
        self._adapter = adapter  # (its ``wake``, set by the engine, once a call returned)
        self._jobs: queue.SimpleQueue[_Blocking | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"asyncreduce-mpi-blocking-{rank}",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def call(self, call: Any, keep: Any) -> _Blocking:
        job = _Blocking(call, keep)
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job.run()
            job = None  # (not kept, with its buffer, while waiting for the next one)
            if self._jobs.empty():  # (a run of calls wakes it once, at its end: on a busy
                self._adapter.wake()  # host, a thread woken meanwhile slows the calls)

    def stop(self, wait: float = 1.0) -> None:
        """End the thread, waiting up to ``wait`` s for it: an idle one ends at once, so no
        thread outlives close(); one stuck in a call keeps it, abandoned."""
        self._jobs.put(None)
        self._thread.join(wait)


class _Receive:
    """A point-to-point receive that checks the sender sent what was expected."""

    def __init__(self, request: Any, expected: int, what: str) -> None:
        self._request, self._expected, self._what = request, expected, what
        self._status = _mpi().Status()

    def done(self) -> bool:
        if not self._request.Test(self._status):
            return False
        got = self._status.Get_count(_mpi().BYTE)
        if got != self._expected:
            raise MismatchError(f"{self._what}: {got} bytes came, {self._expected} were "
                                "expected (the ranks posted different sizes)")  # fmt: skip
        return True


class MpiEndpoint:
    """Control-channel slots as MPI messages on a communicator of their own."""

    slot = _SLOT
    exact = False

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self._recvs: list[Any] = []
        self._status, self._byte = _mpi().Status(), _mpi().BYTE

    def isend(self, peer: int, data: bytes) -> Any:
        return self._comm.Isend([data, _mpi().BYTE], peer, 0), data

    def irecv(self, peer: int, buffer: bytearray) -> Any:
        request = self._comm.Irecv([buffer, _mpi().BYTE], peer, 0)
        self._recvs.append(request)
        return request

    def test(self, handle: Any) -> int | None:
        if isinstance(handle, tuple):  # a send
            return 0 if handle[0].Test() else None
        if not handle.Test(self._status):
            return None
        self._recvs.remove(handle)
        return int(self._status.Get_count(self._byte))

    def cancel(self) -> None:
        for request in self._recvs:
            request.Cancel()
            request.Wait()
        self._recvs.clear()


class MpiAdapter:
    """Agreed operations as MPI calls; built on the ordered engine's thread."""

    name = "mpi"

    def __init__(
        self, comms: list[Any], endpoint: Endpoint | None, one_host: bool, threads: bool
    ) -> None:  # fmt: skip
        """``comms``: what ``meet`` made; ``one_host``: every rank shares this host;
        ``threads``: every rank runs MPI at MPI_THREAD_MULTIPLE (every rank decides alike)."""
        mpi = _mpi()
        self._mpi = mpi
        self._data, self._control, self._p2p, self._blocking = comms
        self.rank, self.world_size = self._data.Get_rank(), self._data.Get_size()
        self._helper = _Helper(self.rank, self) if one_host and threads else None
        self.endpoint: Endpoint = endpoint or MpiEndpoint(self._control)
        self.wake: Callable[[], None] = lambda: None  # the engine's: a helper's call returned
        self.max_tag = int(self._data.Get_attr(mpi.TAG_UB))  # (larger: UsageError at post)
        self._ops: dict[tuple[str, str], Any] = {}
        self._types: dict[int, Any] = {}

    def start(self, op: Posted, flat: Any) -> Running:
        mpi, comm, kind = self._mpi, self._data, op.kind
        short = flat.nbytes <= SMALL_BYTES  # (agreed: every rank decides alike)
        if kind == "allreduce" and flat.nbytes >= BLOCKING_BYTES and self._helper is not None:
            buf, red, big = self._buffer(flat, op.dtype), self._op(op.dtype, op.op), self._blocking
            return self._helper.call(lambda: big.Allreduce(mpi.IN_PLACE, buf, red), flat)
        if kind == "allreduce":
            buf = self._buffer(flat, op.dtype)
            call = _Calls([comm.Iallreduce(mpi.IN_PLACE, buf, self._op(op.dtype, op.op))], flat)
            return call.spun() if short else call
        if kind == "broadcast":
            call = _Calls([comm.Ibcast(self._buffer(flat, op.dtype), op.root)], flat)
            return call.spun() if short else call
        if kind == "barrier":
            return _Calls([comm.Ibarrier()]).spun()
        if kind == "allgather":
            buf = self._buffer(flat, op.dtype, flat.size // self.world_size)  # (per rank)
            return _Calls([comm.Iallgather(mpi.IN_PLACE, buf)], flat)
        if kind == "reduce_scatter":
            mine = flat.reshape(self.world_size, -1)[self.rank]
            whole = flat.copy()
            request = comm.Ireduce_scatter_block(self._buffer(whole, op.dtype),
                                                 self._buffer(mine, op.dtype),
                                                 self._op(op.dtype, op.op))  # fmt: skip
            return _Calls([request], (whole, flat))
        if kind == "reduce":
            red = self._op(op.dtype, op.op)
            if self.rank == op.root:
                request = comm.Ireduce(mpi.IN_PLACE, self._buffer(flat, op.dtype), red, op.root)
            else:
                request = comm.Ireduce(self._buffer(flat, op.dtype), None, red, op.root)
            return _Calls([request], flat)
        if kind == "p2p":
            return self._point_to_point(op)
        return self._exchange(op)

    def _exchange(self, op: Posted) -> Running:
        """gather, scatter, alltoall: the exchange's sends and receives, in agreed order."""
        comm, byte = self._data, self._mpi.BYTE
        requests = [comm.Isend([a, byte], p, _EXCHANGE_TAG) for p, a in (op.sends or {}).items()]
        requests += [comm.Irecv([a, byte], p, _EXCHANGE_TAG) for p, a in (op.recvs or {}).items()]
        return _Calls(requests, op)

    def _point_to_point(self, op: Posted) -> Running:
        byte = self._mpi.BYTE
        if op.sends:
            ((peer, array),) = op.sends.items()
            return _Calls([self._p2p.Isend([array, byte], peer, op.tag)], array)
        ((peer, array),) = (op.recvs or {}).items()
        request = self._p2p.Irecv([array, byte], peer, op.tag)
        return _Receive(request, array.nbytes, op.label)

    def _buffer(self, flat: Any, dtype: DType, count: int | None = None) -> Any:
        """``flat`` as an MPI buffer (``count`` elements of it where MPI wants a count per
        rank); float16 and bfloat16 have no MPI type: whole elements of raw bytes."""
        if dtype.name in ("float16", "bfloat16"):
            if dtype.itemsize not in self._types:
                self._types[dtype.itemsize] = self._mpi.BYTE.Create_contiguous(dtype.itemsize)
                self._types[dtype.itemsize].Commit()
            return [flat, flat.size if count is None else count, self._types[dtype.itemsize]]
        return flat

    def _op(self, dtype: DType, op: str | None) -> Any:
        mpi, name = self._mpi, op or "sum"
        if dtype.name == "bool":
            return {"sum": mpi.LOR, "max": mpi.LOR, "bor": mpi.LOR, "prod": mpi.LAND,
                    "min": mpi.LAND, "band": mpi.LAND, "bxor": mpi.LXOR}[name]  # fmt: skip
        if dtype.name not in ("float16", "bfloat16"):
            return {
                "sum": mpi.SUM,
                "avg": mpi.SUM,
                "max": mpi.MAX,
                "min": mpi.MIN,
                "prod": mpi.PROD,
                "band": mpi.BAND,
                "bor": mpi.BOR,
                "bxor": mpi.BXOR,
            }[name]
        found = self._ops.get((dtype.name, name))
        if found is None:
            found = mpi.Op.Create(_combiner(dtype, name), commute=True)
            self._ops[(dtype.name, name)] = found
        return found

    def close(self, pending: bool) -> None:
        """Free what we made, unless calls are still in MPI (then they keep it: MPI has no
        cancel for collectives, and freeing what a pending call uses is erroneous)."""
        self.endpoint.cancel()
        if self._helper is not None:
            self._helper.stop(0.0 if pending else 1.0)
        if pending:
            return
        for op in self._ops.values():
            op.Free()
        for kind in self._types.values():
            kind.Free()
        for comm in (self._data, self._control, self._p2p, self._blocking):
            comm.Free()


def _combiner(dtype: DType, op: str) -> Any:
    """A user-defined MPI reduction: inout = in (op) inout, exactly as the native engine."""

    def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        incoming = np.frombuffer(inbuf, dtype=dtype.storage)
        acc = np.frombuffer(inoutbuf, dtype=dtype.storage)
        combine(dtype, op, acc, incoming, incoming_first=True)

    return reduce
