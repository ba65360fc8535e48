"""The torch.distributed engine: what ``ar.init(backend="torch", group=...)`` runs on, over any
initialized group (gloo, nccl, ...).

Theory of operation. The ordered engine's thread issues every call with ``async_op=True`` and
polls the works. Beside the caller's group there is a Gloo group of the same ranks (made at
init) where the caller's group cannot take host memory (NCCL): it carries the operations on
CPU tensors and numpy arrays. The control channel travels on a native communicator
(native.py says why).

CUDA tensors go to the caller's group as they are, with no staging through the host. The
stream hand-off uses events: at post, an event is recorded on the posting thread's current
stream; the engine thread makes its own stream wait on it before the collective, and records
a second event after it. The request then completes at once (the work is queued on the GPU),
and ``wait`` makes the caller's current stream wait on that second event: the CPU does not
block, and kernels the caller queues afterwards see the result.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...algorithms import DType
from ...errors import UsageError
from .channel import Endpoint
from .native import NativeEndpoint
from .posted import Posted, Running

__all__ = ["TorchAdapter", "destroy_groups", "refused"]

_EXCHANGE_TAG, _P2P_TAG = (1 << 40) + 1, 1 << 62  # native tags (a user tag t: t + _P2P_TAG)


def refused(dtype: DType, op: str | None, kind: str) -> str | None:
    """Why torch.distributed (Gloo) cannot do this (None: it can), for a UsageError at post."""
    if dtype.name == "int16":
        return "torch.distributed's Gloo has no int16: use int32"
    if dtype.is_complex and op in ("prod",) and kind in ("allreduce", "reduce", "reduce_scatter"):
        return "torch.distributed reduces complex tensors with sum and avg only"
    return None


class _Works:
    """torch works that finish together; ``done`` polls them and raises a failure."""

    def __init__(self, works: list[Any], after: Any = None, keep: Any = None) -> None:
        self._works, self._after, self._keep = works, after, keep

    def done(self) -> bool:
        if not all(w.is_completed() for w in self._works):
            return False
        for w in self._works:
            w.wait()  # finished: returns at once, or raises what went wrong
        if self._after is not None:
            self._after()
        return True


class _Requests:
    """Native requests that finish together."""

    def __init__(self, requests: list[Any]) -> None:
        self._requests = requests

    def done(self) -> bool:
        if not all(r.done() for r in self._requests):
            return False
        for r in self._requests:
            r.result()  # raises what failed
        return True


class _Queued:
    """A CUDA collective queued on the engine's stream: done for the CPU at once."""

    def done(self) -> bool:
        return True


