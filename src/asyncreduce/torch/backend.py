"""asyncreduce as a torch.distributed backend: ``dist.init_process_group("asyncreduce")``.

Theory of operation. ``import asyncreduce.torch`` registers the backend. When torch creates a
process group of it, ``_create`` gets torch's store (already scoped to that group), the
group's rank and size and the global ranks in it, and returns an ``AsyncReduceProcessGroup``
(a pure-Python ``torch.distributed.ProcessGroup``):

* the first group of a process connects a communicator through torch's store (no second store
  is served; see bootstrap/native.py); every later group is a ``Communicator.group`` of it, so
  every group shares the process's connections: one per pair of ranks, however many groups;
* each group posts its operations on a group of its own, unnamed, so they are matched by
  order as torch's API requires, and never mix with the communicator's own unnamed operations;
* a collective turns torch's arguments into one of the communicator's operations on numpy
  views of the tensors (no copy where the layouts allow); allreduce and broadcast of a CUDA
  tensor (what DDP sends) are staged through pinned host memory (staging.py), named by a
  count of the group's staged operations; it returns a ``Work`` whose
  ``wait()`` waits for it and whose ``get_future()`` is completed with the output tensors
  (an error is set on the future), as Gloo's are.

``communicator(group)`` hands out the communicator behind a group, so ``DataParallel`` and
``dist.*`` can share one set of connections. The group itself holds it (no registry keyed by
anything a later group could share), and lets go of it when torch shuts the group down.

torch names each group's keys in the store by the group's name, and a group made after
``destroy_process_group()`` gets the name, so the keys, of the one before (on purpose: so
that ranks restarted after a failure agree). Each connect therefore meets under a generation
of its own, drawn from a counter in that store (see ``_connect``): nothing of an earlier
rendezvous is ever read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..bootstrap.native import connect
from ..c10d_store import C10dStore
from ..comm import Communicator
from ..errors import UsageError
from ..launchers import Place, Rendezvous
from ..protocol.operation import Settings
from ..rendezvous import PrefixStore
from .staging import stager_for
from .work import Work as _Work
from .work import joined as _joined

__all__ = ["AsyncReduceProcessGroup", "communicator", "register"]

BACKEND = "asyncreduce"
DEVICES = ("cpu", "cuda")  # what it is registered for, and what its groups say they serve
_OPS: dict[int, str] = {
    int(op): name  # type: ignore[call-overload]  # (pybind enums are ints at run time)
    for op, name in (
        (dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg"), (dist.ReduceOp.PRODUCT, "prod"),
        (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.BAND, "band"),
        (dist.ReduceOp.BOR, "bor"), (dist.ReduceOp.BXOR, "bxor"),
    )
}  # fmt: skip


class AsyncReduceProcessGroup(dist.ProcessGroup):  # type: ignore[misc]
    """One torch process group, run by a group of an asyncreduce communicator."""

    def __init__(self, comm: Communicator, rank: int, size: int, timeout: float,
                 owns: Communicator | None = None) -> None:  # fmt: skip
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._comm = comm
        # torch's process-group timeout bounds the rendezvous; operations get no deadline of
        # their own (among torch's backends only Gloo has one): a lost or silent peer is named
        # by the engine's liveness within ASYNCREDUCE_PEER_TIMEOUT, and a deadline per
        # operation would cost every small one a heap entry
        self._timeout: float | None = None
        self._owns = owns  # the communicator this group connected, closed with it
        self._staged_count = 0  # staged operations posted so far (see _staged_name)
        # what communicator(pg) hands out (set by _create); None once torch shut it down
        self._users: Communicator | None = None
        self._ended = ""  # how it ended (destroyed, aborted), for communicator()

    # ---- what torch asks of a process group ------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return getattr(self, "_group_desc", "")

    def _get_backend(self, device: torch.device) -> Any:
        return self  # FSDP2 and DeviceMesh ask; this group serves every device it runs on

    @property
    def _device_types(self) -> list[torch.device]:
        # torch reads the devices of a group from the backends registered with it in C++;
        # this group is its own backend and registers none, so it says which here (as Gloo's
        # says cuda and cpu). torch.distributed.checkpoint.async_save needs "cpu" among them;
        # object collectives and state-dict broadcasts pick their device from them.
        return [torch.device(d) for d in DEVICES]

    @property
    def supports_splitting(self) -> bool:
        return False

    @property
    def supports_coalescing(self) -> bool:
        return False

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        op = _reduction(opts)  # (the communicator checks each tensor: CPU, contiguous)
        requests = []
        for t in tensors:
            stager = stager_for(self._comm, t.device)
            requests.append(self._comm.iallreduce(t, op) if stager is None else
                            stager.pooled_allreduce(t, op, name=self._staged_name()))  # fmt: skip
        return _Work(requests, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        root = opts.rootRank if opts is not None else 0
        requests = []
        for t in tensors:
            stager = stager_for(self._comm, t.device)
            if stager is None:
                requests.append(self._comm.ibroadcast(_cpu([t])[0], root, timeout=self._timeout))
            else:
                requests.append(stager.pooled_broadcast(t, root, name=self._staged_name()))
        return _Work(requests, tensors)

    def _staged_name(self) -> str:
        """A name for a staged operation (posted from a staging thread, so not matched by
        order): torch calls a group's collectives in one order on every rank, so counting
        them here names each alike everywhere."""
        self._staged_count += 1
        return f"torch.staged.{self._staged_count}"

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> _Work:  # fmt: skip
        (outs,), (x,) = outputs, _cpu(inputs)
        request = self._comm.iallgather(x, timeout=self._timeout)
        return _Work([request], outputs, lambda: _copy_rows(request.result(), outs))

    def _allgather_base(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> _Work:
        (x,) = _cpu([x])
        request = self._comm.iallgather(x, timeout=self._timeout)
        return _Work([request], [output], lambda: _copy_rows(request.result(), [output]))

    all_gather_single = _allgather_base

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any = None) -> _Work:  # fmt: skip
        # outputs[r][j]: input j of rank r
        works = [self.allgather([[per_rank[j] for per_rank in outputs]], [x])
                 for j, x in enumerate(inputs)]  # fmt: skip
        return _joined(works, outputs)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        works = [self._allgather_base(o, i) for o, i in zip(outputs, inputs, strict=True)]
        return _joined(works, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> _Work:  # fmt: skip
        (out,), (ins,) = outputs, inputs
        stacked = torch.cat([t.reshape(-1) for t in _cpu(ins)])
        return self._reduce_scatter(out, stacked, _reduction(opts), outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, x: torch.Tensor,
                             opts: Any = None) -> _Work:  # fmt: skip
        (x,) = _cpu([x])
        return self._reduce_scatter(output, x.reshape(-1), _reduction(opts), [output])

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        pairs = zip(outputs, inputs, strict=True)
        works = [self._reduce_scatter_base(o, i, opts) for o, i in pairs]
        return _joined(works, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, op: str,
                        outputs: list[torch.Tensor]) -> _Work:  # fmt: skip
        size = self._comm.world_size
        request = self._comm.ireduce_scatter(flat.reshape(size, -1), op, inplace=False,
                                             timeout=self._timeout)  # fmt: skip
        return _Work([request], outputs, lambda: _copy(request.result(), out))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        root, op = opts.rootRank, _reduction(opts)
        requests = [self._comm.ireduce(t, op, root, timeout=self._timeout) for t in _cpu(tensors)]
        return _Work(requests, tensors)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any = None) -> _Work:  # fmt: skip
        (x,), root = _cpu(inputs), opts.rootRank
        comm = self._comm
        if comm.rank != root:
            return _Work([comm._post_exchange("gather", x, {root: x}, {}, root, self._timeout)],
                         outputs)  # fmt: skip
        (outs,) = outputs
        recvs = {r: t for r, t in enumerate(_cpu(outs)) if r != root}
        _copy(x, outs[root])
        return _Work([comm._post_exchange("gather", x, {}, recvs, root, self._timeout)], outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any = None) -> _Work:  # fmt: skip
        (out,), root = _cpu(outputs), opts.rootRank
        comm = self._comm
        if comm.rank != root:
            return _Work([comm._post_exchange("scatter", out, {}, {root: out}, root,
                                              self._timeout)], outputs)  # fmt: skip
        (ins,) = inputs
        sends = {r: t for r, t in enumerate(_cpu(ins)) if r != root}
        _copy(ins[root], out)
        return _Work([comm._post_exchange("scatter", out, sends, {}, root, self._timeout)], outputs)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> _Work:  # fmt: skip
        me = self._comm.rank
        outs, ins = _cpu(outputs), _cpu(inputs)
        _copy(ins[me], outs[me])
        sends = {r: t for r, t in enumerate(ins) if r != me}
        recvs = {r: t for r, t in enumerate(outs) if r != me}
        anchor = ins[me] if ins[me].numel() else ins[0]
        request = self._comm._post_exchange("alltoall", anchor, sends, recvs, 0, self._timeout,
                                            count=0)  # fmt: skip
        return _Work([request], outputs)

    def alltoall_base(self, output: torch.Tensor, x: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> _Work:  # fmt: skip
        size = self._comm.world_size
        outs = _split(output, output_split_sizes, size)
        ins = _split(_cpu([x])[0], input_split_sizes, size)
        work = self.alltoall(outs, ins, opts)
        return _Work(work._requests, [output])

    all_to_all_single = alltoall_base

    def barrier(self, opts: Any = None) -> _Work:
        return _Work([self._comm.ibarrier(timeout=self._timeout)], [])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        requests = [self._comm.isend(t, dst, tag=tag, timeout=self._timeout) for t in _cpu(tensors)]
        return _Work(requests, tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        requests = [self._comm.irecv(t, src, tag=tag, timeout=self._timeout) for t in _cpu(tensors)]
        return _Work(requests, tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> _Work:
        raise UsageError(
            "recv from any source is not supported by the asyncreduce backend (operations are "
            "matched by source, destination and tag): pass src="
        )

    def shutdown(self) -> None:
        self._ended, self._users = "was destroyed (torch shut it down)", None
        self._comm.close()
        if self._owns is not None:
            _forget(self._owns)
            self._owns.close()

    def abort(self) -> None:
        self._ended, self._users = "was aborted", None
        self._comm.abort("torch.distributed aborted the process group")
        if self._owns is not None:
            _forget(self._owns)

    def __repr__(self) -> str:
        return f"<AsyncReduceProcessGroup rank {self._comm.rank} of {self._comm.world_size}>"


def _reduction(opts: Any) -> str:
    if opts is None:
        return "sum"
    op = opts.reduceOp
    found = _OPS.get(int(op.op))
    if found is None:
        raise UsageError(f"the asyncreduce backend cannot reduce with {op}; it takes "
                         "SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR and BXOR")  # fmt: skip
    return found


def _cpu(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    for t in tensors:
        if t.device.type != "cpu":
            raise UsageError(f"the asyncreduce backend runs CPU tensors, and allreduce and "
                             f"broadcast of CUDA ones (staged); got one on {t.device} for "
                             "another operation: move it to the CPU first")  # fmt: skip
        if not t.is_contiguous():
            raise UsageError("the asyncreduce backend needs contiguous tensors")
    return list(tensors)


def _copy(source: Any, target: torch.Tensor) -> None:
    """``target[...] = source`` for a tensor or numpy array ``source`` of the same size."""
    data = source if isinstance(source, torch.Tensor) else torch.from_numpy(np.asarray(source))
    with torch.no_grad():
        target.view(-1).copy_(data.reshape(-1).view(target.dtype) if data.dtype != target.dtype
                              and data.element_size() == target.element_size()
                              else data.reshape(-1))  # fmt: skip


def _copy_rows(gathered: Any, outputs: list[torch.Tensor]) -> None:
    """An allgather's (world, ...) result into the outputs: one per rank, or one flat tensor."""
    rows = gathered.reshape(len(outputs), -1) if len(outputs) > 1 else gathered.reshape(1, -1)
    for row, out in zip(rows, outputs, strict=True):
        _copy(row, out)


