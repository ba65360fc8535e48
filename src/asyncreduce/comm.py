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
import socket
import struct
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np

from . import cma, forks
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
from .engine import Engine, Operation, Settings
from .errors import BrokenError, ClosedError, UsageError
from .rendezvous import Store, gather, store_from_env_or_args
from .request import CallbackRunner, Request
from .transport.frame import MAX_NAME_BYTES, Descriptor
from .transport.shm import Arena, create_arena, host_identity, open_arena
from .transport.tcp import TcpTransport, connect_mesh
from .window import WindowError, Windows

__all__ = ["Communicator", "init"]

log = logging.getLogger("asyncreduce.comm")
log_ops = logging.getLogger("asyncreduce.ops")  # a line per operation, when asked for:
log_ops.setLevel(logging.INFO)  # off even under logging.basicConfig(level=DEBUG)
_EMPTY = np.empty(0, dtype=np.uint8)
_WINDOW = "asyncreduce/window"  # the key of shared_empty's own collectives
_OPEN: weakref.WeakSet[Communicator] = weakref.WeakSet()


@atexit.register
def _close_forgotten() -> None:
    """A program that ends without close() still says goodbye, so its peers see an orderly close."""
    for comm in list(_OPEN):
        comm.close()


class Communicator:
    """A group of ``world_size`` ranks that run collectives together (see ``init``)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        engine: Engine | None,
        one_host: bool = False,
        cross: CrossMemory | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
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


# ---- building a communicator -----------------------------------------------------------------


def _remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (monotonic), never quite zero: a timeout to pass on."""
    return max(0.001, deadline - time.monotonic())


def _env_int(*names: str) -> int | None:
    for n in names:
        if os.environ.get(n):
            try:
                return int(os.environ[n])
            except ValueError:
                raise UsageError(
                    f"environment variable {n}={os.environ[n]!r} is not an integer"
                ) from None
    return None


def _mpirun_default(addr: str | None, port: int | None) -> tuple[str | None, int | None]:
    """Under mpirun on one host, a store address every rank of the job derives alike."""
    size, local_size = _env_int("OMPI_COMM_WORLD_SIZE"), _env_int("OMPI_COMM_WORLD_LOCAL_SIZE")
    job = os.environ.get("OMPI_MCA_ess_base_jobid", "")  # noqa: SIM112 (Open MPI's spelling)
    if size is None or size != local_size or not job.isdigit():
        return addr, port
    # below Linux's ephemeral range (32768 and up), where no connection of ours can hold it
    return addr or "127.0.0.1", port if port is not None else 12000 + int(job) % 20000


def _local_address(master_addr: str) -> str:
    """The address of this host on the route to the master (no packet is sent)."""
    override = os.environ.get("ASYNCREDUCE_ADDR")
    if override:
        return override
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_addr, 9))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _share_memory(
    store: Store, rank: int, world_size: int, deadline: float
) -> tuple[dict[int, tuple[Arena, Arena]], dict[int, str]]:
    """Shared-memory arenas with every rank on this host: {peer: (arena we write, arena we read)},
    and for every other peer why it is TCP only.

    Arena files are unlinked once every rank has mapped its arenas, so nothing is left behind
    however the job ends. ASYNCREDUCE_SHM=0 on any rank keeps that rank on TCP only (its
    identity then matches nobody's, so both sides of each pair agree).
    """
    enabled = os.environ.get("ASYNCREDUCE_SHM", "1") != "0"
    me = host_identity() if enabled else f"tcp-only-{rank}-{os.getpid()}"
    remaining = _remaining(deadline)
    idents = gather(store, "asyncreduce/host", rank, world_size, me.encode(), remaining)
    local = [p for p in range(world_size) if p != rank and idents[p] == me.encode()]
    tcp_only = {
        p: "ASYNCREDUCE_SHM=0 here" if not enabled
        else f"ASYNCREDUCE_SHM=0 on rank {p}" if idents[p].startswith(b"tcp-only-")
        else "another host"
        for p in range(world_size) if p != rank and p not in local
    }  # fmt: skip
    outgoing: dict[int, tuple[str, Arena]] = {}
    arenas: dict[int, tuple[Arena, Arena]] = {}
    try:
        for peer in local:
            outgoing[peer] = create_arena()
            store.set(f"asyncreduce/shm/{rank}/{peer}", outgoing[peer][0].encode())
        for peer in local:
            wait = _remaining(deadline)
            theirs = store.get(f"asyncreduce/shm/{peer}/{rank}", wait).decode()
            arenas[peer] = (outgoing[peer][1], open_arena(theirs))
        gather(
            store,
            "asyncreduce/shm-mapped",
            rank,
            world_size,
            b"",
            _remaining(deadline),
        )
    except BaseException:
        for _, arena in outgoing.values():
            arena.close()
        for _, incoming in arenas.values():
            incoming.close()
        raise
    finally:
        for path, _ in outgoing.values():
            os.unlink(path)
    return arenas, tcp_only


