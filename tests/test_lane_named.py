"""Named small operations in the same-host lane (lane/named.py, samehost/named.py).

In one process, several ranks' lanes over plain arrays, each rank posting its own permutation
of more named operations than it has slots, in a random interleaving with random looks: every
key ends the same way on every rank (folded in the lane, bitwise equal and right, or run on
the engine everywhere), never one way here and another there; a key a peer runs on the engine
is handed over whether the word comes before or after the post; a slot is reused only once
every peer acknowledged it. On real processes: named small allreduces and barriers take the
lane from many threads in different orders, more than the slots at once; a rank that
describes a key differently, or runs it on the engine, fails every rank with a
MismatchError; a timeout fails every rank; ASYNCREDUCE_LANE_NAMED=0 on one rank keeps named
operations on the engine everywhere.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import numpy as np
import pytest

import asyncreduce as ar
from asyncreduce.algorithms import KINDS, REDUCTION_CODES
from asyncreduce.buffers import as_buffer
from asyncreduce.kernels.reduction import DTYPES, fold
from asyncreduce.lane.core import Lane, LaneOp
from asyncreduce.request import CallbackRunner, Request
from asyncreduce.samehost.mailbox import Mailbox, region_bytes
from asyncreduce.samehost.named import (
    NAMED_SLOTS,
    NamedCore,
    NamedSlots,
    NativeNamedSlots,
    named_bytes,
)
from asyncreduce.transport.frame import Descriptor
from spmd import run_ranks

RUNNER = CallbackRunner("test-lane-named")
NATIVE = pytest.mark.skipif(NamedCore is None, reason="asyncreduce.samehost._named_core not built")


@pytest.fixture(params=[NamedSlots, pytest.param(NativeNamedSlots, marks=NATIVE)],
                ids=["python", "native"])  # fmt: skip
def kind(request: pytest.FixtureRequest) -> type[NamedSlots]:
    """Each one-process test runs over both named slots: numpy's and the C one."""
    return request.param  # type: ignore[no-any-return]


# ---- one process: lanes over plain arrays -------------------------------------------------


class World:
    """``n`` ranks' lanes with named slots over plain arrays; what a rank hands to the engine
    is recorded, and (as its engine would, with a PostNotice) claimed from every peer, later
    (``deliver``: the engine thread hears of it after the call that handed it over)."""

    def __init__(self, n: int, kind: type[NamedSlots]) -> None:
        size = region_bytes() + named_bytes()
        regions = [np.zeros(size, np.uint8) for _ in range(n)]
        self.n = n
        self.on_engine: list[dict[bytes, LaneOp | None]] = [{} for _ in range(n)]
        self.lanes = []
        self.words: list[tuple[int, tuple[bytes, int]]] = []  # (to, key): claims on the way
        for r in range(n):
            peers = {p: regions[p] for p in range(n) if p != r}
            self.lanes.append(Lane(Mailbox(r, regions[r], peers), r, n,
                                   lambda op, r=r: self.engine(r, op),
                                   named=kind(r, regions[r], peers)))  # fmt: skip

    def engine(self, rank: int, op: LaneOp | None, key: tuple[bytes, int] | None = None) -> None:
        key = op.key if op is not None else key
        assert key is not None
        self.on_engine[rank][key[0]] = op
        self.words += [(peer, key) for peer in range(self.n) if peer != rank]

    def deliver(self, rng: random.Random) -> None:
        """One claim on the way reaches its rank's lane."""
        peer, key = self.words.pop(rng.randrange(len(self.words)))
        self.lanes[peer].claim(key, remember=True)

    def post(self, rank: int, op: LaneOp) -> None:
        if not self.lanes[rank].post(op, op.request):
            self.engine(rank, None, op.key)


def named_op(name: str, x: np.ndarray[Any, Any], op: str = "sum") -> LaneOp:
    buf = as_buffer(x, "x")
    desc = Descriptor(KINDS["allreduce"], buf.dtype.code, REDUCTION_CODES[op], 0, x.size)
    made = LaneOp((name.encode(), 0), f"allreduce {name!r}", desc, buf, op,
                  lambda: buf.original, None)  # fmt: skip
    made.request = Request(made.label, RUNNER)
    return made


