"""The protocol (protocol/session.py) in one process: every rank a Session, joined by the fake
wire of wire.py, with posting orders, link interleavings, split receives and the clock drawn by
hypothesis over 2-9 ranks. What the multi-process tests (test_comm, test_faults) check end to
end is checked here rule by rule, in milliseconds:

- named operations posted in any order on each rank complete with the right values;
- a mismatch fails the operation with MismatchError on every rank;
- an operation's failure (its timeout) reaches every rank with the same class;
- goodbye is not loss: a rank that closed in good order fails only what still needs it;
- abort and a lost connection break every rank;
- a silent rank (heartbeats lost) is named by every rank that waits on it;
- back-pressure: past the hold cap the sender holds back, and everything still completes;
- the stall inspector names the ranks that never posted;
- a frame for an operation that completed here is dropped and said so;
- duplicated control frames change nothing;
- an allreduce a caller's thread started around the session (``Engine.run_direct``) is taken over
  where it stands, and the session says when it is quiet enough for one to start.
"""

from __future__ import annotations

import ast
import itertools
import logging
import pathlib

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import asyncreduce as ar
from asyncreduce.protocol import Settings
from wire import Wire

RANKS = st.integers(2, 9)
SEEDS = st.integers(0, 2**32 - 1)
fast = settings(max_examples=40, deadline=None)


def values(rank: int, count: int, salt: int = 0) -> np.ndarray:
    return (np.arange(count, dtype=np.float64) * (rank + 1) + salt).astype(np.float32)


def expected(n: int, count: int, salt: int = 0) -> np.ndarray:
    return sum(values(r, count, salt).astype(np.float64) for r in range(n)).astype(np.float32)


def outcome(request: ar.Request) -> BaseException | None:  # type: ignore[type-arg]
    assert request.done(), f"{request.label} never ended"
    return request.exception()


@fast
@given(n=RANKS, seed=SEEDS, data=st.data())
def test_named_operations_in_any_order_complete_with_the_right_values(
    n: int, seed: int, data: st.DataObject
) -> None:
    counts = {"a": 3, "b": 1000, "c": 20000, "d": 17}  # doubling and ring; 20000 floats: segments
    wire = Wire(n, seed)
    posted = []
    for rank in range(n):
        for name in data.draw(st.permutations(sorted(counts))):
            posted.append((rank, name))
    order = data.draw(st.permutations(posted))
    buffers = {}
    for rank, name in order:
        buffers[rank, name] = values(rank, counts[name], ord(name))
        wire.post(rank, "allreduce", name, buffers[rank, name])
        for _ in range(data.draw(st.integers(0, 30))):
            wire.step()
    wire.run()
    for (rank, name), buf in buffers.items():
        request = wire.ranks[rank].requests[name]
        assert outcome(request) is None, request.exception()
        np.testing.assert_allclose(buf, expected(n, counts[name], ord(name)), rtol=1e-5)
    assert all(not r.session.matching.ops and not r.session.matching.unexpected for r in wire.ranks)


@fast
@given(n=RANKS, seed=SEEDS, data=st.data())
def test_a_mismatch_fails_the_operation_on_every_rank(
    n: int, seed: int, data: st.DataObject
) -> None:
    culprit = data.draw(st.integers(0, n - 1))
    wire = Wire(n, seed)
    for rank in data.draw(st.permutations(range(n))):
        count = 9 if rank == culprit else 8
        wire.post(rank, "allreduce", "x", np.ones(count, np.float32))
    wire.post(0, "allreduce", "later", np.ones(4, np.float32))
    wire.run()
    for rank, state in enumerate(wire.ranks):
        error = outcome(state.requests["x"])
        assert isinstance(error, ar.MismatchError), (rank, error)
        assert "float32[8]" in str(error) and "float32[9]" in str(error), str(error)
        assert state.session.broken is not None
    assert isinstance(outcome(wire.ranks[0].requests["later"]), ar.BrokenError)