_CHALLENGE = 16  # bytes of the random challenge each rank sends each other rank


def _cross_memory(
    store: Store, rank: int, world_size: int, deadline: float
) -> tuple[CrossMemory | None, str]:
    """Cross-memory attach with every peer (all on this host), if every rank can read every
    other's memory (see cma.py): each rank sends each other a random challenge through the
    store, keeps those it was sent in its own memory and says where, and reads its own back
    from every peer's pid. ASYNCREDUCE_CMA=0 on any rank turns it off for all; a rank that
    could not read logs why, once. Returns the reader (None: off) and why it is off."""
    wanted = os.environ.get("ASYNCREDUCE_CMA", "1") != "0" and cma.available()
    mine = [os.urandom(_CHALLENGE) for _ in range(world_size)]  # mine[p]: what p must hold
    record = struct.pack("<Q", os.getpid()) + b"".join(mine) if wanted else b""
    records = gather(store, "asyncreduce/cma", rank, world_size, record, _remaining(deadline))
    sizes_ok = all(len(r) == 8 + _CHALLENGE * world_size for r in records)
    held = np.frombuffer(  # the challenges sent to this rank, in rank order, kept alive below
        b"".join(r[8 + _CHALLENGE * rank :][:_CHALLENGE] for r in records) if sizes_ok else b"",
        np.uint8,
    ).copy()
    where = struct.pack("<Q", held.ctypes.data) if sizes_ok else b""
    places = gather(store, "asyncreduce/cma-at", rank, world_size, where, _remaining(deadline))
    pids = {p: struct.unpack("<Q", r[:8])[0] for p, r in enumerate(records) if sizes_ok}
    why = _unreadable(rank, pids, places, mine) if wanted and sizes_ok else "not every rank can"
    verdict = b"" if why else b"1"
    verdicts = gather(store, "asyncreduce/cma-ok", rank, world_size, verdict, _remaining(deadline))
    del held  # every rank has read it
    if why and wanted:
        log.info(
            "rank %d: cross-memory attach is off (%s); large allreduces of ordinary buffers "
            "take the ring through the arenas. Yama ptrace_scope 0 or CAP_SYS_PTRACE would "
            "allow it; ASYNCREDUCE_CMA=0 turns it off without trying", rank, why,
        )  # fmt: skip
    if not all(verdicts):
        return None, why or "another rank cannot read" if wanted else "ASYNCREDUCE_CMA=0"
    return CrossMemory({p: pid for p, pid in pids.items() if p != rank}), ""


def _unreadable(
    rank: int, pids: dict[int, int], places: list[bytes], mine: list[bytes]
) -> str | None:
    """Why this rank cannot read some peer's challenge back from its pid, or None."""
    if len(set(pids.values())) != len(pids):
        return "two ranks announced the same process"
    for peer, pid in pids.items():
        if peer == rank:
            continue
        if not cma.owned_by_me(pid) or len(places[peer]) != 8:
            return f"rank {peer} announced process {pid}, not another process of this user"
        address = struct.unpack("<Q", places[peer])[0] + _CHALLENGE * rank
        failure = cma.probe(pid, address, mine[peer])
        if failure is not None:
            return f"reading rank {peer} (process {pid}): {failure}"
    return None


def _leave_store(store: Store, rank: int, world_size: int, deadline: float) -> None:
    """Rank 0 serves the store: it closes it only once every other rank is done with it."""
    if rank != 0:
        store.set(f"asyncreduce/left/{rank}", b"")
        return
    for peer in range(1, world_size):
        store.get(f"asyncreduce/left/{peer}", _remaining(deadline))


