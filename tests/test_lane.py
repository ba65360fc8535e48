"""The same-host lane (lane.py, mailbox.py): unnamed small allreduces through shared memory.

In one process, several ranks' lanes over plain arrays, driven in random orders (who posts
next, who looks next): every operation ends with the fold of every rank's contribution in
rank order, bitwise equal everywhere, however far one rank runs ahead of the slots; a peer
that runs an operation elsewhere, or describes it differently, makes every rank hand it to
the engine; a slot is reused only once every peer is through it. On real processes: the
lane is what unnamed small allreduces take (and only they), with every dtype and reduction;
it interleaves with the engine's operations and with named ones in another order; and every
failure reaches every rank as it does on the engine: a size or dtype that differs
(MismatchError), a timeout, a peer killed, a peer stopped (silent past the peer timeout), a
close with an operation pending. Where one rank
does not want the lane (ASYNCREDUCE_LANE=0, or no spinning), nobody uses it.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import random
import select
import signal
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
from asyncreduce.samehost.mailbox import (
    HERE,
    SLOTS,
    Core,
    Mailbox,
    NativeMailbox,
    header,
    region_bytes,
)
from asyncreduce.transport.frame import Descriptor
from spmd import run_ranks

RUNNER = CallbackRunner("test-lane")
BULK_FLOATS = 4 << 20  # 16 MiB: the engine's bulk path beside the lane


# ---- one process: lanes over plain arrays -------------------------------------------------


NATIVE = pytest.mark.skipif(Core is None, reason="asyncreduce.samehost._mailbox_core not built")


@pytest.fixture(params=[Mailbox, pytest.param(NativeMailbox, marks=NATIVE)],
                ids=["python", "native"])  # fmt: skip
def kind(request: pytest.FixtureRequest) -> type[Mailbox]:
    """Each one-process test runs over both mailboxes: numpy's and the C one."""
    return request.param  # type: ignore[no-any-return]


class World:
    """``n`` ranks' lanes over plain arrays in this process, with mailboxes of ``kind``;
    ``converted[r]``: what rank r handed to the engine."""

    def __init__(self, n: int, kind: type[Mailbox]) -> None:
        regions = [np.zeros(region_bytes(), np.uint8) for _ in range(n)]
        self.converted: list[list[LaneOp]] = [[] for _ in range(n)]
        self.lanes = [
            Lane(kind(r, regions[r], {p: regions[p] for p in range(n) if p != r}), r, n,
                 self.converted[r].append)
            for r in range(n)
        ]  # fmt: skip


def lane_op(
    seq: int, x: np.ndarray[Any, Any], op: str = "sum", timeout: float | None = None
) -> LaneOp:
    buf = as_buffer(x, "x")
    desc = Descriptor(KINDS["allreduce"], buf.dtype.code, REDUCTION_CODES[op], 0, x.size)
    made = LaneOp((b"", seq), f"allreduce #{seq}", desc, buf, op, lambda: buf.original, timeout)
    made.request = Request(made.label, RUNNER)  # (what Lane.post will be given)
    return made


def post(lane: Lane, op: LaneOp) -> None:
    lane.post(op, op.request)


class Adopted:
    """``Lane.run_waiting``'s ``adopt``: hands over ``op`` (request and all), and counts calls."""

    def __init__(self, op: LaneOp) -> None:
        self.op, self.calls = op, 0

    def __call__(self) -> LaneOp:
        self.calls += 1
        return self.op


def run_here(lane: Lane, op: LaneOp) -> tuple[Request[Any] | None, Adopted]:
    """``Lane.run_waiting`` as the backend calls it for a blocking allreduce."""
    adopt = Adopted(op)
    buf = op.buf
    return lane.run_waiting(op.key, op.desc, op.header, buf.flat, buf.dtype, op.op, op.timeout,
                            adopt), adopt  # fmt: skip


def expected(parts: list[np.ndarray[Any, Any]], op: str) -> np.ndarray[Any, Any]:
    out = np.empty_like(parts[0])
    fold(DTYPES[str(parts[0].dtype)], op, [p.view(np.uint8) for p in parts], out)
    if op == "avg":
        out /= len(parts)
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("seed", range(4))
def test_lanes_driven_in_any_order_end_with_every_rank_bitwise_equal(
    n: int, seed: int, kind: type[Mailbox]
) -> None:
    """Each rank posts 3 x SLOTS operations in sequence order (some run elsewhere: a note),
    at random moments against the others, and random ranks move their lanes between posts;
    every lane operation ends with the rank-order fold, the same bits on every rank."""
    rng = random.Random(seed)
    world = World(n, kind)
    count = 3 * SLOTS
    kinds = [rng.choice(["sum", "avg", "max", "prod", "note"]) for _ in range(count)]
    sizes = [rng.choice([1, 7, 256, 16384]) for _ in range(count)]
    data = [[np.random.default_rng([seed, s, r]).standard_normal(sizes[s]).astype(np.float32)
             for r in range(n)] for s in range(count)]  # fmt: skip
    ops: dict[tuple[int, int], LaneOp] = {}
    posted = [0] * n
    while min(posted) < count:
        rank = rng.choice([r for r in range(n) if posted[r] < count])
        seq = posted[rank]
        if kinds[seq] == "note":
            world.lanes[rank].note(seq, Descriptor(KINDS["broadcast"], 2, 0, 0, 5))
        else:
            ops[rank, seq] = lane_op(seq, data[seq][rank].copy(), kinds[seq])
            post(world.lanes[rank], ops[rank, seq])
        posted[rank] += 1
        world.lanes[rng.randrange(n)].progress()
    for lane in world.lanes:
        lane.progress()
    for (rank, seq), op in ops.items():
        want = expected(data[seq], kinds[seq])
        got = op.request.result(timeout=0)
        assert got.tobytes() == want.tobytes(), (rank, seq, kinds[seq])
    assert not any(world.converted)
    assert all(not lane.busy for lane in world.lanes)