@fast
@given(n=RANKS, seed=SEEDS, data=st.data())
def test_a_timeout_fails_the_operation_with_the_same_class_everywhere(
    n: int, seed: int, data: st.DataObject
) -> None:
    late = data.draw(st.integers(0, n - 1))
    wire = Wire(n, seed)
    for rank in range(n):
        wire.post(rank, "allreduce", "other", np.ones(4, np.float32))
        if rank != late:
            wire.post(rank, "allreduce", "x", np.ones(4, np.float32), timeout=1.0)
    wire.run()
    wire.tick(1.5)  # every rank that posted "x" has passed its deadline
    wire.run()
    for rank, state in enumerate(wire.ranks):
        assert outcome(state.requests["other"]) is None
        assert isinstance(state.session.broken, TimeoutError), (rank, state.session.broken)
        if rank != late:
            error = outcome(state.requests["x"])
            assert isinstance(error, TimeoutError) and "timeout of 1.0 s" in str(error), error
            assert "still waiting for rank" in str(error), str(error)
    # the late rank now posts it: it fails at once, the session broken by that timeout
    wire.post(late, "allreduce", "x", np.ones(4, np.float32))
    error = outcome(wire.ranks[late].requests["x"])
    assert isinstance(error, ar.BrokenError) and isinstance(error.__cause__, TimeoutError)


@fast
@given(n=st.integers(3, 9), seed=SEEDS, data=st.data())
def test_goodbye_fails_only_what_still_needs_the_closed_rank(
    n: int, seed: int, data: st.DataObject
) -> None:
    closer = data.draw(st.integers(0, n - 1))
    wire = Wire(n, seed)
    for rank in range(n):
        wire.post(rank, "allreduce", "done-before", np.ones(4, np.float32))
    wire.run()
    for rank in range(n):
        if rank != closer:
            wire.post(rank, "allreduce", "needs-it", np.ones(4, np.float32))
    wire.goodbye(closer, "finished")
    wire.run()
    for rank, state in enumerate(wire.ranks):
        assert outcome(state.requests["done-before"]) is None
        if rank == closer:
            continue
        error = outcome(state.requests["needs-it"])
        assert isinstance(error, ar.BrokenError), error
        refusal = state.session.refusal("next")
        assert refusal is not None and f"rank {closer} has closed" in str(refusal), refusal


@fast
@given(n=st.integers(3, 9), seed=SEEDS, data=st.data())
def test_a_post_after_a_goodbye_runs_on_what_the_closed_rank_sent_and_fails_if_it_needs_more(
    n: int, seed: int, data: st.DataObject
) -> None:
    """DDP's Join: the first rank to finish closes while the last joiner's broadcast of the
    final model is still to be posted on the others. What it sent first still counts."""
    root, closer, late = data.draw(st.permutations(range(n)))[:3]
    assume(late not in tree_ancestors(closer, root, n))  # else the closer left without it
    wire = Wire(n, seed)
    model = np.arange(6, dtype=np.float32) + 1
    buffers = {r: model.copy() if r == root else np.zeros(6, np.float32) for r in range(n)}
    for rank in range(n):
        if rank != late:
            wire.post(rank, "broadcast", "model", buffers[rank], root=root)
    wire.run()
    wire.goodbye(closer, "finished")
    wire.run()
    wire.post(late, "broadcast", "model", buffers[late], root=root)
    wire.run()
    for rank in range(n):
        if rank != closer:
            assert outcome(wire.ranks[rank].requests["model"]) is None, rank
            np.testing.assert_array_equal(buffers[rank], model)
    for rank in range(n):  # a broadcast from the closed rank, which never posted it
        if rank != closer:
            wire.post(rank, "broadcast", "from-closed", np.zeros(6, np.float32), root=closer)
    wire.run()
    parent = (closer - 1) % n  # the closer is a child of this root: it had data for it
    for rank in range(n):
        if rank != closer:
            wire.post(rank, "broadcast", "to-closed", np.zeros(6, np.float32), root=parent)
    wire.run()
    for rank in range(n):
        if rank != closer:
            for name in ("from-closed", "to-closed"):
                error = outcome(wire.ranks[rank].requests[name])
                assert isinstance(error, ar.BrokenError), (rank, name, error)
                assert f"rank {closer} has closed" in str(error), str(error)


def tree_ancestors(rank: int, root: int, n: int) -> set[int]:
    """The ranks above ``rank`` in the binomial broadcast tree from ``root`` (tree.py)."""
    above, v = set(), (rank - root) % n
    while v:
        v -= v & -v
        above.add((v + root) % n)
    return above