def _split(t: torch.Tensor, sizes: list[int], parts: int) -> list[torch.Tensor]:
    """all_to_all_single's tensor in ``parts`` row blocks (even, or of the sizes given)."""
    if not sizes:
        if t.shape[0] % parts:
            raise UsageError(f"all_to_all_single: {t.shape[0]} rows do not split {parts} ways")
        sizes = [t.shape[0] // parts] * parts
    return list(torch.split(t, sizes))


# ---- creating process groups -----------------------------------------------------------------

_WORLD: dict[str, tuple[Communicator, tuple[int, ...]]] = {}  # "comm": (it, its global ranks)
_LOCK = threading.Lock()


def _create(options: Any, backend_options: Any) -> AsyncReduceProcessGroup:
    """torch's call for each new process group of this backend (extended API)."""
    rank, size = options.group_rank, options.group_size
    timeout = options.timeout.total_seconds()
    members = tuple(int(r) for r in options.global_ranks_in_group) or tuple(range(size))
    owns = None
    with _LOCK:
        found = _WORLD.get("comm")
        if found is None or found[0]._closed or not set(members) <= set(found[1]):
            owns = _connect(options.store, rank, size, timeout)
            if found is None or found[0]._closed:
                _WORLD["comm"] = (owns, members)
            base, base_members = owns, members
        else:
            base, base_members = found
    indices = [base_members.index(m) for m in members]
    group = base.group(indices)
    # What communicator(pg) hands out: the whole communicator for a group of all its ranks;
    # for a subgroup, a sibling view of the same ranks with keys of its own (its unnamed
    # operations never mix with torch's on the group). Made here, as every member makes pg.
    users = base if len(indices) == base.world_size else base.group(indices)
    pg = AsyncReduceProcessGroup(group, rank, size, timeout, owns)
    pg._users = users
    return pg


def _forget(comm: Communicator) -> None:
    with _LOCK:
        if _WORLD.get("comm", (None,))[0] is comm:
            del _WORLD["comm"]


def _connect(store: Any, rank: int, size: int, timeout: float) -> Communicator:
    """A communicator for the first group, through torch's store (scoped to that group).

    The keys of a group made after ``destroy_process_group()`` are those of the group before
    it (torch reuses the name), and a rendezvous never deletes its keys: read as they are,
    they hand this connect the last one's token, addresses and shared-memory paths. So each
    connect meets under ``asyncreduce/<generation>/``, where the generation is drawn from the
    store itself: every member adds 1 to one counter, and the ``size`` adds of one connect
    are ``size * g + 1 .. size * (g + 1)``. No member of connect ``g + 1`` adds before every
    member of connect ``g`` has (its mesh needed all of them), so each rank draws the same
    ``g``, and it does so whether the process is the one that made the last group or one
    started afresh (a count kept in the process would differ there). A connect some member
    never reached leaves the counts out of step for that store: then the ranks meet in
    different generations and fail at the group's timeout, naming the key they waited for.
    """
    place = Place(rank, size, None, None, "torch.distributed", Rendezvous("agent"))
    deadline = time.monotonic() + timeout
    shared = C10dStore(store, timeout, _store_host(store))
    generation = (shared.add("asyncreduce/connects", 1) - 1) // size
    return connect(PrefixStore(f"asyncreduce/{generation}/", shared), place,
                             deadline, Settings.from_env(), serving=False)  # fmt: skip


def _store_host(store: Any) -> str | None:
    """Where torch's store serves (our listeners take the address on the route to it)."""
    while store is not None:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
    import os

    return os.environ.get("MASTER_ADDR")


def communicator(group: Any = None) -> Communicator:
    """The communicator behind an asyncreduce process group (default: the default group):
    ``DataParallel`` on it shares the group's connections. A group that torch has shut down
    (``destroy_process_group``) or aborted, or whose communicator was closed, has none."""
    if group is None:
        if not dist.is_initialized():
            raise UsageError("no default process group: call "
                             'dist.init_process_group("asyncreduce") first')  # fmt: skip
        group = dist.distributed_c10d._get_default_group()
    if not isinstance(group, AsyncReduceProcessGroup):
        raise UsageError(f"{group!r} is not a process group of the asyncreduce backend")
    users = group._users
    if users is None or users._closed or users._parent is not None and users._parent._closed:
        why = group._ended or "has a closed communicator"
        raise UsageError(f"{group!r} {why}; make a new process group (its communicator "
                         "has been closed and is not handed out)")  # fmt: skip
    return users


def register() -> None:
    """Make "asyncreduce" a torch.distributed backend (done by ``import asyncreduce.torch``)."""
    if BACKEND in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=list(DEVICES))