class TorchAdapter:
    """Agreed operations as torch.distributed calls; built on the ordered engine's thread."""

    name = "torch"
    devices = True  # takes CUDA tensors as they are
    max_tag = (1 << 62) - 1  # user tags travel on the native communicator, offset by 2**62

    def __init__(self, group: Any, host: Any, endpoint: NativeEndpoint) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self._group = group
        self.backend = str(dist.get_backend(group))
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._host = host  # the group for host memory: ``group`` itself unless it is NCCL's
        self.name = f"torch ({self.backend})"
        self.endpoint: Endpoint = endpoint
        self._native = endpoint  # its communicator also carries exchanges and sends
        self._streams: dict[Any, Any] = {}
        self._queued: dict[Any, Any] = {}  # device: the event after our last collective there
        R = dist.ReduceOp
        self._ops = {"sum": R.SUM, "avg": R.SUM, "max": R.MAX, "min": R.MIN, "prod": R.PRODUCT,
                     "band": R.BAND, "bor": R.BOR, "bxor": R.BXOR}  # fmt: skip

    def refuses(self, kind: str, dtype: DType, op: str | None) -> str | None:
        """Why this engine cannot run it (the caller gets a UsageError), or None."""
        return refused(dtype, op, kind)

    def at_post(self, op: Posted) -> None:
        """On the posting thread: mark where its stream is, for a CUDA tensor."""
        if getattr(op.flat, "is_cuda", False):
            op.ready = self._torch.cuda.Event()  # type: ignore[no-untyped-call]
            op.ready.record(self._torch.cuda.current_stream(op.flat.device))

    def start(self, op: Posted, flat: Any) -> Running:
        if getattr(flat, "is_cuda", False):
            return self._on_device(op, flat)
        dist, group, kind = self._dist, self._host, op.kind
        tensor = _tensor(self._torch, flat, op.dtype)
        root = dist.get_global_rank(group, op.root) if kind in ("broadcast", "reduce") else 0
        if kind == "allreduce":
            return _Works([dist.all_reduce(tensor, self._ops[op.op or "sum"], group, True)], None,
                          tensor)  # fmt: skip
        if kind == "broadcast":
            return _Works([dist.broadcast(tensor, root, group, True)], None, tensor)
        if kind == "reduce":
            return _Works([dist.reduce(tensor, root, self._ops[op.op or "sum"], group, True)],
                          None, tensor)  # fmt: skip
        if kind == "allgather":
            mine = tensor.view(self.world_size, -1)[self.rank].clone()
            work = dist.all_gather_into_tensor(tensor, mine, group, True)
            return _Works([work], None, (tensor, mine))
        if kind == "reduce_scatter":  # Gloo has no reduce_scatter_tensor: reduce a copy
            whole = tensor.clone()
            work = dist.all_reduce(whole, self._ops[op.op or "sum"], group, True)
            mine = tensor.view(self.world_size, -1)[self.rank]
            return _Works([work], lambda: mine.copy_(whole.view(self.world_size, -1)[self.rank]),
                          whole)  # fmt: skip
        if kind == "barrier":  # (a Gloo barrier's work never says it completed: measured)
            token = self._torch.zeros(1)
            return _Works([dist.all_reduce(token, dist.ReduceOp.SUM, group, True)], None, token)
        return self._exchange(op)

    def _exchange(self, op: Posted) -> Running:
        """gather, scatter, alltoall and point-to-point: sends and receives on the native
        communicator of the control channel (a Gloo point-to-point work cannot be polled)."""
        native, to_native = self._native.native, self._native.to_native
        tag = _EXCHANGE_TAG if op.kind != "p2p" else _P2P_TAG + (op.tag or 0)
        requests = [native.isend(a, to_native(p), tag=tag) for p, a in (op.sends or {}).items()]
        requests += [native.irecv(a, to_native(p), tag=tag) for p, a in (op.recvs or {}).items()]
        return _Requests(requests)

    def _on_device(self, op: Posted, tensor: Any) -> Running:
        """A CUDA tensor: ordered after its producer by event, straight to the group (NCCL)."""
        torch, dist = self._torch, self._dist
        if op.kind not in ("allreduce", "broadcast"):
            raise UsageError(f"{op.kind} of CUDA tensors is not offered over backend='torch'")
        stream = self._streams.get(tensor.device)
        if stream is None:
            stream = self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
        with torch.cuda.stream(stream):
            if op.ready is not None:
                stream.wait_event(op.ready)
            if op.kind == "broadcast":
                root = dist.get_global_rank(self._group, op.root)
                work = dist.broadcast(tensor, root, self._group, True)
            else:
                reduce = self._ops[op.op or "sum"]
                nccl = "nccl" in self.backend
                if op.op == "avg" and nccl:
                    reduce = dist.ReduceOp.AVG
                work = dist.all_reduce(tensor, reduce, self._group, True)
            work.wait()  # NCCL: the current stream (ours) waits for it; the CPU does not
            if op.op == "avg" and not nccl:
                tensor.div_(self.world_size)
            done = torch.cuda.Event()
            done.record(stream)
        tensor.record_stream(stream)
        self._queued[tensor.device] = done
        op.request.on_wait = lambda: torch.cuda.current_stream(tensor.device).wait_event(done)
        return _Queued()

    def close(self, pending: bool) -> None:
        """Close the control channel's communicator; destroy the groups init made for us
        (each holds descriptors and threads, and under NCCL its GPU buffers), unless a call
        of ours may still be in one: then they are left to it. Destroying a group is local."""
        try:
            self.endpoint.cancel()
        finally:
            if not pending and all(event.query() for event in self._queued.values()):
                destroy_groups(self._group, self._host)  # (``query`` never blocks; the
                self._group = self._host = None  # shutdown of a group with work queued may)


def destroy_groups(*groups: Any) -> None:
    """Destroy the torch process groups ``groups`` (each once; gone already: nothing)."""
    from torch.distributed import distributed_c10d as c10d

    done: list[Any] = []
    for group in groups:
        if group is None or any(group is d for d in done) or group not in c10d._world.pg_map:
            continue
        c10d.destroy_process_group(group)
        done.append(group)


def _tensor(torch: Any, flat: Any, dtype: DType) -> Any:
    """A host tensor over a flat numpy array (bfloat16 travels as its 16-bit patterns)."""
    if dtype.name == "bfloat16":
        return torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(flat)
