"""Data-parallel training that goes on through failures, with no central server (issue 37).

The shape of Horovod elastic: the training function takes a state and is run by ``run``,
which runs it again after a failure::

    sampler = ElasticSampler(len(dataset), batch_size=32, seed=0)
    state = Elastic(net, comm, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                    sampler=sampler, mode="backward")

    def train(state: Elastic) -> None:
        while state.epoch < epochs:  # (from where the state stands: run again after a failure)
            for x, y in DataLoader(dataset, batch_size=32, sampler=state.sampler):
                loss_fn(state.model(x), y).backward()
                state.optimizer.step()
                state.optimizer.zero_grad()
                state.commit()
            state.next_epoch()

    state.run(train)

Theory of operation. When a failure breaks the communicator (BrokenError out of a forward, a
backward or a step), ``run``:
1. closes the wrapper and goes on with the survivors (``asyncreduce.shrink``: they agree on
   who remains; a rank they excluded gets BrokenError here);
2. makes the state one again: the survivors take the new rank 0's parameters, buffers,
   optimizer state, epoch, step and position in the epoch (a broadcast, in a form of named
   arrays, never pickled). So a step is either committed everywhere or nowhere: one that the
   new rank 0 finished (every contribution had reached it, the lost rank's too) stands, and
   the others take it over; one it did not finish is redone by the survivors from the state
   before it. Every survivor's parameters are then bitwise those of the new rank 0;
3. re-shards the rest of the epoch over the survivors (``ElasticSampler``: each step takes
   the next ``world_size * batch_size`` indices of the epoch's permutation, this rank its
   block), so no sample is dropped or doubled within the epoch;
4. runs ``train`` again.

Rejoin. Where the job has doors (``ASYNCREDUCE_DOORS``: bootstrap/doors.py), ``commit`` also
lets in the processes that restarted lost ranks and knocked (``asyncreduce.survivors.let_in``):
on a new communicator, the members first and the joiners after them, the joiners get the state
(parameters and buffers from rank 0, the optimizer's tensors spread over the members), and
``commit`` raises inside ``train`` so that ``run`` runs it again over the new shards. A
rejoined rank (its ``comm.admission`` set by ``ar.init()``) takes that state in ``run`` before
it trains.

A failure during these steps starts them again from this rank's state at the failure. Only a
lost rank is recovered from: a TimeoutError (a ``timeout=`` that ran out everywhere) or a
MismatchError (ranks that disagree: a bug in the loop) ends the run like any other error.

``history`` lists every committed step as ``(epoch, position, world_size)``: with the seed,
the permutation and the batch size it names every sample each member used, so one process can
replay the run (tests/test_elastic.py does, to 1e-5).

Modes: ``blocking`` and ``backward``, where a step's update is applied at once in ``step()``.
``forward`` and ``double_buffer`` apply updates later, layer by layer or one step stale, so a
state taken at a failure would mix steps: they raise UsageError.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from ..bootstrap.doors import BEFORE_KNOCK, Door, doors_from_env
from ..comm import Communicator
from ..errors import BrokenError, UsageError
from ..survivors import let_in, shrink
from .data_parallel import DataParallel, OptimizerFactory
from .replicas import broadcast_tensors

__all__ = ["Elastic", "ElasticSampler"]

T = TypeVar("T")
_MODES = ("blocking", "backward")


class ElasticSampler(torch.utils.data.Sampler[int]):
    """This rank's samples of an epoch, re-sharded when the membership changes: every step
    takes the next ``world_size * batch_size`` indices of the epoch's permutation (shuffled
    with ``seed + epoch``), block ``rank`` of them for this rank. A tail shorter than a whole
    step is left out, as DistributedSampler's ``drop_last``."""

    def __init__(self, dataset_size: int, batch_size: int, seed: int = 0,
                 shuffle: bool = True) -> None:  # fmt: skip
        if dataset_size < 1 or batch_size < 1:
            raise UsageError(f"need a dataset and a batch, got {dataset_size} and {batch_size}")
        self.dataset_size, self.batch_size = dataset_size, batch_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.position = 0, 0  # the position: indices of the epoch done with
        self.rank, self.world_size = 0, 1

    def shard(self, rank: int, world_size: int) -> None:
        """From now on this sampler serves ``rank`` of ``world_size``."""
        self.rank, self.world_size = rank, world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of epoch ``epoch``'s indices."""
        if not self.shuffle:
            return np.arange(self.dataset_size)
        return np.random.default_rng(self.seed + epoch).permutation(self.dataset_size)

    def block(self, epoch: int, position: int, world_size: int, rank: int) -> np.ndarray:
        """The indices ``rank`` of ``world_size`` uses in the step that starts at ``position``."""
        start = position + rank * self.batch_size
        return self.permutation(epoch)[start : start + self.batch_size]

    def steps_left(self) -> int:
        return (self.dataset_size - self.position) // (self.world_size * self.batch_size)

    def __iter__(self) -> Iterator[int]:
        epoch, position, world, rank = self.epoch, self.position, self.world_size, self.rank
        for step in range(self.steps_left()):
            yield from self.block(epoch, position + step * world * self.batch_size, world,
                                  rank).tolist()  # fmt: skip

    def __len__(self) -> int:
        return self.steps_left() * self.batch_size

    def step_done(self) -> None:
        self.position += self.world_size * self.batch_size


