"""The failure rules of an operation outside the engine (protocol/outside.py), sans-IO: every
combination of a broken communicator, a departed peer, a deadline and a silent peer, in one
process, against the rules as the module states them (the lane's processes test the same rules
end to end in test_lane.py)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from asyncreduce.errors import BrokenError, MismatchError
from asyncreduce.protocol.outside import Verdict, judge


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