def expected(parts: list[np.ndarray[Any, Any]], op: str) -> np.ndarray[Any, Any]:
    out = np.empty_like(parts[0])
    fold(DTYPES[str(parts[0].dtype)], op, [p.view(np.uint8) for p in parts], out)
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("seed", range(6))
def test_named_operations_in_any_order_end_alike_on_every_rank(
    n: int, seed: int, kind: type[NamedSlots]
) -> None:
    rng = random.Random(seed)
    world = World(n, kind)
    keys = [f"k{i}" for i in range(NAMED_SLOTS + 24)]
    orders = [rng.sample(keys, len(keys)) for _ in range(n)]
    dtype = rng.choice(["float32", "float64", "int64", "int16", "float16"])  # (C: all but f16)
    op = rng.choice(["sum", "max", "prod"])
    inputs = {k: [np.array(np.arange(1, 9) * (r + 1) + i, dtype)
                  for r in range(n)] for i, k in enumerate(keys)}  # fmt: skip
    posted: list[dict[str, LaneOp]] = [{} for _ in range(n)]
    cursor = [0] * n
    while any(c < len(keys) for c in cursor) or world.words:
        rank = rng.randrange(n)
        if world.words and rng.random() < 0.2:
            world.deliver(rng)
        elif rng.random() < 0.6 and cursor[rank] < len(keys):
            key = orders[rank][cursor[rank]]
            cursor[rank] += 1
            made = named_op(key, inputs[key][rank].copy(), op)
            posted[rank][key] = made
            world.post(rank, made)
        else:
            world.lanes[rank].poke()
    for _ in range(3):
        for lane in world.lanes:
            lane.poke()
    for key in keys:
        ways = []
        for rank in range(n):
            made = posted[rank][key]
            engine = key.encode() in world.on_engine[rank]
            done = made.request.done()
            assert engine != done, (key, rank, engine, done)  # one way, never both or neither
            ways.append(engine)
            if done:
                got = made.request.result()
                assert got.tobytes() == expected(inputs[key], op).tobytes(), (key, rank)
        assert len(set(ways)) == 1, (key, ways)  # every rank ended it the same way
    assert all(lane.named and not lane.named.pending for lane in world.lanes)


def test_a_slot_is_reused_only_once_every_peer_acknowledged_it(kind: type[NamedSlots]) -> None:
    world = World(2, kind)
    ops = [named_op(f"a{i}", np.ones(4)) for i in range(NAMED_SLOTS)]
    for made in ops:
        world.post(0, made)
    assert not world.on_engine[0]  # every slot taken, none free
    late = named_op("late", np.ones(4))
    world.post(0, late)
    assert b"late" in world.on_engine[0]  # no slot: the engine, at once
    theirs = [named_op(f"a{i}", np.ones(4)) for i in range(NAMED_SLOTS)]
    world.post(1, theirs[0])  # rank 1 completes a0 (rank 0's slot is there) and acknowledges
    assert theirs[0].request.done()
    world.lanes[0].poke()
    assert ops[0].request.done()
    again = named_op("again", np.ones(4))
    world.post(0, again)  # a0's slot is free again: acknowledged by rank 1
    assert b"again" not in world.on_engine[0]


def test_a_word_from_the_engine_before_the_post_is_remembered(kind: type[NamedSlots]) -> None:
    world = World(2, kind)
    world.engine(0, None, (b"k", 0))  # rank 0's engine runs k: rank 1 hears of it first
    world.deliver(random.Random(0))
    made = named_op("k", np.ones(4))
    world.post(1, made)
    assert b"k" in world.on_engine[1] and not made.request.done()


def test_a_peer_that_describes_a_key_otherwise_makes_every_rank_hand_it_over(
    kind: type[NamedSlots],
) -> None:
    world = World(3, kind)
    for rank in range(3):
        count = 5 if rank == 2 else 4
        world.post(rank, named_op("k", np.ones(count)))
    for lane in world.lanes:
        lane.poke()
    while world.words:
        world.deliver(random.Random(0))
    assert all(b"k" in world.on_engine[r] for r in range(3)), world.on_engine


# ---- real processes --------------------------------------------------------------------------


def _named(comm: ar.Communicator) -> Any:
    lane = comm._backend.lane  # type: ignore[attr-defined]
    assert lane is not None and lane.named is not None, "no named lane"
    return lane.named