class Elastic:
    """A training run's state that survives failures (see the module docstring): ``model``
    (the DataParallel), ``optimizer``, ``sampler``, ``epoch``, ``step``, ``history`` and
    ``changes`` (each change of membership seen here: "shrunk", "grown" or, on a rank that
    rejoined, "joined"; with its time and the new world size)."""

    def __init__(
        self, module: nn.Module, comm: Communicator, optimizer: OptimizerFactory,
        sampler: ElasticSampler, mode: str = "backward", **options: Any,
    ) -> None:  # fmt: skip
        if mode not in _MODES:
            raise UsageError(
                f"elastic training needs mode='blocking' or 'backward', not {mode!r}: that mode "
                "applies updates after the step (layer by layer, or one step stale), so a state "
                "taken at a failure would mix two steps"
            )  # fmt: skip
        self.comm, self.module, self.sampler = comm, module, sampler
        self._factory, self._mode, self._options = optimizer, mode, options
        self.epoch = self.step = 0
        self.history: list[tuple[int, int, int]] = []  # (epoch, position, world size) per step
        self.recoveries = self.rejoins = 0
        self.changes: list[tuple[str, float, int]] = []  # (what, time.time(), world size)
        self._doors = doors_from_env()
        joined = comm.admission
        self._engine_slots = joined.slots if joined else tuple(range(comm.world_size))
        self._slots = self._engine_slots  # the slot (place in the doors) of each rank of comm
        self._door = self._open_door()
        self._fresh = joined is not None  # holds no state yet: takes it in run()
        self._handing: dict[str, Any] | None = None  # the optimizer state while it is handed on
        self.model: DataParallel | None = None if self._fresh else self._wrap()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        assert self.model is not None, "a rejoined rank's model is made in run()"
        return self.model.optimizer

    def close(self) -> None:
        """Close the wrapper and this rank's door (not the communicator)."""
        if self.model is not None:
            self.model.close()
        if self._door is not None:
            self._door.close()
            self._door = None

    def next_epoch(self) -> None:
        """The epoch is done: the next one starts, from its first sample."""
        self.epoch += 1
        self.sampler.set_epoch(self.epoch)

    def commit(self) -> None:
        """This step is done on this rank (after ``optimizer.step()``)."""
        sampler = self.sampler
        self.history.append((sampler.epoch, sampler.position, sampler.world_size))
        sampler.step_done()
        self.step += 1
        if self._door is not None:
            self._let_in()

    def run(self, train: Callable[[Elastic], T]) -> T:
        """``train(self)``, run again with the survivors after every failure."""
        while True:
            try:
                if self._fresh:
                    self._catch_up()
                return train(self)
            except _Grown:
                continue  # (train starts again, over the new shards)
            except BrokenError:
                self._recover()

    # ---- rejoin --------------------------------------------------------------------------------

    def _open_door(self) -> Door | None:
        if self._doors is None:
            return None
        if len(self._doors) != len(self._engine_slots) and self.comm.admission is None:
            raise UsageError(
                f"ASYNCREDUCE_DOORS names {len(self._doors)} doors for {self.comm.world_size} "
                "ranks: give one host:port per rank"
            )  # fmt: skip
        return Door(self._doors[self._slots[self.comm.rank]])

    def _let_in(self) -> None:
        """Let in whoever knocked (survivors.let_in), then give them the state, spread over
        the members (they all hold the same)."""
        assert self._door is not None and self._doors is not None and self.model is not None
        grown = let_in(self.comm, self._door, self._doors, self._slots, self.step)
        if grown is None:
            return
        held = self._handing = copy.deepcopy(self.optimizer.state_dict())
        self.model.close()
        old, members = self.comm, self.comm.world_size
        self.comm, self._slots = grown
        self._engine_slots = self._slots
        old.close()
        self.rejoins += 1
        self.changes.append(("grown", time.time(), self.comm.world_size))
        self.model = self._wrap()
        self._take_rank_0s(held, holders=members)
        self._handing = None
        raise _Grown  # (the loop's iterator over the old shard is stale: train starts again)

    def _catch_up(self) -> None:
        """(a rejoined rank) Take the members' state: what they do after let_in."""
        self.model = self._wrap()
        self._take_rank_0s({}, holders=1)
        self._fresh = False
        self.changes.append(("joined", time.time(), self.comm.world_size))

    # ---- recovery ------------------------------------------------------------------------------

    def _wrap(self) -> DataParallel:
        self.sampler.shard(self.comm.rank, self.comm.world_size)
        return DataParallel(self.module, self.comm, self._factory, self._mode, **self._options)

    def _recover(self) -> None:
        """Go on with the survivors, with the new rank 0's state (see the module docstring);
        a failure meanwhile starts it again, and shrink's own errors (excluded, cut off) end
        the run."""
        if self.model is not None:
            self.model.close()
        saved = _Saved(self)  # (a recovery cut short starts again from this, not a mix)
        while True:
            saved.restore(self)
            self.comm = shrink(self.comm)
            self._slots = tuple(self._engine_slots[m] for m in self.comm._backend.members)
            self.recoveries += 1
            self.changes.append(("shrunk", time.time(), self.comm.world_size))
            try:
                self.model = self._wrap()  # (rank 0's parameters and buffers, broadcast)
                self._take_rank_0s(saved.optimizer)
                self._fresh = False
                return
            except BrokenError:
                if self.model is not None:
                    self.model.close()
                continue

    def _take_rank_0s(self, held: dict[str, Any], holders: int = 1) -> None:
        """The new rank 0's optimizer state and counters, on every rank: ranks below
        ``holders`` hold the same state, and each sends its share of the tensors."""
        comm = self.comm
        tensors = [t.cpu() for t in _tensors_of(held)] if comm.rank < holders else []  # (a
        # device's state, on the host: every rank then posts the same broadcasts; loading
        # moves it back)
        shape = {
            "optimizer": _without_tensors(held),
            "tensors": [[list(t.shape), str(t.dtype)] for t in tensors],
            "epoch": self.epoch, "step": self.step, "position": self.sampler.position,
            "sampler_epoch": self.sampler.epoch, "history": self.history,
            "fresh": self._fresh, "holders": holders,
        }  # fmt: skip
        shape = _broadcast_json(comm, shape)
        if shape["fresh"]:
            raise BrokenError(
                f"rank {comm.rank}: no rank that held the training state survived (the new "
                "rank 0 had just rejoined): start the job again from a checkpoint"
            )  # fmt: skip
        if comm.rank >= shape["holders"]:
            tensors = [torch.empty(s, dtype=getattr(torch, d.removeprefix("torch.")))
                       for s, d in shape["tensors"]]  # fmt: skip
        for root in range(shape["holders"]):  # (each holder sends every holders-th tensor)
            broadcast_tensors(comm, tensors[root :: shape["holders"]],
                              f"asyncreduce.elastic.state.{root}", root)  # fmt: skip
        self.optimizer.load_state_dict(_with_tensors(shape["optimizer"], iter(tensors)))
        self.epoch, self.step = shape["epoch"], shape["step"]
        self.history = [tuple(h) for h in shape["history"]]  # type: ignore[misc]
        self.sampler.epoch, self.sampler.position = shape["sampler_epoch"], shape["position"]
        self.sampler.shard(comm.rank, comm.world_size)


