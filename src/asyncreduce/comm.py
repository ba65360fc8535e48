"""The public communicator: non-blocking collectives that any thread may post.

Theory of operation. A call checks its arguments in the calling thread, and asks the backend
whether it can run them (a bad call raises ``UsageError`` before anything is numbered or sent,
so ranks stay in step), gives the operation its key
(keys.py: the ``name`` plus how many times this rank posted it before; named operations may
be posted in any order on each rank, unnamed ones, as in MPI, in the same order everywhere),
makes its ``Request`` and hands a ``Plan`` of it to the backend (backends/): our own engine,
an ordered one (MPI, torch.distributed), or, in a world of one, nothing at all.

The caller must not touch the buffer until the request completes; afterwards the result is
in place (or in a new object, for ``inplace=False``, allgather and reduce_scatter).

A group (``group``) is a communicator of some of the ranks over the same engine and
connections: its operations are keyed under a prefix of its own (keys.py, which also keys
point-to-point operations), and its backend runs them in its own numbering.
"""

from __future__ import annotations

import atexit
import logging
import operator
import os
import time
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np

from . import forks, plans
from .algorithms import Array
from .backends import Backend, backend_for
from .backends.native import DirectCalls, NativeBackend
from .backends.ordered.engine import OrderedEngine
from .blocking import BlockingCalls
from .buffers import as_buffer
from .collectives import Collectives
from .engine import Engine
from .errors import BrokenError, ClosedError, UsageError
from .keys import Key, Keys
from .plans import Plan
from .request import CallbackRunner, Request
from .samehost.cma import CrossMemory
from .samehost.planes import DataPlane
from .samehost.window import WindowError, array_layout

__all__ = ["Communicator"]

log_ops = logging.getLogger("asyncreduce.ops")  # a line per operation, when asked for:
if log_ops.level == logging.NOTSET:  # off even under logging.basicConfig(level=DEBUG),
    log_ops.setLevel(logging.INFO)  # unless the program set this logger's level first
_WINDOW = "asyncreduce/window"  # the key of shared_empty's own collectives
_OPEN: weakref.WeakSet[Communicator] = weakref.WeakSet()


def _label(kind: str, name: str | None, key: Key) -> str:
    """How an operation is named in errors, logs and the flight record."""
    return f"{kind} {name!r}#{key[1]}" if name else f"{kind} #{key[1]}"


@atexit.register
def _close_forgotten() -> None:
    """A program that ends without close() still says goodbye, so its peers see an orderly close."""
    for comm in list(_OPEN):
        comm.close()