def init(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    *,
    init_method: str | None = None,
    timeout: float = 30.0,
) -> Communicator:
    """Join the job and connect to every other rank.

    Anything not given is read from the environment: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT (torchrun, ``asyncreduce run``), or OMPI_COMM_WORLD_RANK/SIZE and PMI_RANK/SIZE
    under mpirun (on one host, mpirun needs no MASTER_ADDR/MASTER_PORT: they derive from the
    job id; across hosts pass them with ``mpirun -x``). ``init_method`` may be
    ``tcp://host:port`` or ``file:///shared/dir``.
    Raises TimeoutError naming the ranks that did not join within ``timeout`` seconds.
    """
    launcher = "arguments" if rank is not None and world_size is not None else _launcher()
    rank = rank if rank is not None else _env_int("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    world_size = (
        world_size
        if world_size is not None
        else _env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    )
    if rank is None or world_size is None:
        raise UsageError(
            "rank and world_size are unknown: pass them, or set RANK and WORLD_SIZE "
            "(as torchrun and asyncreduce run do)"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} is not within a world of size {world_size}")
    if world_size == 1:
        return Communicator(0, 1, None)
    settings = Settings.from_env()  # a bad value fails here, before anyone waits for us
    master_addr = master_addr or os.environ.get("MASTER_ADDR")
    master_port = master_port if master_port is not None else _env_int("MASTER_PORT")
    if init_method is None and (master_addr is None or master_port is None):
        master_addr, master_port = _mpirun_default(master_addr, master_port)
    deadline = time.monotonic() + timeout
    store = store_from_env_or_args(rank, world_size, master_addr, master_port, init_method, timeout)
    try:
        host = _local_address(master_addr or "127.0.0.1")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind((host, 0))
            listener.listen(world_size)
            if rank == 0:
                store.set("asyncreduce/token", os.urandom(16))
            token = store.get("asyncreduce/token", _remaining(deadline))
            me = f"{host}:{listener.getsockname()[1]}".encode()
            # rank 0 serves the store: it waits a little longer, so the others time out on their
            # own (naming who is missing) instead of seeing the store vanish
            wait = _remaining(deadline) + (0.5 if rank == 0 else 0.0)
            found = gather(store, "asyncreduce/addr", rank, world_size, me, wait)
            addresses = [
                (a.decode().rsplit(":", 1)[0], int(a.decode().rsplit(":", 1)[1])) for a in found
            ]
            socks = connect_mesh(rank, world_size, listener, addresses, token, deadline)
            arenas, tcp_only = _share_memory(store, rank, world_size, deadline)
            one_host = len(arenas) == world_size - 1
            cross, no_cross = (
                _cross_memory(store, rank, world_size, deadline)
                if one_host
                else (None, "not every rank is on this host")
            )
            _leave_store(store, rank, world_size, deadline)
    finally:
        store.close()
    engine = Engine(rank, world_size, lambda s: TcpTransport(rank, socks, s, arenas), settings)
    comm = Communicator(rank, world_size, engine, one_host, cross)
    comm._clock_origin = _shared_clock_origin(comm, one_host, _remaining(deadline))
    log.info("%s", _describe(comm, launcher, sorted(arenas), tcp_only, one_host, no_cross))
    return comm


def _launcher() -> str:
    """Which launcher started this process, from the variables only it sets."""
    env = os.environ
    for marker, name in (
        ("TORCHELASTIC_RUN_ID", "torchrun"),
        ("ASYNCREDUCE_RUN", "asyncreduce run"),
        ("SLURM_PROCID", "srun"),
        ("OMPI_COMM_WORLD_RANK", "mpirun (Open MPI)"),
        ("PMI_RANK", "mpirun (PMI)"),
    ):
        if marker in env:
            return name
    return "environment" if "RANK" in env else "arguments"


def _describe(
    comm: Communicator, launcher: str, shared: list[int], tcp_only: dict[int, str],
    one_host: bool, no_cross: str,
) -> str:  # fmt: skip
    """The one INFO line of a new communicator: who, and which data plane to each peer."""
    planes = [f"rank {p}: shared memory (same host)" for p in shared]
    planes += [f"rank {p}: tcp ({why})" for p, why in sorted(tcp_only.items())]
    cross = "on" if comm._cross is not None else f"off ({no_cross})"
    windows = "on" if one_host else "off (not every rank is on this host)"
    return (
        f"rank {comm.rank} of {comm.world_size} joined (launcher: {launcher}); "
        f"{'; '.join(planes)}; cross-memory attach: {cross}; shared windows: {windows}"
    )


def _shared_clock_origin(comm: Communicator, one_host: bool, timeout: float) -> float:
    """This rank's clock reading of the instant rank 0 left a barrier at the end of init.

    On one host every process reads the same CLOCK_MONOTONIC, so rank 0's reading is the
    answer. Across hosts each rank takes, over five barriers, the median of its own reading
    minus rank 0's at the barrier's end, which is its clock's offset up to the barrier's skew
    (about one message latency)."""
    offsets = []
    for _ in range(1 if one_host else 5):
        comm.barrier(name="asyncreduce/clock", timeout=timeout)
        now = time.perf_counter()
        readings = comm.allgather(np.array([now]), name="asyncreduce/clock", timeout=timeout)
        rank0 = float(readings[0][0])
        offsets.append(0.0 if one_host else now - rank0)
    return rank0 + sorted(offsets)[len(offsets) // 2]