def _first_optimizer() -> None:
    """torch's first optimizer in a process takes a second (it imports torch._dynamo): a
    restarted rank makes one before it knocks, not while the members wait for its state."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


BEFORE_KNOCK.append(_first_optimizer)


class _Grown(Exception):
    """Raised by ``commit`` when ranks joined: ``run`` runs ``train`` again (Horovod's
    HostsUpdatedInterrupt)."""


class _Saved:
    """This rank's state when a failure came: what every attempt to recover starts from."""

    def __init__(self, state: Elastic) -> None:
        tensors = [*state.module.parameters(), *state.module.buffers()]
        self.tensors = [t.detach().clone() for t in tensors]
        held = state.optimizer.state_dict() if state.model is not None else {}
        self.optimizer = copy.deepcopy(held if state._handing is None else state._handing)
        state._handing = None  # (a failure while it was handed on: the new optimizer is empty)
        self.counters = (state.epoch, state.step, list(state.history), state.sampler.epoch,
                         state.sampler.position)  # fmt: skip

    def restore(self, state: Elastic) -> None:
        with torch.no_grad():
            tensors = [*state.module.parameters(), *state.module.buffers()]
            for t, saved in zip(tensors, self.tensors, strict=True):
                t.copy_(saved)
        for p in state.module.parameters():
            p.grad = None
        state.epoch, state.step, history, state.sampler.epoch, state.sampler.position = (
            self.counters
        )  # fmt: skip
        state.history = list(history)