class Communicator(Collectives, BlockingCalls):
    """A group of ``world_size`` ranks that run collectives together (see ``init``).

    ``local_rank`` and ``local_world_size``: this rank's place among the ranks on its host
    (from the launcher, or counted at init), e.g. to pick a GPU. Each ``iX`` call starts an
    operation and returns its ``Request``; ``X`` (blocking.py) is ``iX(...).wait()``."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        engine: Engine | OrderedEngine | Backend | None,
        one_host: bool = False,
        cross: CrossMemory | None = None,
        local: tuple[int, int] = (0, 1),
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank, self.local_world_size = local  # among the ranks on this host
        self._backend = backend_for(engine, rank, world_size, one_host, cross)
        self._planes = self._backend.planes  # shared windows and cross-memory attach
        self._clock_origin = time.perf_counter()  # a world of one: now; else set by init
        self._runner = CallbackRunner(f"asyncreduce-callbacks-{rank}")
        self._keys = Keys()
        self._closed = False
        self._generation = forks.generation()
        self._pid = os.getpid()
        self._parent: Communicator | None = None  # a group: the communicator it lives on
        self.admission: Any = None  # a rejoined rank's: where it stands (bootstrap/doors.py)
        here = self._backend  # (a group's, renumbered, runs its own: NativeBackend.run_waiting)
        whole = isinstance(here, NativeBackend) and here.whole
        self._direct = DirectCalls(here) if whole else None  # type: ignore[arg-type]
        _OPEN.add(self)

    # ---- collectives ---------------------------------------------------------------------

    def iallreduce(
        self, x: Any, op: str = "sum", *, name: str | None = None, priority: int = 0,
        timeout: float | None = None, inplace: bool = True,
    ) -> Request[Any]:  # fmt: skip
        """Start reducing ``x`` over all ranks with ``op`` (sum, avg, max, min, prod)."""
        return self._submit(self._allreduce_plan(x, op, inplace), name, priority, timeout)

    def allreduce(
        self, x: Any, op: str = "sum", *, name: str | None = None, priority: int = 0,
        timeout: float | None = None, inplace: bool = True,
    ) -> Any:  # fmt: skip
        """``iallreduce(...).wait()``. A small one runs on this thread while nothing else
        needs to move (``Lane.run_waiting`` where the same-host lane takes it, else
        ``Engine.run_direct`` over the sockets): no request, no hand-off to another thread; it
        is the call most small operations make."""
        direct = self._direct
        if direct is not None and type(x) is np.ndarray and inplace and timeout is None and (
            type(op) is str and type(priority) is int
        ):  # fmt: skip  # (the most frequent call: DirectCalls; anything else, below)
            prepared = direct.prepared(x, op)
            if prepared is not None and self._open():
                key = self._keys.next(name)
                label = _label("allreduce", name, key)
                made = direct.allreduce(x, prepared, op, key, label, priority, self._runner)
                return x if made is None else made.wait()
        return self._run_waiting(self._allreduce_plan(x, op, inplace), name, priority, timeout)

    def barrier(self, *, name: str | None = None, timeout: float | None = None) -> None:
        """``ibarrier(...).wait()``, on this thread where nothing else needs to move, as
        ``allreduce``: it is as short."""
        direct = self._direct
        if direct is not None and timeout is None and self._open():  # (as allreduce's)
            key = self._keys.next(name)
            made = direct.barrier(key, _label("barrier", name, key), self._runner)
            if made is not None:
                made.wait()
            return
        self._run_waiting(plans.barrier(), name, 0, timeout)

    def _run_waiting(
        self, plan: Plan, name: str | None, priority: int, timeout: float | None
    ) -> Any:
        """``_submit(...).wait()`` for a blocking call that may run on this thread
        (``NativeBackend.run_waiting``)."""
        here = self._backend
        if not isinstance(here, NativeBackend):
            return self._submit(plan, name, priority, timeout).wait()
        key, label = self._numbered(plan, name, priority, timeout)
        made = here.run_waiting(plan, key, label, priority, timeout, self._runner)
        return plan.result() if made is None else made.wait()

    def _allreduce_plan(self, x: Any, op: str, inplace: bool) -> Plan:
        on_device = self._backend.devices and self._on_device(x, inplace)  # (most: numpy, CPU)
        buf = on_device or as_buffer(x, "x", inplace=inplace)
        self._check_reduction(op, buf)
        return Plan("allreduce", buf, lambda: buf.original, op)

    # ---- groups --------------------------------------------------------------------------

    def group(self, ranks: Sequence[int]) -> Communicator:
        """A communicator of ``ranks`` (of this one; group rank ``i`` is ``ranks[i]``) over this
        one's connections: no new socket, however many groups. Every member calls it with the
        same ranks, as often; other ranks need not call it. Closing a group closes only it."""
        members = tuple(operator.index(r) for r in ranks)
        if len(set(members)) != len(members) or not all(0 <= r < self.world_size for r in members):
            raise UsageError(f"a group needs distinct ranks of 0..{self.world_size - 1}, "
                             f"got {list(members)}")  # fmt: skip
        if self.rank not in members:
            raise UsageError(f"rank {self.rank} is not in the group {list(members)}")
        backend = self._backend.group(members)  # (UsageError where groups are not offered)
        root = self._parent or self
        view = Communicator(members.index(self.rank), len(members), backend,
                            local=(self.local_rank, self.local_world_size))  # fmt: skip
        view._runner.close()
        view._runner, view._parent = root._runner, root
        view._keys = self._keys.for_group(members, backend.members)
        view._clock_origin = self._clock_origin
        return view

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
        dims, kind = array_layout(shape, dtype)
        if not self._planes.offers_windows:
            return np.empty(dims, kind)
        try:
            return self._planes.windows.array(
                self.rank,
                dims,
                kind,
                lambda record: self.allgather(record, name=_WINDOW, timeout=timeout),
                lambda: self.barrier(name=_WINDOW, timeout=timeout),
            )
        except WindowError as exc:
            self.abort(f"rank {self.rank}: shared_empty: {exc}")
            raise BrokenError(f"shared_empty on rank {self.rank}: {exc}") from exc

    # ---- life cycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Fail pending requests with ClosedError, then close every socket and join every thread.

        In a forked child it only marks this copy closed: the connections are the parent's;
        a group closes only itself."""
        self._closed = True
        if self._forked() or self._parent is not None:
            return
        self._backend.close()
        self._runner.close()
        self._planes.close()

    def abort(self, reason: str = "") -> None:
        """Give up now, on every rank: pending requests here fail with BrokenError, every other
        rank's communicator breaks within a heartbeat with ``reason`` (an ABORT frame), and
        this one closes without waiting for anybody. Returns within about a second."""
        self._closed = True
        if self._forked():
            return
        if self._parent is not None:  # a group's failure is its communicator's
            self._parent.abort(reason)
            return
        self._backend.abort(reason)
        self._runner.close()
        self._planes.close()

    def flight_record(self) -> dict[str, Any]:
        """The last operations of this rank as a JSON-ready dict (see ``asyncreduce.flight``)."""
        return self._backend.flight_record()

    def dump_flight_record(self, path: str) -> str:
        """Write ``flight_record()`` as JSON to ``path`` (a file or a directory); return the file.

        ``asyncreduce culprit DIR`` reads every rank's dump and names what went wrong."""
        return self._backend.dump_flight_record(path)

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
        return self._backend.stall_reports

    @property
    def data_plane(self) -> DataPlane:
        """Which data plane this communicator's operations use, e.g. ``comm.data_plane.engine``
        ("native", "mpi", "torch (nccl)", "local"), ``.shared_memory`` (every peer through
        shared-memory arenas), ``.cross_memory`` (large allreduces read the peers' memory in
        place), ``.windows`` (``shared_empty`` makes shared windows): see ``DataPlane``."""
        return self._backend.data_plane

    # ---- what tests and diagnostics read (not an API: see data_plane) --------------------

    @property
    def _engine(self) -> Engine | OrderedEngine | None:
        return self._backend.engine

    @property
    def _ordered(self) -> OrderedEngine | None:
        return self._backend.ordered

    @property
    def _cross(self) -> CrossMemory | None:
        return self._planes.cross

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

    def _submit(
        self, plan: Plan, name: str | None, priority: int, timeout: float | None,
        key_name: str | None = None,
    ) -> Request[Any]:  # fmt: skip
        """Number and start one operation. ``key_name``: the key's name when it is not the
        user's ``name`` (point-to-point)."""
        key, label = self._numbered(plan, name, priority, timeout, key_name)
        request: Request[Any] = Request(label, self._runner)
        self._backend.submit(plan, key, label, priority, timeout, request)
        return request

    def _open(self) -> bool:
        """Whether a post may go on: neither this communicator nor the one it lives on is
        closed, and this is the process that made it (``_numbered`` says which is not)."""
        parent = self._parent
        return not (self._closed or (parent is not None and parent._closed)) and (
            forks.generation() == self._generation
        )  # fmt: skip

    def _numbered(
        self, plan: Plan, name: str | None, priority: int, timeout: float | None,
        key_name: str | None = None,
    ) -> tuple[Key, str]:  # fmt: skip
        """Check what every post is checked for, then the operation's key and label."""
        kind = plan.kind
        if not isinstance(priority, int):
            raise UsageError(f"priority must be an int, got {priority!r}")
        if timeout is not None and not timeout > 0:
            raise UsageError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        if not self._open():
            if self._closed or (self._parent is not None and self._parent._closed):
                raise ClosedError(f"{kind}: the communicator is closed")
            self._check_process(kind)
        refused = self._backend.refusal(plan, priority)
        if refused is not None:
            raise UsageError(refused)
        shown = name or key_name
        key = self._keys.next(name if key_name is None else key_name)
        return key, _label(kind, shown, key)