@fast
@given(n=RANKS, seed=SEEDS, data=st.data())
def test_a_connection_that_ends_after_its_goodbye_is_not_a_loss(
    n: int, seed: int, data: st.DataObject
) -> None:
    closer = data.draw(st.integers(0, n - 1))
    wire = Wire(n, seed)
    for rank in range(n):
        wire.post(rank, "allreduce", "done-before", np.ones(4, np.float32))
    wire.run()
    wire.goodbye(closer)
    wire.run()
    for rank, state in enumerate(wire.ranks):
        if rank != closer:
            state.session.lost(closer, ConnectionResetError("EOF"), closing=False)
            assert state.session.broken is None, (rank, state.session.broken)
            other = (closer + 1) % n if (closer + 1) % n != rank else (closer + 2) % n
            if other not in (rank, closer):  # a peer that never said goodbye: that is a loss
                state.session.lost(other, ConnectionResetError("reset"), closing=False)
                assert "lost its connection" in str(state.session.broken)


@fast
@given(n=RANKS, seed=SEEDS, data=st.data(), abort=st.booleans())
def test_abort_and_a_lost_connection_break_every_rank(
    n: int, seed: int, data: st.DataObject, abort: bool
) -> None:
    first = data.draw(st.integers(0, n - 1))
    wire = Wire(n, seed)
    for rank in range(n):
        if rank != first:
            wire.post(rank, "allreduce", "pending", np.ones(4, np.float32))
    if abort:
        wire.ranks[first].session.close("the user asked", [])
        wanted = f"rank {first} aborted: the user asked"
    else:
        other = (first + 1) % n
        wire.ranks[first].session.lost(other, ConnectionResetError("reset"), closing=False)
        wanted = f"rank {first} lost its connection to rank {other}"
    wire.apply(first)
    wire.run()
    for rank, state in enumerate(wire.ranks):
        assert isinstance(state.session.broken, ar.BrokenError), (rank, state.session.broken)
        assert wanted in str(state.session.broken), (rank, str(state.session.broken))
        if rank != first:
            assert isinstance(outcome(state.requests["pending"]), ar.BrokenError)


@fast
@given(n=RANKS, seed=SEEDS, data=st.data())
def test_a_silent_rank_is_named_by_every_rank_that_waits_on_it(
    n: int, seed: int, data: st.DataObject
) -> None:
    silent = data.draw(st.integers(0, n - 1))
    timeout = 2.0
    wire = Wire(n, seed, Settings(peer_timeout=timeout, spin=0.0))
    wire.drop_beats.add(silent)
    for rank in range(n):
        if rank != silent:
            wire.post(rank, "allreduce", "x", np.ones(4, np.float32))
    wire.run()
    for _ in range(5):  # beats every 0.05 s; silence is judged past timeout + a beat
        wire.tick(timeout / 2)
        wire.run()
    for rank, state in enumerate(wire.ranks):
        if rank == silent:
            continue
        error = outcome(state.requests["x"])
        assert isinstance(error, ar.BrokenError), (rank, error)  # not TimeoutError: no wait ran out
        if "reported by" not in str(error):  # (found here: the peer timeout is its cause)
            assert isinstance(error.__cause__, TimeoutError), (rank, error.__cause__)
        assert f"rank {silent} sent nothing for {timeout:g} s" in str(error), str(error)


@fast
@given(n=st.integers(2, 5), seed=SEEDS, data=st.data())
def test_past_the_hold_cap_the_sender_holds_back_and_all_completes(
    n: int, seed: int, data: st.DataObject
) -> None:
    names = [f"op{i}" for i in range(6)]
    count, cap = 20000, 4096  # the ring: every rank sends to the next one at once
    wire = Wire(n, seed, Settings(held_bytes=cap, spin=0.0))
    slow = data.draw(st.integers(0, n - 1))
    buffers = {}
    for rank in range(n):
        if rank != slow:
            for name in names:
                buffers[rank, name] = values(rank, count, len(name))
                wire.post(rank, "allreduce", name, buffers[rank, name])
    wire.run()  # what others sent for operations the slow rank has not posted is held
    flow = wire.ranks[slow].session.flow
    assert flow.told, "the slow rank held frames past the cap and told nobody to hold"
    left = sum(b for (src, dst), b in wire.left_before_hold.items() if dst == slow)
    assert flow.peak <= left, (flow.peak, left)  # nothing held that left after the Hold arrived
    assert any(wire.ranks[r].session.flow.kept for r in range(n) if r != slow)
    for name in names[::-1]:  # the slow rank posts in the other order
        buffers[slow, name] = values(slow, count, len(name))
        wire.post(slow, "allreduce", name, buffers[slow, name])
        for _ in range(data.draw(st.integers(0, 20))):
            wire.step()
    wire.run()
    for (rank, name), buf in buffers.items():
        assert outcome(wire.ranks[rank].requests[name]) is None
        np.testing.assert_allclose(buf, expected(n, count, len(name)), rtol=1e-5)
    for rank in range(n):  # the hold ended once the slow rank held little (Resume)
        flow = wire.ranks[rank].session.flow
        assert not (flow.told or flow.holding_back or flow.kept), (rank, flow.told)
        assert wire.ranks[rank].session.quiet((b"next", 0), wire.ranks[rank].now)