def test_a_slot_is_reused_only_once_every_peer_is_through_it(kind: type[Mailbox]) -> None:
    """Rank 0 runs 2 x SLOTS operations ahead of rank 1: only the first SLOTS go out (the
    rest wait, in order); as rank 1 catches up, everything completes, nothing overwritten."""
    world = World(2, kind)
    ahead = [lane_op(s, np.full(4, s, np.float64)) for s in range(2 * SLOTS)]
    for op in ahead:
        post(world.lanes[0], op)
    assert world.lanes[0].unnamed._next == SLOTS  # published: the first SLOTS; the rest wait
    behind = [lane_op(s, np.full(4, 1000.0 * s, np.float64)) for s in range(2 * SLOTS)]
    for op in behind:
        post(world.lanes[1], op)
        world.lanes[0].progress()
    world.lanes[1].progress()
    for s in range(2 * SLOTS):
        for op in (ahead[s], behind[s]):
            assert op.request.result(timeout=0).tolist() == [1001.0 * s] * 4


def test_a_peer_that_runs_it_elsewhere_makes_every_rank_hand_it_to_the_engine(
    kind: type[Mailbox],
) -> None:
    """Rank 2 runs operation 0 on the engine (a note); ranks 0 and 1 hand theirs to the
    engine too, and the lane goes on with operation 1 as if nothing happened."""
    world = World(3, kind)
    first = [lane_op(0, np.ones(4, np.float32)) for _ in range(2)]
    post(world.lanes[0], first[0])
    post(world.lanes[1], first[1])
    world.lanes[2].note(0, first[0].desc)
    for lane in world.lanes:
        lane.progress()
    assert [len(c) for c in world.converted] == [1, 1, 0]
    assert world.converted[0][0] is first[0] and not first[0].request.done()
    second = [lane_op(1, np.full(4, r, np.float32)) for r in range(3)]
    for r, op in enumerate(second):
        post(world.lanes[r], op)
    for lane in world.lanes:
        lane.progress()
    for op in second:
        assert op.request.result(timeout=0).tolist() == [3.0] * 4


@pytest.mark.parametrize("theirs", ["count", "dtype", "reduction"])
def test_a_peer_that_disagrees_makes_every_rank_hand_it_to_the_engine(
    theirs: str, kind: type[Mailbox]
) -> None:
    """Another count, dtype or reduction on rank 1: both ranks hand the operation to the
    engine (whose matching fails it on every rank, naming both sides); no data is read."""
    world = World(2, kind)
    other = {"count": (np.ones(8, np.float32), "sum"), "dtype": (np.ones(4, np.int32), "sum"),
             "reduction": (np.ones(4, np.float32), "max")}[theirs]  # fmt: skip
    mine, peers = lane_op(0, np.ones(4, np.float32)), lane_op(0, other[0], other[1])
    post(world.lanes[0], mine)
    post(world.lanes[1], peers)
    world.lanes[0].progress()
    assert world.converted == [[mine], [peers]]
    assert mine.buf.flat.tolist() == [1.0] * 4  # untouched


def test_a_header_a_peer_scribbled_on_is_read_as_a_disagreement(kind: type[Mailbox]) -> None:
    """A peer's header with a wild count (as a bug or a hostile process would leave it) is
    never used to read data: the operation goes to the engine, which checks for itself."""
    regions = [np.zeros(region_bytes(), np.uint8) for _ in range(2)]
    converted: list[LaneOp] = []
    lane = Lane(kind(0, regions[0], {1: regions[1]}), 0, 2, converted.append)
    op = lane_op(0, np.ones(4, np.float32))
    wild = Descriptor(KINDS["allreduce"], op.desc.dtype, op.desc.reduce, 0, 1 << 40)
    kind(1, regions[1], {0: regions[0]}).publish(0, header(HERE, wild), None)  # no data
    post(lane, op)
    assert converted == [op]


# ---- real processes -------------------------------------------------------------------------