def _broadcast_json(comm: Communicator, value: Any) -> Any:
    """Rank 0's ``value`` (JSON) on every rank: its length, then its bytes."""
    data = json.dumps(value).encode() if comm.rank == 0 else b""
    size = comm.broadcast(np.array([len(data)], np.int64), root=0, name="asyncreduce.elastic.n")
    buf = np.frombuffer(data, np.uint8).copy() if comm.rank == 0 else np.empty(size[0], np.uint8)
    comm.broadcast(buf, root=0, name="asyncreduce.elastic.json")
    return json.loads(buf.tobytes())


def _tensors_of(state: Any) -> list[torch.Tensor]:
    """Every tensor in ``state`` (an optimizer's state dict), in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state.detach().clone()]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors_of(state[k])]
    if isinstance(state, list | tuple):
        return [t for item in state for t in _tensors_of(item)]
    return []


def _without_tensors(state: Any) -> Any:
    """``state`` as JSON: tensors become a mark, in ``_tensors_of``'s order; keys are typed."""
    if isinstance(state, torch.Tensor):
        return {"__tensor__": True}
    if isinstance(state, dict):
        return {"__dict__": [[_key(k), _without_tensors(state[k])] for k in sorted(state, key=str)]}
    if isinstance(state, list | tuple):
        return [_without_tensors(item) for item in state]
    return state


def _with_tensors(shape: Any, tensors: Iterator[torch.Tensor]) -> Any:
    if isinstance(shape, dict) and shape.get("__tensor__"):
        return next(tensors)
    if isinstance(shape, dict):
        return {_unkey(k): _with_tensors(v, tensors) for k, v in shape["__dict__"]}
    if isinstance(shape, list):
        return [_with_tensors(item, tensors) for item in shape]
    return shape


def _key(key: Any) -> list[Any]:
    return ["int", key] if isinstance(key, int) else ["str", str(key)]


def _unkey(key: list[Any]) -> Any:
    return int(key[1]) if key[0] == "int" else key[1]