@fast
@given(n=st.integers(2, 5), seed=SEEDS, data=st.data())
def test_a_hold_ends_once_little_is_held_and_is_said_again_past_the_cap(
    n: int, seed: int, data: st.DataObject
) -> None:
    """Back-pressure comes and goes: a rank that held past the cap says Hold, then Resume
    once it holds at most a quarter of it (every sender sends as it comes again, and no
    PostNotice goes out for later operations); past the cap again, Hold again; all completes."""
    count, cap = 1000, 4000 * 4  # each operation's frame: 4000 bytes
    wire = Wire(n, seed, Settings(held_bytes=cap, spin=0.0))
    slow, fast_ranks = n - 1, range(n - 1)
    buffers: dict[tuple[int, str], np.ndarray] = {}

    def post(ranks: range | list[int], names: list[str]) -> None:
        for name in names:
            for rank in ranks:
                buffers[rank, name] = values(rank, count, len(name))
                wire.post(rank, "allreduce", name, buffers[rank, name])

    for phase in ("a", "b"):  # twice past the cap, each time drained
        names = [f"{phase}{i}" for i in range(8)]
        post(fast_ranks, names)
        wire.run()
        flow = wire.ranks[slow].session.flow
        assert flow.told, (phase, "past the cap, the slow rank told nobody to hold")
        post([slow], names[::-1])
        for _ in range(data.draw(st.integers(0, 20))):
            wire.step()
        wire.run()
        assert not flow.told and not any(
            wire.ranks[r].session.flow.holding_back for r in fast_ranks
        ), (phase, "the hold did not end")
    post(range(n), ["after"])
    wire.run()
    for (rank, name), buf in buffers.items():
        assert outcome(wire.ranks[rank].requests[name]) is None, (rank, name)
        np.testing.assert_allclose(buf, expected(n, count, len(name)), rtol=1e-5)


@fast
@given(n=st.integers(3, 9), seed=SEEDS, data=st.data())
def test_the_stall_inspector_names_the_ranks_that_never_posted(
    n: int, seed: int, data: st.DataObject
) -> None:
    absent = set(data.draw(st.lists(st.integers(1, n - 1), min_size=1, unique=True)))
    wire = Wire(n, seed, Settings(stall_warning=10.0, peer_timeout=1e6, spin=0.0))
    for rank in range(n):
        if rank not in absent:
            wire.post(rank, "allreduce", "stuck", np.ones(4, np.float32))
    wire.run()
    wire.tick(11.0)
    wire.run()
    reports = list(wire.ranks[0].session.stall.reports)
    assert len(reports) == 1, reports
    never = ar.errors.ranks_phrase(sorted(absent))
    assert f"never posted by {never}" in reports[0], reports[0]
    assert "no answer" not in reports[0], reports[0]


def test_a_frame_for_an_operation_completed_here_is_dropped_and_said_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wire = Wire(2, 7)
    wire.post(0, "broadcast", "b", np.arange(5, dtype=np.float32), root=0)
    wire.post(1, "broadcast", "b", np.zeros(5, np.float32), root=0)
    wire.run()
    assert all(outcome(s.requests["b"]) is None for s in wire.ranks)
    # rank 1 thinks it is a root: its frame for the completed "b" reaches rank 0 late
    wire.ranks[1].session.matching.done.clear()
    with caplog.at_level(logging.ERROR, logger="asyncreduce.engine"):
        wire.post(1, "broadcast", "b", np.ones(5, np.float32), root=1)
        wire.run()
    assert "rank 0 completed 'b'#0 as broadcast float32[5] root=0" in caplog.text, caplog.text
    assert not wire.ranks[0].session.matching.unexpected
    assert wire.ranks[0].session.broken is None


