"""The failure rules of an operation outside the engine (protocol/outside.py), sans-IO: every
combination of a broken communicator, a departed peer, a deadline and a silent peer, in one
process, against the rules as the module states them (the lane's processes test the same rules
end to end in test_lane.py); and the Session applying them to an executor's operations, its
stall questions and answers included, on the fake wire (tests/wire.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import asyncreduce as ar
from asyncreduce.algorithms import DTYPES, KINDS, REDUCTION_CODES
from asyncreduce.errors import BrokenError, MismatchError
from asyncreduce.flight import Record
from asyncreduce.protocol import Settings
from asyncreduce.protocol.outside import Decide, Verdict, judge
from asyncreduce.transport.frame import Descriptor
from wire import Wire


@dataclass
class _Op:
    label: str = "allreduce#3"
    timeout: float | None = 2.0
    deadline: float = 10.0


class _Missing:
    """``missing`` that counts how often it was asked."""

    def __init__(self, ranks: set[int]) -> None:
        self.ranks, self.asked = ranks, 0

    def __call__(self) -> set[int]:
        self.asked += 1
        return self.ranks


def _judge(op: _Op, now: float, missing: _Missing, **state: object) -> Verdict | None:
    given_state = {"broken": None, "earlier": None, "departed": {}, "silent": set(),
                   "peer_timeout": 5.0, **state}  # fmt: skip
    return judge(op, 0, now, missing=missing, **given_state)  # type: ignore[arg-type]


def test_a_broken_communicator_fails_it_here_with_its_keys_error_or_the_cause() -> None:
    cause = BrokenError("rank 2 aborted")
    verdict = _judge(_Op(), 1.0, _Missing({1}), broken=cause)
    assert verdict is not None and not verdict.everywhere
    assert isinstance(verdict.error, BrokenError) and verdict.error.__cause__ is cause
    earlier = MismatchError("allreduce#3: rank 1 posted 4 elements")
    verdict = _judge(_Op(), 1.0, _Missing({1}), broken=cause, earlier=earlier)
    assert verdict is not None and type(verdict.error) is MismatchError
    assert str(verdict.error) == str(earlier) and verdict.error.__cause__ is earlier


def test_a_rank_that_left_without_publishing_it_fails_it_here_alone() -> None:
    departed = {1: "rank 1 closed its communicator", 3: "rank 3 closed its communicator"}
    verdict = _judge(_Op(), 11.0, _Missing({3, 1, 2}), departed=departed, silent={2})
    assert verdict is not None and not verdict.everywhere  # before the deadline and silence
    said = "allreduce#3 still needed rank 1, but rank 1 closed its communicator"
    assert str(verdict.error) == said
    assert _judge(_Op(), 1.0, _Missing({2}), departed=departed) is None  # they published it


def test_a_deadline_and_a_silent_peer_fail_it_everywhere_naming_whom_it_waits_for() -> None:
    late = _judge(_Op(), 10.0, _Missing({2}), silent={2})
    assert late is not None and late.everywhere and isinstance(late.error, TimeoutError)
    assert "timeout of 2.0 s" in str(late.error) and "rank 2" in str(late.error)
    quiet = _judge(_Op(deadline=0.0), 99.0, _Missing({1, 2}), silent={2, 3})
    assert quiet is not None and quiet.everywhere and isinstance(quiet.error, BrokenError)
    assert isinstance(quiet.error.__cause__, TimeoutError)  # the peer timeout, as its cause
    assert "rank 2 sent nothing for 5 s" in str(quiet.error)
    assert _judge(_Op(deadline=0.0), 99.0, _Missing({1}), silent={2, 3}) is None  # 2 published


def test_nothing_reads_the_slots_while_no_rule_could_need_them() -> None:
    missing = _Missing({1})
    assert _judge(_Op(), 9.9, missing) is None and missing.asked == 0


@given(
    broken=st.booleans(), left=st.sets(st.integers(1, 4)), silent=st.sets(st.integers(1, 4)),
    waiting=st.sets(st.integers(1, 4)), deadline=st.sampled_from([0.0, 5.0, 20.0]),
)  # fmt: skip
def test_the_rules_apply_in_their_order(
    broken: bool, left: set[int], silent: set[int], waiting: set[int], deadline: float
) -> None:
    missing = _Missing(waiting)
    verdict = _judge(_Op(deadline=deadline), 10.0, missing,
                     broken=BrokenError("x") if broken else None,
                     departed={p: f"rank {p} left" for p in left}, silent=silent)  # fmt: skip
    late = bool(deadline) and deadline <= 10.0
    if broken:
        expected: tuple[type, bool] | None = (BrokenError, False)
    elif left & waiting:
        expected = (BrokenError, False)
    elif late:
        expected = (TimeoutError, True)
    elif silent & waiting:
        expected = (BrokenError, True)
    else:
        expected = None
    got = None if verdict is None else (type(verdict.error), verdict.everywhere)
    assert got == expected
    assert missing.asked <= 1


# ---- the Session watches an outside executor (Session.watch_outside), on the fake wire ------


@dataclass(eq=False)
class _Held:
    """A pending operation of a fake outside executor (what the lane's LaneOp carries)."""

    key: tuple[bytes, int]
    label: str
    desc: Descriptor
    timeout: float | None = None
    started: float = 0.0
    deadline: float = 0.0
    record: Record | None = None


class _Executor:
    """An outside executor as the Session sees it (protocol/outside.py's ``Outside``): its
    pending operations, each missing ``missing``, and the errors they ended with."""

    def __init__(self, held: list[_Held], missing: set[int]) -> None:
        self.pending = {op.key: op for op in held}
        self.missing = missing
        self.ended: dict[tuple[bytes, int], BaseException] = {}

    def holds(self, key: tuple[bytes, int]) -> bool:
        return key in self.pending

    def judge_each(self, decide: Decide) -> None:
        for op in list(self.pending.values()):
            error = decide(op, lambda: set(self.missing))
            if error is not None:
                self.ended[op.key] = error
                del self.pending[op.key]


_DESC = Descriptor(KINDS["allreduce"], DTYPES["float32"].code, REDUCTION_CODES["sum"], 0, 4)


def _held(label: str = "allreduce 'x'#0", **fields: float) -> _Held:
    return _Held((b"x", 0), label, _DESC, **fields)  # type: ignore[arg-type]


@given(n=st.integers(3, 9), seed=st.integers(0, 2**16), data=st.data())
def test_a_stalled_outside_operation_is_asked_about_and_peers_answer_for_their_own(
    n: int, seed: int, data: st.DataObject
) -> None:
    """Rank 0's executor holds 'x' past the stall warning: rank 0 asks every peer; a peer whose
    executor holds it answers "pending", one that never had it "never posted"."""
    holding = set(data.draw(st.lists(st.integers(1, n - 1), unique=True)))
    wire = Wire(n, seed, Settings(stall_warning=10.0, peer_timeout=1e6, spin=0.0))
    for rank in range(n):
        if rank == 0 or rank in holding:
            wire.ranks[rank].session.outside = _Executor([_held()], set())
    wire.ranks[0].now = 11.0
    session = wire.ranks[0].session
    session.watch_outside(11.0, 1000.0)
    wire.apply(0)
    wire.run()
    reports = list(session.stall.reports)
    assert len(reports) == 1, reports
    absent = sorted(set(range(1, n)) - holding)
    if absent:
        assert f"never posted by {ar.errors.ranks_phrase(absent)}" in reports[0], reports[0]
    if holding:
        assert f"pending on {ar.errors.ranks_phrase(sorted(holding))}" in reports[0], reports[0]
    record = session.outside.pending[(b"x", 0)].record  # type: ignore[union-attr]
    assert record is not None and record.posted_at == 989.0  # the wall clock when it started


def test_an_outside_operation_past_its_deadline_fails_here_and_breaks_every_peer() -> None:
    wire = Wire(3, 5, Settings(peer_timeout=1e6, spin=0.0))
    executor = _Executor([_held(timeout=2.0, deadline=2.0)], {2})
    wire.ranks[0].session.outside = executor
    wire.ranks[0].session.watch_outside(1.0, 100.0)
    assert not executor.ended  # not yet
    wire.ranks[0].session.watch_outside(2.5, 101.5)
    wire.apply(0)
    wire.run()
    error = executor.ended[(b"x", 0)]
    assert isinstance(error, TimeoutError) and "rank 2" in str(error), error
    for state in wire.ranks[1:]:  # told through the session, as for any failure
        assert isinstance(state.session.broken, TimeoutError), state.session.broken
    later = wire.post(1, "allreduce", "y", np.ones(4, np.float32))
    assert isinstance(later.exception(), BrokenError)
