"""The communicator's collectives beyond allreduce, and the argument checks every collective
makes in the calling thread: broadcast, allgather, reduce_scatter, barrier, reduce, gather,
scatter, all-to-all, send and receive, each checked, planned (plans.py) and handed to
``_submit`` (comm.py), which numbers and posts it. A bad call raises ``UsageError`` before
anything is numbered or sent, so ranks stay in step.

A mixin of ``Communicator`` (comm.py); allreduce stays there, with its fast paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import plans
from .algorithms import REDUCIBLE, reduction_refused
from .buffers import Buffer, as_buffer, device_buffer
from .errors import UsageError
from .keys import p2p_name
from .plans import Plan

if TYPE_CHECKING:
    from .backends import Backend
    from .request import Request

__all__ = ["Collectives"]


class Collectives:
    """The non-blocking collectives but allreduce, and the checks (see the module docstring)."""

    rank: int
    world_size: int
    _backend: Backend

    if TYPE_CHECKING:  # what the communicator that mixes these in provides

        def _submit(
            self, plan: Plan, name: str | None, priority: int, timeout: float | None,
            key_name: str | None = None,
        ) -> Request[Any]: ...  # fmt: skip

    def ibroadcast(
        self, x: Any, root: int = 0, *, name: str | None = None, priority: int = 0,
        timeout: float | None = None, inplace: bool = True,
    ) -> Request[Any]:  # fmt: skip
        """Start copying ``x`` of rank ``root`` into ``x`` of every rank."""
        buf = self._on_device(x, inplace) or as_buffer(x, "x", inplace=inplace)
        self._check_root(root)
        plan = Plan("broadcast", buf, lambda: buf.original, None, root)
        return self._submit(plan, name, priority, timeout)

    def iallgather(
        self, x: Any, *, name: str | None = None, priority: int = 0, timeout: float | None = None
    ) -> Request[Any]:
        """Start gathering every rank's ``x``; the result has shape (world_size, *x.shape)."""
        buf = as_buffer(x, "x", inplace=False)
        plan = plans.allgather(self.rank, self.world_size, buf)
        return self._submit(plan, name, priority, timeout)

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
        plan = plans.reduce_scatter(self.rank, self.world_size, buf, op)
        return self._submit(plan, name, priority, timeout)

    def ibarrier(self, *, name: str | None = None, timeout: float | None = None) -> Request[None]:
        """Start a barrier: completes once every rank has entered it."""
        return self._submit(plans.barrier(), name, 0, timeout)

    def ireduce(
        self, x: Any, op: str = "sum", root: int = 0, *, name: str | None = None,
        priority: int = 0, timeout: float | None = None,
    ) -> Request[Any]:  # fmt: skip
        """Start reducing ``x`` over all ranks into ``x`` of rank ``root``; the other ranks'
        ``x`` stay as they were (they reduce a copy)."""
        self._check_root(root)
        buf = as_buffer(x, "x", inplace=self.rank == root)
        self._check_reduction(op, buf)
        result = (lambda: buf.original) if self.rank == root else (lambda: x)
        return self._submit(Plan("reduce", buf, result, op, root), name, priority, timeout)

    def igather(
        self, x: Any, root: int = 0, *, name: str | None = None, priority: int = 0,
        timeout: float | None = None,
    ) -> Request[Any]:  # fmt: skip
        """Start collecting every rank's ``x`` on rank ``root``: its result has shape
        (world_size, *x.shape); the other ranks' is None."""
        self._check_root(root)
        buf = as_buffer(x, "x", inplace=False, copy=False)
        plan = plans.gather(self.rank, self.world_size, buf, root)
        return self._submit(plan, name, priority, timeout)

    def iscatter(
        self, out: Any, source: Any = None, root: int = 0, *, name: str | None = None,
        priority: int = 0, timeout: float | None = None,
    ) -> Request[Any]:  # fmt: skip
        """Start filling ``out`` of every rank with its block of ``source`` (rank ``root``
        only: shape (world_size, *out.shape)); the result is ``out``."""
        self._check_root(root)
        buf = as_buffer(out, "out")
        src = None if self.rank != root else as_buffer(source, "source", inplace=False, copy=False)
        want = (self.world_size, *buf.shape)
        if src is not None and (src.shape != want or src.dtype != buf.dtype):
            raise UsageError(f"scatter's source on the root must be {buf.dtype.name} of shape "
                             f"{want}; it is {src.dtype.name} {src.shape}")  # fmt: skip
        plan = plans.scatter(self.rank, self.world_size, buf, src, root)
        return self._submit(plan, name, priority, timeout)

    def ialltoall(
        self, x: Any, *, name: str | None = None, priority: int = 0, timeout: float | None = None
    ) -> Request[Any]:
        """Start sending block ``j`` of ``x``'s first axis (split world_size ways) to rank
        ``j``; the result, a new object like ``x``, holds rank ``i``'s block ``rank`` at ``i``."""
        buf = as_buffer(x, "x", inplace=False, copy=False)
        if not buf.shape or buf.shape[0] % self.world_size:
            raise UsageError(f"alltoall needs the first axis of x divisible by "
                             f"world_size={self.world_size}; x has shape {buf.shape}")  # fmt: skip
        plan = plans.alltoall(self.rank, self.world_size, buf)
        return self._submit(plan, name, priority, timeout)

    def isend(
        self, x: Any, dst: int, *, tag: int = 0, priority: int = 0, timeout: float | None = None
    ) -> Request[None]:
        """Start sending ``x`` to rank ``dst``, matched by its ``irecv(..., src=this rank,
        tag=tag)`` (sends with one tag to one rank are received in the order posted)."""
        self._check_peer(dst, "dst")
        buf = as_buffer(x, "x", inplace=False, copy=False)
        plan = plans.send(self.rank, self.world_size, buf, dst, tag)
        return self._submit(plan, None, priority, timeout, p2p_name(self.rank, dst, tag))

    def irecv(
        self, x: Any, src: int, *, tag: int = 0, priority: int = 0, timeout: float | None = None
    ) -> Request[Any]:
        """Start receiving into ``x`` what rank ``src`` sends with ``tag``; the result is ``x``."""
        self._check_peer(src, "src")
        buf = as_buffer(x, "x")
        plan = plans.receive(self.rank, self.world_size, buf, src, tag)
        return self._submit(plan, None, priority, timeout, p2p_name(src, self.rank, tag))

    def _post_exchange(
        self, kind: str, anchor: Any, sends: dict[int, Any], recvs: dict[int, Any], root: int,
        timeout: float | None, count: int | None = None,
    ) -> Request[None]:  # fmt: skip
        """An unnamed direct exchange of arrays or tensors of ``anchor``'s dtype (the torch
        backend's gather, scatter and all-to-all); its count is ``anchor``'s, or ``count``."""
        buf = as_buffer(anchor, "x", inplace=False, copy=False)
        out = {r: self._same_kind(as_buffer(x, "output"), buf).flat for r, x in recvs.items()}
        into = {r: self._same_kind(as_buffer(x, "input", inplace=False, copy=False), buf).flat
                for r, x in sends.items()}  # fmt: skip
        plan = plans.exchange(kind, self.rank, self.world_size, buf, into, out, lambda: None,
                              root, count)  # fmt: skip
        return self._submit(plan, None, 0, timeout)

    def _same_kind(self, buf: Buffer, like: Buffer) -> Buffer:
        if buf.dtype != like.dtype:
            raise UsageError(f"every tensor must be {like.dtype.name}; one is {buf.dtype.name}")
        return buf

    # ---- checks ------------------------------------------------------------------------

    def _on_device(self, x: Any, inplace: bool) -> Buffer | None:
        """A CUDA tensor for an engine that takes it as it is (backend="torch"), else None."""
        if not self._backend.devices:
            return None
        buf = device_buffer(x, "x")
        if buf is not None and not inplace:
            raise UsageError("a CUDA tensor over backend='torch' is reduced in place only")
        return buf

    def _check_reduction(self, op: str, buf: Buffer) -> None:
        if not (isinstance(op, str) and (buf.dtype.code, op) in REDUCIBLE):  # (one set look)
            raise UsageError(reduction_refused(buf.dtype, op) or f"op={op!r} is refused")

    def _check_root(self, root: Any) -> None:
        if not (isinstance(root, int) and 0 <= root < self.world_size):
            raise UsageError(
                f"root={root!r} is not a rank of this communicator (0..{self.world_size - 1})"
            )

    def _check_peer(self, peer: Any, what: str) -> None:
        if not (isinstance(peer, int) and 0 <= peer < self.world_size) or peer == self.rank:
            raise UsageError(f"{what}={peer!r} is not another rank of this communicator "
                             f"(0..{self.world_size - 1}, not {self.rank})")  # fmt: skip