@fast
@given(n=RANKS, seed=SEEDS)
def test_duplicated_control_frames_change_nothing(n: int, seed: int) -> None:
    wire = Wire(n, seed, Settings(held_bytes=0, stall_warning=1.0, spin=0.0))
    wire.duplicate_control = True
    for rank in range(n):
        for name in ("p", "q") if rank % 2 else ("q", "p"):
            wire.post(rank, "allreduce", name, values(rank, 64))
    wire.run()
    for state in wire.ranks:
        assert all(outcome(r) is None for r in state.requests.values())
        assert state.session.broken is None


@fast
@given(n=RANKS, seed=SEEDS, abort=st.booleans())
def test_close_fails_what_is_pending_and_what_was_posted_late(
    n: int, seed: int, abort: bool
) -> None:
    wire = Wire(n, seed)
    wire.post(0, "allreduce", "pending", np.ones(4, np.float32))
    wire.run()
    late = wire.make(0, "allreduce", "late", np.ones(4, np.float32))
    wire.ranks[0].session.close("stop" if abort else None, [late])
    wire.apply(0)
    for name, request in wire.ranks[0].requests.items():
        error = outcome(request)
        if abort and name == "pending":
            assert isinstance(error, ar.BrokenError) and "rank 0 aborted: stop" in str(error)
        else:
            assert isinstance(error, ar.ClosedError), (name, error)
            assert "closed while it was pending" in str(error), str(error)
    refusal = wire.ranks[0].session.refusal("next")
    assert (refusal is not None) == abort, refusal


@fast
@given(seed=SEEDS)
def test_frames_held_back_for_a_rank_that_says_goodbye_are_let_go(seed: int) -> None:
    wire = Wire(2, seed, Settings(held_bytes=0, spin=0.0))
    wire.post(0, "allreduce", "x", np.ones(4, np.float32))  # unexpected at rank 1: past the cap
    wire.post(0, "broadcast", "y", np.ones(4, np.float32), root=0)  # never posted at rank 1
    wire.run()
    assert wire.ranks[0].session.flow.holding_back == {1: set()}, "rank 1 never said Hold"
    wire.post(1, "allreduce", "x", np.ones(4, np.float32))
    wire.run()
    wire.post(0, "broadcast", "b", np.ones(4, np.float32), root=0)  # kept back for rank 1
    wire.run()
    assert wire.ranks[0].session.flow.kept, "the broadcast's frame was not kept back"
    wire.goodbye(1)
    wire.run()
    assert outcome(wire.ranks[0].requests["b"]) is None  # the root needs nothing from rank 1
    assert outcome(wire.ranks[0].requests["x"]) is None
    assert outcome(wire.ranks[0].requests["y"]) is None
    wire.tick(100.0)  # long past the peer timeout: a departed rank is not silent
    assert 1 not in wire.ranks[0].session.liveness.silent(wire.ranks[0].now)
    assert not isinstance(wire.ranks[0].session.broken, TimeoutError)


SANS_IO = ("algorithms", "protocol")


@pytest.mark.parametrize("package", SANS_IO)
def test_the_sans_io_packages_import_no_socket_thread_or_clock(package: str) -> None:
    root = pathlib.Path(ar.__file__).parent / package
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in ("socket", "threading", "time", "selectors", "asyncio"), (
                    f"{path.name} imports {name}"
                )


def test_the_frame_checks_know_exactly_the_codes_the_algorithms_define() -> None:
    """transport/ may not import algorithms/, so frame.py restates the kinds it checks (its
    dtypes and reductions come from kernels/): this keeps them in step."""
    from asyncreduce.algorithms import DTYPES, KINDS, REDUCTION_CODES
    from asyncreduce.transport import frame

    assert set(frame._KIND_CODES) == set(KINDS.values())
    assert set(frame._DTYPE_CODES) == {d.code for d in DTYPES.values()}
    assert set(frame._REDUCE_CODES) == {0, *REDUCTION_CODES.values()}