def body_threads(comm: ar.Communicator) -> dict[str, int]:
    """Four threads per rank, each its own names in an order of its own per rank, blocking
    and not, with barriers; then more posts at once than the slots, in reverse on odd ranks."""
    r, n = comm.rank, comm.world_size
    failures: list[BaseException] = []

    def work(t: int) -> None:
        try:
            rng = random.Random(t)  # (the same sizes on every rank)
            for i in range(150):
                x = np.full(rng.choice([1, 16, 2048]), float(r + i), np.float64)
                got = comm.allreduce(x, name=f"t{t}")
                assert got[0] == n * i + sum(range(n)), (t, i, got[0])
                if i % 50 == 0:
                    comm.barrier(name=f"b{t}")
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    names = [f"many{i}" for i in range(3 * NAMED_SLOTS)]
    if r % 2:
        names.reverse()
    posted = {k: comm.iallreduce(np.full(16, float(r + i), np.float32), name=k)
              for i, k in enumerate(sorted(names))}  # fmt: skip
    requests = [posted[k] for k in names]
    for i, k in enumerate(sorted(names)):
        assert posted[k].wait()[0] == n * i + sum(range(n)), k
    assert all(q.done() for q in requests)
    named = _named(comm)
    return {"completed": named.completed, "converted": named.converted}


@pytest.mark.parametrize("n", [2, 3])
def test_named_small_operations_take_the_lane_from_many_threads(n: int) -> None:
    results = run_ranks(n, body_threads, timeout=120)
    for rank, got in results.items():
        assert got["completed"] >= 4 * 150, (rank, got)


def body_differs(comm: ar.Communicator, what: str) -> str:
    """Rank 1's named allreduce differs from rank 0's: "count" (both in the lane), "large"
    (rank 1's runs on the engine: too large for the lane)."""
    comm.allreduce(np.ones(4, np.float32), name="warm")
    count = 4
    if comm.rank == 1:
        count = 5 if what == "count" else 1 << 16
    with pytest.raises(ar.MismatchError) as caught:
        comm.allreduce(np.ones(count, np.float32), name="k", timeout=30)
    return str(caught.value)


@pytest.mark.parametrize("what", ["count", "large"])
def test_a_rank_that_differs_on_a_named_key_fails_every_rank_with_a_mismatch(what: str) -> None:
    results = run_ranks(2, body_differs, what, timeout=90)
    for rank, message in results.items():
        assert "'k'" in message, (rank, message)


def body_timeout(comm: ar.Communicator) -> str:
    if comm.rank == 0:
        with pytest.raises(TimeoutError) as caught:
            comm.allreduce(np.ones(4, np.float32), name="lonely", timeout=0.3)
        return str(caught.value)
    with pytest.raises((ar.BrokenError, TimeoutError)) as failed:
        comm.barrier(name="never", timeout=10)
    return str(failed.value)


def test_a_timeout_of_a_named_lane_operation_fails_every_rank() -> None:
    results = run_ranks(2, body_timeout, timeout=60)
    assert "still waiting for rank 1" in results[0], results[0]
    assert "timeout" in results[1], results[1]


def body_off(comm: ar.Communicator) -> bool:
    lane = comm._backend.lane  # type: ignore[attr-defined]
    got = comm.allreduce(np.ones(4, np.float32), name="k")
    assert got[0] == comm.world_size
    return lane is not None and lane.named is not None


def test_one_rank_without_named_lane_keeps_named_operations_on_the_engine_everywhere() -> None:
    results = run_ranks(2, body_off, rank_env={1: {"ASYNCREDUCE_LANE_NAMED": "0"}})
    assert results == {0: False, 1: False}


def body_claimed_first(comm: ar.Communicator) -> list[float]:
    """Rank 0 has no free named slot (32 posts nobody else makes), so its blocking named
    allreduce "k" runs on the engine and says so; rank 1 hears that before it makes its own
    blocking call (it sleeps), which must then go to the engine at once, not into the lane."""
    if comm.rank == 0:
        hogs = [comm.iallreduce(np.ones(4), name=f"hog{i}") for i in range(NAMED_SLOTS)]
        got = comm.allreduce(np.ones(4), name="k", timeout=20)
    else:
        time.sleep(1.0)  # (rank 0's notice is heard meanwhile)
        got = comm.allreduce(np.ones(4), name="k")  # (no timeout: the call's fastest path)
        hogs = [comm.iallreduce(np.ones(4), name=f"hog{i}") for i in range(NAMED_SLOTS)]
    for q in hogs:
        q.wait(timeout=20)
    return got.tolist()  # type: ignore[no-any-return]


def test_a_blocking_named_call_heard_of_as_run_on_the_engine_goes_there() -> None:
    results = run_ranks(2, body_claimed_first, timeout=90)
    assert results == {0: [2.0] * 4, 1: [2.0] * 4}, results