def test_run_folds_on_the_calling_thread_with_no_request(
    kind: type[Mailbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blocking allreduce on an idle lane: whether the peer published before or publishes
    while it spins (from another thread), ``run`` folds in rank order on the caller's thread
    and returns None, without adopting it (no request made); the next one can run so too."""
    monkeypatch.setattr(
        "asyncreduce.lane.unnamed.WAITER_SPIN", 30.0
    )  # (a slow machine: no give-up)
    world = World(2, kind)
    peer = [lane_op(s, np.full(4, 10.0 * (s + 1), np.float32)) for s in range(2)]
    post(world.lanes[1], peer[0])  # before
    mine = [lane_op(s, np.full(4, s + 1.0, np.float32)) for s in range(2)]
    done, adopt = run_here(world.lanes[0], mine[0])
    assert done is None and adopt.calls == 0
    assert mine[0].buf.original.tolist() == [11.0] * 4
    later = threading.Timer(0.05, post, (world.lanes[1], peer[1]))  # while rank 0 spins
    later.start()
    done, adopt = run_here(world.lanes[0], mine[1])
    later.join()
    assert done is None and adopt.calls == 0
    assert mine[1].buf.original.tolist() == [22.0] * 4
    world.lanes[1].progress()
    assert [p.request.result(timeout=0).tolist() for p in peer] == [[11.0] * 4, [22.0] * 4]
    assert world.lanes[0].ran == 2 and world.lanes[0].completed == 2
    assert not any(lane.busy for lane in world.lanes)


def test_run_behind_other_operations_posts_it_in_order(kind: type[Mailbox]) -> None:
    """Where the lane has an operation pending, ``run`` publishes nothing itself: it posts
    behind it, and both complete in order once the peer's come."""
    world = World(2, kind)
    first = lane_op(0, np.full(3, 1.0, np.float64))
    post(world.lanes[0], first)
    second = lane_op(1, np.full(3, 2.0, np.float64))
    request, adopt = run_here(world.lanes[0], second)
    assert adopt.calls == 1 and request is second.request and not request.done()
    for s, value in enumerate((5.0, 7.0)):
        post(world.lanes[1], lane_op(s, np.full(3, value, np.float64)))
    world.lanes[0].progress()
    assert first.request.result(timeout=0).tolist() == [6.0] * 3
    assert request.result(timeout=0).tolist() == [9.0] * 3
    assert world.lanes[0].ran == 0


def test_run_hands_an_operation_a_peer_describes_otherwise_to_the_engine(
    kind: type[Mailbox],
) -> None:
    world = World(2, kind)
    post(world.lanes[1], lane_op(0, np.ones(8, np.int32)))
    mine = lane_op(0, np.ones(8, np.float32))
    request, adopt = run_here(world.lanes[0], mine)
    assert adopt.calls == 1 and request is mine.request
    assert world.converted[0] == [mine] and world.lanes[0].ran == 0


def test_run_adopts_what_the_peers_do_not_publish_within_the_spin(kind: type[Mailbox]) -> None:
    """The peer is late: after the spin the operation is an ordinary pending one (the
    progress thread watches it), and completes later."""
    world = World(2, kind)
    mine = lane_op(0, np.full(2, 1.0, np.float32), timeout=0.05)
    posted = time.monotonic()
    request, adopt = run_here(world.lanes[0], mine)
    assert adopt.calls == 1 and request is mine.request and not request.done()
    assert time.monotonic() - posted >= 0.002 - 1e-4  # it spun (at least _WAITER_SPIN)
    assert world.lanes[0].busy and request.mover is world.lanes[0]
    post(world.lanes[1], lane_op(0, np.full(2, 3.0, np.float32)))
    world.lanes[0].progress()
    assert request.result(timeout=0).tolist() == [4.0] * 2


def test_a_waiter_drives_on_as_long_as_the_lane_moves(
    kind: type[Mailbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer's contributions come one by one, each well within the spin but all together
    far past it: the waiter of the last one moves the lane to its end itself (no progress
    thread here), since each completion starts its spin again."""
    monkeypatch.setattr("asyncreduce.lane.core.WAITER_SPIN", 0.2)  # (drive's)
    world = World(2, kind)
    count = 20
    mine = [lane_op(s, np.full(2, float(s), np.float32)) for s in range(count)]
    for op in mine:
        post(world.lanes[0], op)

    def peer() -> None:
        for s in range(count):
            time.sleep(0.02)
            post(world.lanes[1], lane_op(s, np.full(2, 10.0, np.float32)))
            world.lanes[1].progress()

    thread = threading.Thread(target=peer)
    started = time.monotonic()
    thread.start()
    world.lanes[0].drive(mine[-1].request, None)
    thread.join()
    assert time.monotonic() - started >= 0.3  # longer than one spin: it drove on
    assert mine[-1].request.done(), "the waiter gave up while the peer was still coming"
    assert [op.request.result(timeout=0).tolist() for op in mine] == [
        [s + 10.0] * 2 for s in range(count)
    ]


def test_an_operation_made_after_its_post_keeps_the_deadline_of_the_post() -> None:
    """(``Lane.run_waiting`` has its LaneOp made only where it adopts it, after the spin.)"""
    buf = as_buffer(np.ones(2, np.float32), "x")
    desc = Descriptor(KINDS["allreduce"], buf.dtype.code, REDUCTION_CODES["sum"], 0, 2)
    posted = time.monotonic() - 5.0
    late = LaneOp((b"", 0), "allreduce #0", desc, buf, "sum", lambda: None, 1.0, posted)
    assert late.deadline == posted + 1.0
    now = LaneOp((b"", 0), "allreduce #0", desc, buf, "sum", lambda: None, 1.0)
    assert now.deadline >= posted + 5.0 + 1.0
    assert LaneOp((b"", 0), "allreduce #0", desc, buf, "sum", lambda: None, None).deadline == 0


def test_run_under_way_when_the_lane_closes_fails_with_the_close_error(
    kind: type[Mailbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread closes the lane while ``run`` spins: it ends at once, failed with the
    close's own error (the spin is long: only the close can end it in time)."""
    monkeypatch.setattr("asyncreduce.lane.unnamed.WAITER_SPIN", 30.0)  # (a close must end it)
    world = World(2, kind)
    mine = lane_op(0, np.ones(2, np.float32))
    closing = threading.Timer(0.05, world.lanes[0].close, (lambda op: ar.BrokenError(op.label),))
    closing.start()
    start = time.monotonic()
    request, adopt = run_here(world.lanes[0], mine)
    assert time.monotonic() - start < 10
    closing.join()
    assert request is mine.request and adopt.calls == 1
    assert isinstance(request.exception(timeout=0), ar.BrokenError)
    assert str(request.exception(timeout=0)) == mine.label


@pytest.mark.parametrize("call", ["test", "result", "exception"])
def test_a_forked_child_cannot_move_an_inherited_lane_request(
    call: str, kind: type[Mailbox]
) -> None:
    """A child forked while a lane request is pending (a DataLoader worker: fork by
    default): ``test()``, ``result()`` or ``exception()`` on it raises UsageError there and
    writes nothing into the mailbox it shares with the parent (MAP_SHARED). A child that
    completed it would move the parent's ``through``, and peers would reuse slots the
    parent has not read. The parent still completes it."""
    regions = [np.frombuffer(mmap.mmap(-1, region_bytes()), np.uint8) for _ in range(2)]
    lanes = [Lane(kind(r, regions[r], {1 - r: regions[1 - r]}), r, 2, lambda op: None)
             for r in range(2)]  # fmt: skip
    mine = lane_op(0, np.ones(4, np.float32))
    post(lanes[0], mine)
    post(lanes[1], lane_op(0, np.full(4, 2.0, np.float32)))  # one look would complete it
    before = regions[0].tobytes()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what the call did, and leave at once
        try:
            try:
                getattr(mine.request, call)(*(() if call == "test" else (0.5,)))
                outcome = "returned"
            except BaseException as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            os.write(write, outcome.encode()[:4000])
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 20)
        outcome = os.read(read, 4096).decode() if ready else "no answer within 20 s"
    finally:
        os.close(read)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    written = regions[0].tobytes() != before  # (the parent's ``through`` is its first word)
    through = int(regions[0][:8].view(np.int64)[0])
    assert outcome.startswith("UsageError") and "forked" in outcome and not written, (
        outcome, f"mailbox written: {written}, the parent's through: {through}")  # fmt: skip
    lanes[0].progress()
    assert mine.request.result(timeout=0).tolist() == [3.0] * 4


class Interrupted:
    """``Lane.run_waiting``'s ``adopt`` whose first call raises ``error`` (a signal handler's
    exception landing in it), and later ones hand over ``op``."""

    def __init__(self, op: LaneOp, error: type[BaseException]) -> None:
        self.op, self.error, self.calls = op, error, 0

    def __call__(self) -> LaneOp:
        self.calls += 1
        if self.calls == 1:
            raise self.error()
        return self.op


@pytest.mark.parametrize("where", ["wait", "collect", "adopt"])
def test_an_exception_in_run_after_it_published_leaves_the_operation_to_the_lane(
    where: str, kind: type[Mailbox]
) -> None:
    """A signal handler's exception (KeyboardInterrupt) lands in ``run`` after it published:
    in the spin's wait, in its look at the peers' slots, or in ``adopt`` as the spin gives up.
    It reaches the caller, and the operation stays the lane's, completed as any other: the
    peer's comes, and 2 x SLOTS more go through on both ranks (an operation lost after its
    publish froze this rank's ``through``, so every rank's slots, after SLOTS more)."""
    world = World(2, kind)
    lane, mailbox = world.lanes[0], world.lanes[0].mailbox
    mine = lane_op(0, np.full(2, 1.0, np.float32))
    adopt: Adopted | Interrupted = Adopted(mine)
    if where == "adopt":
        adopt = Interrupted(mine, KeyboardInterrupt)
    else:

        def once(*args: Any) -> Any:
            delattr(mailbox, where)  # the mailbox's own from now on
            raise KeyboardInterrupt

        setattr(mailbox, where, once)
    with pytest.raises(KeyboardInterrupt):
        lane.run_waiting(mine.key, mine.desc, mine.header, mine.buf.flat, mine.buf.dtype, "sum",
                         None, adopt)  # fmt: skip
    assert not mine.request.done()
    theirs = [lane_op(0, np.full(2, 2.0, np.float32))]
    post(world.lanes[1], theirs[0])
    ours = [mine]
    for s in range(1, 2 * SLOTS + 1):
        ours.append(lane_op(s, np.full(2, float(s), np.float32)))
        theirs.append(lane_op(s, np.full(2, 10.0 * s, np.float32)))
        post(lane, ours[-1])
        post(world.lanes[1], theirs[-1])
    for each in world.lanes:
        each.progress()
    for s, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        want = [3.0] * 2 if s == 0 else [11.0 * s] * 2
        assert a.request.done() and b.request.done(), (s, lane.unnamed._through, lane.unnamed._next)
        assert a.request.result(timeout=0).tolist() == b.request.result(timeout=0).tolist() == want
    assert mine.buf.original.tolist() == [3.0] * 2  # (the caller's buffer: the result, late)
    assert not any(each.busy for each in world.lanes)
    assert lane.unnamed._through == world.lanes[1].unnamed._through == 2 * SLOTS + 1


def _lane_of(comm: ar.Communicator) -> Lane | None:
    return getattr(comm._backend, "lane", None)


CASES = [("float32", "sum"), ("float64", "avg"), ("float16", "max"), ("int32", "prod"),
         ("int64", "min"), ("uint8", "bxor"), ("bool", "sum"), ("complex64", "sum"),
         ("int16", "band")]  # fmt: skip
COUNTS = (1, 1000, 4096)  # up to 32 KiB of complex64


def contribution(count: int, dtype: str, rank: int) -> np.ndarray[Any, Any]:
    """What ``rank`` contributes to the allreduce of ``count`` elements of ``dtype``."""
    rng = np.random.default_rng([count, rank])
    values = np.abs(rng.standard_normal(count)) * 4
    if dtype == "bool":
        return values < 1.5
    if dtype == "complex64":
        return (values + 1j * values[::-1]).astype(dtype)
    return values.astype(dtype)


def body_every_dtype_and_reduction(comm: ar.Communicator) -> dict[str, Any]:
    """Unnamed allreduces of every size class, dtype and reduction; returns what each gave
    (bytes), and how many the lane completed and handed on."""
    lane = _lane_of(comm)
    assert lane is not None
    done: dict[str, bytes] = {}
    for count in COUNTS:
        for dtype, op in CASES:
            x = contribution(count, dtype, comm.rank)
            done[f"{count}-{dtype}-{op}"] = comm.allreduce(x, op=op).tobytes()
    done["large"] = comm.allreduce(np.ones(1 << 15, np.float32)).tobytes()  # 128 KiB: engine
    done["named"] = comm.allreduce(np.ones(4, np.float32), name="n").tobytes()  # engine
    return {"done": done, "lane": lane.completed, "converted": lane.converted,
            "ran": lane.ran, "mailbox": type(lane.mailbox).__name__}  # fmt: skip


@pytest.mark.parametrize("native", [pytest.param("1", marks=NATIVE), "0"], ids=["native", "python"])
@pytest.mark.parametrize("n", [2, 3])
def test_unnamed_small_allreduces_take_the_lane_and_agree_bitwise(n: int, native: str) -> None:
    """Both mailboxes (ASYNCREDUCE_NATIVE) give numpy's rank-order fold, bit for bit."""
    results = run_ranks(n, body_every_dtype_and_reduction, env={"ASYNCREDUCE_NATIVE": native})
    first = results[0]["done"]
    for rank, got in results.items():
        assert got["done"] == first, f"rank {rank} differs"
        assert got["lane"] == 27 and got["converted"] == 0, got  # 3 sizes x 9 cases, no more
        # each a blocking call, run on the caller's thread unless a peer came after its spin
        assert 0 < got["ran"] <= 27, got
        assert got["mailbox"] == ("NativeMailbox" if native == "1" else "Mailbox"), got
    # the values: rank-order folds of what every rank contributed
    for key, raw in first.items():
        if key in ("large", "named"):
            assert np.frombuffer(raw, np.float32).tolist() == [float(n)] * (len(raw) // 4)
            continue
        count, dtype, op = key.split("-")
        want = expected([contribution(int(count), dtype, r) for r in range(n)], op)
        assert raw == want.tobytes(), key


def body_mixed_with_the_engine(comm: ar.Communicator) -> list[float]:
    """Unnamed operations of every path in one sequence (small and large allreduces,
    broadcasts, barriers), many in flight, rank 1 starting 0.3 s late and more than SLOTS
    behind; meanwhile a thread posts named allreduces in an order of its own per rank, small
    ones and 16 MiB ones."""
    r, n = comm.rank, comm.world_size
    names = [f"named{i}" for i in range(20)]
    random.Random(r).shuffle(names)

    def named() -> None:
        posted = [comm.iallreduce(np.ones(8, np.float32), name=name) for name in names]
        bulk = [comm.iallreduce(np.ones(BULK_FLOATS, np.float32), name=f"bulk{i}")
                for i in range(3)]  # fmt: skip
        assert [q.wait(timeout=30).tolist() for q in posted] == [[n] * 8] * len(names)
        assert all(float(q.wait(timeout=60)[-1]) == n for q in bulk)

    side = threading.Thread(target=named)
    side.start()
    if r == 1:
        time.sleep(0.3)
    requests, wanted = [], []
    for i in range(3 * SLOTS):
        if i % 7 == 3:
            requests.append(comm.iallreduce(np.full(40000, float(i), np.float32)))  # engine
            wanted.append(float(i * n))
        elif i % 11 == 5:
            requests.append(comm.ibroadcast(np.full(3, float(r + i), np.float64), root=1))
            wanted.append(float(1 + i))
        elif i % 13 == 6:
            requests.append(comm.ibarrier())
            wanted.append(-1.0)
        else:
            requests.append(comm.iallreduce(np.full(16, float(r * i), np.float32)))
            wanted.append(float(i * sum(range(n))))
    got = [-1.0 if w == -1.0 else float(np.asarray(q.wait(timeout=30))[0])
           for q, w in zip(requests, wanted, strict=True)]  # fmt: skip
    side.join()
    assert got == wanted
    lane = _lane_of(comm)
    assert lane is not None and lane.completed >= 2 * SLOTS and lane.converted == 0
    return got


def test_the_lane_interleaves_with_the_engine_and_with_named_operations() -> None:
    results = run_ranks(3, body_mixed_with_the_engine, timeout=90)
    assert results[0] == results[1] == results[2]


def body_blocking_beside_large_ones(comm: ar.Communicator) -> dict[str, int]:
    """The training thread makes 300 blocking small allreduces (each ``run`` on its own
    thread where the lane is idle) while two other threads post named 16 MiB and small
    allreduces in an order of their own per rank, then wait for them; every value is right."""
    r, n = comm.rank, comm.world_size
    failures: list[BaseException] = []

    def side(prefix: str, floats: int, count: int) -> None:
        try:
            names = [f"{prefix}{i}" for i in range(count)]
            random.Random(r).shuffle(names)
            posted = [
                comm.iallreduce(np.full(floats, 1.0, np.float32), name=name, timeout=60)
                for name in names
            ]  # fmt: skip  (posted in any order, then waited)
            assert all(float(q.wait()[-1]) == n for q in posted)
        except BaseException as exc:  # reported below: a thread's assert is not the test's
            failures.append(exc)

    threads = [threading.Thread(target=side, args=("big", BULK_FLOATS, 4)),
               threading.Thread(target=side, args=("small", 16, 50))]  # fmt: skip
    for t in threads:
        t.start()
    for i in range(300):
        x = np.full(64, float(r + i), np.float32)
        assert comm.allreduce(x, timeout=30)[0] == n * i + sum(range(n)), i
    for t in threads:
        t.join()
    assert not failures, failures
    lane = _lane_of(comm)
    assert lane is not None
    return {"completed": lane.completed, "ran": lane.ran, "converted": lane.converted}


def test_blocking_lane_allreduces_beside_large_ones_from_other_threads() -> None:
    results = run_ranks(2, body_blocking_beside_large_ones, timeout=120)
    for got in results.values():
        assert got["completed"] == 300 and got["converted"] == 0, got
        assert got["ran"] > 0, got  # (the rest found the peer late: adopted, still right)


def body_closed_during_run(comm: ar.Communicator) -> dict[str, Any]:
    """Rank 0 blocks in a lane allreduce that rank 1 never posts; another thread of rank 0
    closes the communicator: the call raises ClosedError at once, not at some timeout."""
    comm.barrier()
    if comm.rank == 1:
        time.sleep(2.0)  # closing later, so rank 0's own close is what ends its call
        return {}
    closing = threading.Timer(0.3, comm.close)
    closing.start()
    start = time.monotonic()
    with pytest.raises(ar.ClosedError) as caught:
        comm.allreduce(np.ones(4, np.float32))
    closing.join()
    return {"took": time.monotonic() - start, "message": str(caught.value)}


def test_a_close_from_another_thread_ends_a_blocking_lane_allreduce() -> None:
    got = run_ranks(2, body_closed_during_run)[0]
    assert 0.25 < got["took"] < 5, got
    assert "allreduce #" in got["message"], got


def body_interrupted_in_run(comm: ar.Communicator, error: str) -> dict[str, Any]:
    """Rank 0's first blocking lane allreduce is interrupted after it published, by
    ``error`` raised where a signal handler's lands most often (the spin's wait); it catches
    it and goes on, as both ranks do, with 40 more. A watchdog aborts after 5 s, noting the
    lane's state (a lost operation froze the slots SLOTS later, with no error)."""
    lane = _lane_of(comm)
    assert lane is not None
    raised = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[error]
    if comm.rank == 0:
        mailbox = lane.mailbox

        def interrupted(seq: int, seconds: float) -> bool:
            delattr(mailbox, "wait")  # once: the mailbox's own from now on
            raise raised()

        mailbox.wait = interrupted  # type: ignore[method-assign]
    stuck: dict[str, Any] = {}

    def note() -> None:  # (both ranks, before either aborts)
        ops = lane.unnamed
        stuck.update(through=ops._through, next=ops._next, unpublished=sorted(ops._unpublished))

    timers = [threading.Timer(4.8, note), threading.Timer(5.0, comm.abort, ("the lane is stuck",))]
    for timer in timers:
        timer.start()
    xs = [np.full(4, float(i + comm.rank), np.float32) for i in range(41)]
    done = caught = 0
    start = time.monotonic()
    try:
        for x in xs:
            try:
                comm.allreduce(x)
                done += 1
            except raised:
                caught += 1
    except ar.BrokenError:
        pass
    finally:
        for timer in timers:
            timer.cancel()
    return {"done": done, "caught": caught, "took": time.monotonic() - start, "stuck": stuck,
            "values": [float(x[0]) for x in xs]}  # fmt: skip


@pytest.mark.parametrize("error", ["KeyboardInterrupt", "SystemExit"])
def test_an_exception_in_a_blocking_lane_allreduce_leaves_the_lane_going(error: str) -> None:
    """The interrupted allreduce completes on both ranks (on rank 0 its caller got the
    exception, and the result lands in its buffer all the same), and so do the 40 after it,
    within 5 s."""
    results = run_ranks(2, body_interrupted_in_run, error)
    for rank, got in results.items():
        assert not got["stuck"] and got["took"] < 5, (rank, got)
        assert (got["done"], got["caught"]) == ((40, 1) if rank == 0 else (41, 0)), (rank, got)
        assert got["values"] == [2.0 * i + 1 for i in range(41)], (rank, got)


def body_unnamed_ahead_of_a_named_one(comm: ar.Communicator) -> int:
    """Rank 0 posts 2 x SLOTS unnamed allreduces, then blocks on a named one; rank 1 blocks
    on the named one first and posts the unnamed ones after: posting never waits for a slot,
    so this completes (a lane that made the post wait would deadlock here)."""
    xs = [np.full(4, float(i), np.float32) for i in range(2 * SLOTS)]
    if comm.rank == 0:
        requests = [comm.iallreduce(x) for x in xs]
        comm.allreduce(np.ones(1, np.float32), name="meet", timeout=20)
    else:
        comm.allreduce(np.ones(1, np.float32), name="meet", timeout=20)
        requests = [comm.iallreduce(x) for x in xs]
    ar.wait_all(requests, timeout=20)
    assert [x[0] for x in xs] == [2.0 * i for i in range(2 * SLOTS)]
    return len(requests)


def test_posting_never_waits_for_a_slot() -> None:
    assert run_ranks(2, body_unnamed_ahead_of_a_named_one) == {0: 2 * SLOTS, 1: 2 * SLOTS}


def body_barriers(comm: ar.Communicator) -> dict[str, Any]:
    """Rank r enters each unnamed barrier 0.2 r s late: none leaves before the last came
    (``time.time``: the ranks share a clock). Blocking ones and ``ibarrier`` go through the
    lane, a named one and one with a timeout too where they may (named: the engine)."""
    lane = _lane_of(comm)
    assert lane is not None
    before, entered, left = lane.completed, [], []
    for how in ("blocking", "ibarrier", "timeout", "named"):
        time.sleep(0.2 * comm.rank)
        entered.append(time.time())
        if how == "blocking":
            comm.barrier()
        elif how == "ibarrier":
            assert comm.ibarrier().wait(timeout=20) is None
        else:
            comm.barrier(timeout=20, name="b" if how == "named" else None)
        left.append(time.time())
    x = comm.allreduce(np.full(3, comm.rank + 1.0, np.float32))  # the lane still in step
    return {
        "entered": entered,
        "left": left,
        "lane": lane.completed - before,
        "converted": lane.converted,
        "sum": x.tolist(),
    }


@pytest.mark.parametrize("native", [pytest.param("1", marks=NATIVE), "0"], ids=["native", "python"])
def test_unnamed_barriers_take_the_lane_and_wait_for_every_rank(native: str) -> None:
    results = run_ranks(3, body_barriers, env={"ASYNCREDUCE_NATIVE": native})
    for i in range(4):
        last_in = max(got["entered"][i] for got in results.values())
        for rank, got in results.items():
            assert got["left"][i] >= last_in, (i, rank, got)
    for got in results.values():  # three unnamed barriers and the allreduce; not the named
        assert got["lane"] == 4 and got["converted"] == 0, got
        assert got["sum"] == [6.0, 6.0, 6.0], got


def body_differs(comm: ar.Communicator, what: str) -> str:
    """Rank 1's unnamed allreduce differs from rank 0's 1 KiB float32 one by ``what`` (or
    is a barrier, "barrier"; an empty allreduce, "empty"); both must fail with
    MismatchError, and the communicator is broken after."""
    x = np.ones(256, np.float32)
    if what == "empty":  # (a barrier first: its kept descriptor must not be the allreduce's)
        x = np.ones(0, np.uint8)
        comm.barrier()
    with pytest.raises(ar.MismatchError) as caught:
        if comm.rank == 1 and what in ("barrier", "empty"):
            comm.barrier(timeout=20)
        elif comm.rank == 1:
            x = {"size": np.ones(1 << 18, np.float32), "dtype": np.ones(256, np.int32),
                 "count": np.ones(255, np.float32)}[what]  # fmt: skip
        comm.allreduce(x, timeout=20)
    with pytest.raises(ar.BrokenError):
        comm.allreduce(np.ones(4, np.float32))
    return str(caught.value)


@pytest.mark.parametrize("what", ["size", "dtype", "count", "barrier", "empty"])
def test_a_rank_that_differs_fails_every_rank_with_a_mismatch(what: str) -> None:
    """ "size": rank 1's allreduce is too large for the lane, so it runs on the engine while
    rank 0's is in the lane; "dtype", "count": both in the lane, described differently;
    "barrier", "empty": a barrier against an allreduce (of nothing, for "empty"), both in
    the lane."""
    results = run_ranks(2, body_differs, what)
    for rank, message in results.items():
        assert "rank 0" in message and "rank 1" in message, (rank, message)


def body_timeout(comm: ar.Communicator) -> str:
    """Rank 1 posts nothing for 1.5 s; rank 0's lane allreduce times out after 0.3 s, and
    rank 1's post, when it comes, fails at once."""
    if comm.rank == 0:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as caught:
            comm.allreduce(np.ones(4, np.float32), timeout=0.3)
        assert time.monotonic() - start < 3
        return str(caught.value)
    time.sleep(1.5)
    with pytest.raises((ar.BrokenError, TimeoutError)) as failed:
        comm.allreduce(np.ones(4, np.float32), timeout=10)
    return str(failed.value)


def test_a_timeout_in_the_lane_fails_every_rank() -> None:
    results = run_ranks(2, body_timeout)
    assert "within its timeout of 0.3 s on rank 0" in results[0], results[0]
    assert "still waiting for rank 1" in results[0], results[0]
    assert "timeout" in results[1], results[1]


def body_killed(comm: ar.Communicator) -> dict[str, Any]:
    """Rank 2 SIGKILLs itself while the others wait in the lane for its contribution."""
    comm.allreduce(np.ones(4, np.float32))
    if comm.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(ar.BrokenError) as caught:
        comm.allreduce(np.ones(4, np.float32))
    return {"took": time.monotonic() - start, "message": str(caught.value)}


def test_a_peer_killed_while_the_others_wait_in_the_lane_breaks_them() -> None:
    results = run_ranks(3, body_killed, expect_dead=frozenset({2}))
    for rank in (0, 1):
        assert "rank 2" in results[rank]["message"], results[rank]
        assert results[rank]["took"] < 10, results[rank]


def body_goodbye_after_its_slots(comm: ar.Communicator) -> list[tuple[str, Any]]:
    """Rank 2 posts unnamed allreduces k and k + 1 (its slots hold both) and closes. Rank 0
    posts k and waits; rank 1 posts k only after rank 0 read the goodbye, and before rank 1
    reads it (its progress thread is held in the goodbye). Then both post k + 1 (after the
    goodbye, everywhere) and k + 2, which rank 2 never posted."""
    comm.barrier(name="start")
    mine = float(comm.rank + 1)
    if comm.rank == 2:
        comm.iallreduce(np.full(4, mine, np.float32))
        comm.iallreduce(np.full(4, mine, np.float32))
        comm.close()
        return []
    held = threading.Event()
    if comm.rank == 1:
        session = comm._backend.engine.session  # type: ignore[union-attr]
        read = session._on_goodbye

        def on_goodbye(peer: int, reason: str) -> None:
            held.wait(10)
            read(peer, reason)

        session._on_goodbye = on_goodbye  # type: ignore[method-assign]
        time.sleep(1.0)  # rank 0 read the goodbye and looked at its lane by now
    outcomes: list[tuple[str, Any]] = []
    for i in range(3):
        try:
            got = comm.iallreduce(np.full(4, mine, np.float32)).wait(timeout=5)
            outcomes.append(("done", got.tolist()))
        except (ar.BrokenError, TimeoutError) as exc:
            outcomes.append((type(exc).__name__, str(exc)))
        held.set()  # (rank 1 reads the goodbye now)
        if i == 0:
            time.sleep(0.5)
    return outcomes


def test_a_goodbye_fails_only_what_still_needs_the_rank_that_left() -> None:
    """Ranks 0 and 1 end each operation alike: k and k + 1 complete with rank 2's
    contribution (its slots hold it, and its goodbye cannot take it back), however each
    rank's post and its reading of the goodbye fell; k + 2 fails on both, naming rank 2."""
    results = run_ranks(3, body_goodbye_after_its_slots)
    ends = {rank: [kind for kind, _ in results[rank]] for rank in (0, 1)}
    assert ends[0] == ends[1], results
    for rank in (0, 1):
        got = results[rank]
        assert [kind for kind, _ in got] == ["done", "done", "BrokenError"], (rank, got)
        assert got[0][1] == got[1][1] == [6.0] * 4, (rank, got)
        assert "rank 2" in got[2][1], (rank, got)


def body_callback_and_close(comm: ar.Communicator) -> dict[str, Any]:
    """A lane allreduce nobody waits on completes by the progress thread and runs its
    callback; then rank 0 posts one that rank 1 never posts, and closes: it fails with
    ClosedError."""
    fired = threading.Event()
    request = comm.iallreduce(np.full(4, float(comm.rank), np.float32))
    request.add_done_callback(lambda _: fired.set())
    concurrent.futures.wait([request], timeout=10)  # no driver: only the progress thread
    outcome: dict[str, Any] = {"callback": fired.wait(5), "value": request.result(0).tolist()}
    comm.barrier(name="before-close")
    if comm.rank == 0:
        pending = comm.iallreduce(np.ones(4, np.float32))
        comm.close()
        outcome["closed"] = type(pending.exception(timeout=5)).__name__
    else:
        time.sleep(1.0)  # closing later, so rank 0's own close is what fails its operation
    return outcome


def test_the_progress_thread_completes_what_nobody_waits_on_and_close_fails_the_rest() -> None:
    results = run_ranks(2, body_callback_and_close)
    for got in results.values():
        assert got["callback"] and got["value"] == [1.0] * 4, got
    assert results[0]["closed"] == "ClosedError"


def body_lane_state(comm: ar.Communicator) -> bool:
    assert comm.allreduce(np.ones(4, np.float32)).tolist() == [comm.world_size] * 4
    assert comm.data_plane.lane == (_lane_of(comm) is not None)
    return comm.data_plane.lane


def body_mailbox_kind(comm: ar.Communicator) -> str:
    assert comm.allreduce(np.full(4, comm.rank, np.float32)).tolist() == [1.0] * 4
    lane = _lane_of(comm)
    assert lane is not None
    return type(lane.mailbox).__name__


@NATIVE
def test_one_rank_without_the_c_mailbox_makes_every_rank_fold_in_python() -> None:
    """So every rank folds with the same code (the same bits, whatever the compiler did)."""
    assert run_ranks(2, body_mailbox_kind, rank_env={1: {"ASYNCREDUCE_NATIVE": "0"}}) == {
        0: "Mailbox",
        1: "Mailbox",
    }
    assert run_ranks(2, body_mailbox_kind) == {0: "NativeMailbox", 1: "NativeMailbox"}


@pytest.mark.parametrize("env", [{"ASYNCREDUCE_LANE": "0"}, {"ASYNCREDUCE_SPIN_US": "0"}])
def test_one_rank_that_does_not_want_the_lane_turns_it_off_everywhere(env: dict[str, str]) -> None:
    assert run_ranks(2, body_lane_state, rank_env={1: env}) == {0: False, 1: False}
    assert run_ranks(2, body_lane_state) == {0: True, 1: True}


def body_stopped(comm: ar.Communicator) -> dict[str, Any]:
    """Rank 2 SIGSTOPs itself (alive, silent) while the others wait in the lane for it; they
    fail with BrokenError naming it after the peer timeout (1 s), and rank 0 kills it."""
    pids = comm.allgather(np.array([os.getpid()], np.int64))
    if comm.rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(ar.BrokenError) as caught:
        comm.allreduce(np.ones(4, np.float32))
    if "reported by" not in str(caught.value):  # (found here: the peer timeout is its cause)
        assert isinstance(caught.value.__cause__, TimeoutError), repr(caught.value.__cause__)
    took = time.monotonic() - start
    if comm.rank == 0:
        os.kill(int(pids[2][0]), signal.SIGKILL)
    return {"took": took, "message": str(caught.value)}


def test_a_stopped_peer_fails_the_lane_after_the_peer_timeout() -> None:
    results = run_ranks(3, body_stopped, env={"ASYNCREDUCE_PEER_TIMEOUT": "1"},
                        expect_dead=frozenset({2}))  # fmt: skip
    for rank in (0, 1):
        got = results[rank]
        assert "rank 2" in got["message"] and "heartbeat" in got["message"], got
        assert 0.9 < got["took"] < 6, got


def body_flight_of_every_way(comm: ar.Communicator) -> dict[str, Any]:
    """One operation of each way an operation goes (protocol/route.py): blocking unnamed and
    named ones through the lane, posted ones through it, a large one on the engine, and a
    group's barrier on the engine; each settled in the flight record once, as done."""
    lane = _lane_of(comm)
    assert lane is not None
    for i in range(5):
        comm.allreduce(np.full(256, 1.0, np.float32))  # blocking, unnamed: the lane, no request
        comm.allreduce(np.full(256, 1.0, np.float32), name=f"named{i}")
    comm.iallreduce(np.ones(16, np.float32), name="posted").wait(timeout=20)
    comm.allreduce(np.ones(1 << 17, np.float32), name="large")  # 512 KiB: the engine
    comm.group([0, 1]).barrier()
    records = comm.flight_record()["records"]
    return {
        "names": sorted(r["name"] for r in records),
        "states": sorted({r["state"] for r in records}),
        "ran": lane.ran,
    }


def test_every_way_an_operation_goes_settles_it_in_the_flight_record() -> None:
    results = run_ranks(2, body_flight_of_every_way)
    for got in results.values():
        names = got["names"]
        assert names.count("") >= 5, got  # the unnamed ones (run on the caller's thread: ran)
        assert [n for n in names if n.startswith("named")] == [f"named{i}" for i in range(5)]
        assert "posted" in names and "large" in names, got
        assert got["states"] == ["done"], got
        assert got["ran"] >= 5, got


def body_watched_then_converted(comm: ar.Communicator) -> list[tuple[int, str]]:
    """Rank 0's unnamed 1 KiB allreduce waits in the lane long enough for the progress thread
    to watch it (a flight record); rank 1's, 1 MiB, runs on the engine, so rank 0's lane hands
    its own over: the engine takes over its record, and the operation ends recorded once."""
    if comm.rank == 1:
        time.sleep(0.5)
    x = np.ones(1 << 18 if comm.rank == 1 else 256, np.float32)
    with pytest.raises(ar.MismatchError):
        comm.allreduce(x, timeout=20)
    records = comm.flight_record()["records"]
    return [(r["instance"], r["state"]) for r in records if r["name"] == ""]


def test_a_watched_lane_operation_the_engine_takes_over_is_recorded_once() -> None:
    results = run_ranks(2, body_watched_then_converted)
    assert results[0] == [(0, "failed")], results  # (was two: the lane's and the engine's)
    assert results[1] == [(0, "failed")], results