# ---- around the session: a blocking small allreduce run on its caller's thread ------------


@fast
@given(n=RANKS, seed=SEEDS, data=st.data())
def test_an_allreduce_started_around_the_session_is_taken_over_where_it_stands(
    n: int, seed: int, data: st.DataObject
) -> None:
    """Some ranks start the algorithm themselves and send its first frames straight to the
    wire, some pairs of them even take each other's first frame and fold it (as
    ``Engine.run_direct`` does before it gives up: a partner late, another frame first), then hand
    it to the session with ``started=True``; the rest post it as usual. Every rank
    completes with the right values; with a culprit that posted another count, every rank
    fails naming both, whichever way each started (with a MismatchError, or a BrokenError
    for it where the rank broke before it posted)."""
    from asyncreduce.protocol.operation import bytes_of
    from asyncreduce.protocol.wire import data_head

    started = data.draw(st.sets(st.integers(0, n - 1), min_size=1))
    culprit = data.draw(st.none() | st.integers(0, n - 1))
    wire = Wire(n, seed)
    buffers, ops, sends = {}, {}, {}
    for rank in range(n):
        buffers[rank] = values(rank, 7 if rank == culprit else 6)
        ops[rank] = wire.make(rank, "allreduce", "x", buffers[rank])
        if rank in started:
            sends[rank] = list(ops[rank].algo.start())
    if data.draw(st.booleans()):  # a round run directly between started partners first
        for rank, partner in itertools.permutations(sorted(started - {culprit}), 2):
            awaited = ops[rank].algo.awaited
            mine = [s for s in sends[partner] if s.dst == rank]
            if mine and awaited == (partner, mine[0].step):
                sends[partner].remove(mine[0])  # taken off the stream by ``rank`` itself
                view = memoryview(mine[0].payload).cast("B")
                sends[rank] += ops[rank].algo.on_view(partner, awaited[1], 0, view)
    for rank in data.draw(st.permutations(range(n))):
        op, state = ops[rank], wire.ranks[rank]
        for send in sends.get(rank, []):
            payload = bytes_of(send.payload)
            head = data_head(op.key, send.step, send.seg, payload.nbytes, op.desc)
            wire._queue(rank, send.dst, head, payload, 0, None, 0)
        state.session.post(op, state.now, started=rank in started)
        wire.apply(rank)
        for _ in range(data.draw(st.integers(0, 20))):
            wire.step()
    wire.run()
    for rank, state in enumerate(wire.ranks):
        error = outcome(state.requests["x"])
        if culprit is None:
            assert error is None, (rank, error)
            np.testing.assert_allclose(buffers[rank], expected(n, 6), rtol=1e-5)
        else:
            assert isinstance(error, (ar.MismatchError, ar.BrokenError)), (rank, error)
            assert "float32[6]" in str(error) and "float32[7]" in str(error), str(error)
            assert isinstance(state.session.broken, ar.MismatchError), state.session.broken


def test_a_session_is_quiet_only_with_nothing_in_flight_kept_due_or_broken() -> None:
    wire = Wire(2, 3)
    session = wire.ranks[0].session
    key = (b"next", 0)
    assert session.quiet(key, 0.0)
    wire.post(0, "allreduce", "x", np.ones(4, np.float32))
    assert not session.quiet(key, 0.0)  # an operation in flight here
    wire.run()
    assert not wire.ranks[1].session.quiet(key, 0.0)  # rank 0's frame waits for its post
    wire.post(1, "allreduce", "x", np.ones(4, np.float32))
    wire.run()
    assert session.quiet(key, 0.0) and wire.ranks[1].session.quiet(key, 0.0)
    assert not session.quiet(key, session.liveness.beat_every)  # a beat is due: a turn sends it
    for flag, undo in (  # back-pressure either way, a key that failed, a broken session
        (lambda: session.flow.told.add(1), lambda: session.flow.told.clear()),
        (lambda: session.flow.holding_back.update({1: set()}), session.flow.holding_back.clear),
        (lambda: session.matching.failed.update({key: ar.BrokenError("x")}),
         session.matching.failed.clear),
        (lambda: setattr(session, "broken", ar.BrokenError("x")),
         lambda: setattr(session, "broken", None)),
    ):  # fmt: skip
        flag()
        assert not session.quiet(key, 0.0)
        undo()
        assert session.quiet(key, 0.0)
    session.heard_from([1], 0.5)
    session.ran(key, "allreduce #0", session.matching.done[(b"x", 0)], 0, 0.25, 0.5)
    assert session.matching.done[key] and session.liveness.heard[1] == 0.5  # remembered, heard
    recorded = [r for r in session.flight.snapshot()["records"] if r["name"] == "next"]
    assert [(r["instance"], r["state"]) for r in recorded] == [(0, "done")]  # and recorded
    assert recorded[0]["finished_at"] - recorded[0]["posted_at"] == pytest.approx(0.25)
    wire.goodbye(1)
    wire.run()
    assert not session.quiet((b"later", 0), 0.5)  # rank 1 said goodbye


class _Worker:
    """An algorithm with units of work of its own (as the shared-memory allreduce has):
    it records which operation each unit went to."""

    def __init__(self, name: str, units: int, log: list[str]) -> None:
        self.name, self.units, self.log = name, units, log
        self.pending_sources: set[int] = set()

    @property
    def has_work(self) -> bool:
        return self.units > 0

    @property
    def done(self) -> bool:
        return self.units == 0

    def work(self) -> list[object]:
        self.units -= 1
        self.log.append(self.name)
        return []


@given(order=st.permutations(["c", "a", "b"]))
@fast
def test_every_rank_works_on_the_same_operation_first_whatever_order_it_posted_them(
    order: list[str],
) -> None:
    """Units of work go to the most urgent operation, then the least key: not the first
    posted, which differs between ranks whose threads posted in different orders (each rank
    would reduce another operation's segments and wait on the rest)."""
    wire, log = Wire(2, seed=0), []
    session = wire.ranks[0].session
    for i, name in enumerate(order):
        op = wire.make(0, "allreduce", name, np.ones(4, np.float32))
        op.algo = _Worker(name, 2, log)  # type: ignore[assignment]
        op.priority = 1 if name == "c" else 0
        op.age = i
        session.working.add(op)
    while session.working:
        session.work(0.0)
    assert log == ["c", "c", "a", "a", "b", "b"]


def test_an_operation_whose_work_waited_long_goes_before_lesser_keys() -> None:
    """The key order cannot starve one: posted 0.1 s ago or more, it goes first."""
    wire, log = Wire(2, seed=0), []
    session = wire.ranks[0].session
    for name, started in (("a", 1.0), ("z", 0.5), ("b", 1.0)):
        op = wire.make(0, "allreduce", name, np.ones(4, np.float32))
        op.algo = _Worker(name, 1, log)  # type: ignore[assignment]
        op.started = started
        session.working.add(op)
    while session.working:
        session.work(1.05)
    assert log == ["z", "a", "b"]


@fast
@given(n=RANKS, seed=SEEDS)
def test_a_rank_hears_of_a_named_key_another_runs_on_the_engine(n: int, seed: int) -> None:
    """The same-host lane's hand-over (lane/named.py): the first frame of a named operation not
    posted here asks the lane to hand it over (``CLAIM``, not remembered: the frame itself
    waits); a ``PostNotice`` of an operation that announces itself asks to remember it too.
    Only ranks that have not posted the key hear of it, once per key. (The first frame may
    never come first: a rank whose algorithm waits to hear before it sends; the notice and the
    stall inspector's question cover that.)"""
    wire = Wire(n, seed)
    announced = wire.make(0, "allreduce", "a", np.ones(4, np.float32))
    announced.announce = True  # (a named one the lane could not take: lane/named.py)
    wire.ranks[0].session.post(announced, wire.ranks[0].now)
    wire.apply(0)
    wire.post(1, "allreduce", "b", np.ones(4, np.float32))
    wire.run()
    claims = set(wire.claims)
    for rank in range(1, n):
        assert (rank, (b"a", 0), True) in claims, (rank, wire.claims)
    assert not [c for c in wire.claims if c[0] == 0 and c[1] == (b"a", 0)]
    framed = [c for c in wire.claims if c[1] == (b"b", 0)]
    assert all(not remember and rank != 1 for rank, _, remember in framed), framed
    if n & (n - 1) == 0:  # (recursive doubling sends at once; an extra rank's partner waits)
        assert framed, wire.claims
    assert len(framed) == len({c[0] for c in framed})  # once per rank and key
