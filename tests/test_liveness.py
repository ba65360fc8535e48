"""The one Liveness of both engines (protocol/liveness.py), sans-IO: times are passed in, no
clock, no socket. Beats, silence, departed peers, deadlines and their pruning, how long the
engine may block, and the ``away`` beat; then the one wording of a silent peer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from asyncreduce.backends.ordered.posted import Posted
from asyncreduce.errors import BrokenError
from asyncreduce.protocol.failure import silent_for, unheard
from asyncreduce.protocol.liveness import Liveness
from asyncreduce.request import CallbackRunner, Request


@dataclass(eq=False)
class Op:
    """The least an operation needs to be watched: a deadline (and here, whether it ended)."""

    deadline: float
    ended: bool = False


@dataclass
class Labelled:
    """What a failure's wording needs of an operation."""

    label: str


def liveness(world_size: int = 2, peer_timeout: float = 2.0) -> Liveness[Op]:
    """Rank 0's liveness, made at time 0 (a 2 s timeout beats every 0.05 s)."""
    return Liveness(0, world_size, peer_timeout, now=0.0)


# ---- beats -------------------------------------------------------------------------------------


def test_a_beat_is_a_fortieth_of_the_timeout_between_20_ms_and_1_s() -> None:
    assert liveness(peer_timeout=2.0).beat_every == 0.05
    assert liveness(peer_timeout=0.4).beat_every == 0.02
    assert liveness(peer_timeout=100.0).beat_every == 1.0


def test_a_beat_is_due_once_a_beat_passed_since_the_last() -> None:
    live = liveness()
    assert not live.beat_due(0.04)
    assert live.beat_due(0.05)
    assert live.last_beat == 0.05  # it counts as given
    assert not live.beat_due(0.09)  # a beat from 0.05, not from 0
    assert live.beat_due(0.1)


def test_away_marks_a_beat_later_than_three_beats_and_never_two_in_a_row() -> None:
    live = liveness()
    assert live.beat_due(0.05) and not live.away
    assert live.beat_due(0.2) and not live.away  # three beats late: still on time
    assert live.beat_due(1.0) and live.away  # this rank's thread was away 0.8 s
    assert live.beat_due(1.05) and not live.away  # back on time
    assert live.beat_due(5.0) and live.away
    assert live.beat_due(9.0) and not live.away  # late again, but never two in a row
    assert live.beat_due(13.0) and live.away


def test_start_counts_every_peer_as_heard_from_then() -> None:
    live = liveness(world_size=3)
    heard = live.heard
    live.start(50.0)
    assert live.heard is heard and heard == {1: 50.0, 2: 50.0}
    assert not live.beat_due(50.04) and live.beat_due(50.06)
    assert live.silent(52.0) == set()


# ---- silence and departure ---------------------------------------------------------------------


def test_a_peer_is_silent_only_after_the_timeout_and_one_beat() -> None:
    live = liveness(world_size=3)
    assert live.silent(2.0) == set()
    assert live.silent(2.05) == set()  # the timeout and one beat, not more
    assert live.silent(2.06) == {1, 2}
    live.heard[2] = 1.0
    assert live.silent(2.06) == {1}
    assert live.silent(3.06) == {1, 2}


def test_a_departed_peer_is_never_silent_and_never_told() -> None:
    live = liveness(world_size=3)
    live.departed[1] = "rank 1 closed the communicator"
    assert live.silent(1000.0) == {2}
    assert live.open_peers() == [2]


# ---- deadlines ---------------------------------------------------------------------------------


def test_deadlines_expire_soonest_first_and_once() -> None:
    live = liveness()
    late, first, second, tied = Op(3.0), Op(1.0), Op(2.0), Op(1.0)
    for op in (late, first, second, tied):
        live.add_deadline(op)
    assert live.expired(0.5) == []
    assert live.expired(2.0) == [first, tied, second]  # a tie: in the order added
    assert live.expired(2.5) == []
    assert live.expired(3.0) == [late]


def test_pruning_forgets_ended_operations_once_they_outnumber_the_live() -> None:
    live = liveness()
    ops = [Op(10.0 + k, ended=k >= 10) for k in range(100)]  # 10 live, 90 ended
    for op in ops:
        live.add_deadline(op)
    live.prune(10, lambda op: not op.ended)
    assert live.expired(math.inf) == ops[:10]


def test_pruning_waits_for_more_than_64_deadlines() -> None:
    live = liveness()
    ops = [Op(10.0 + k, ended=True) for k in range(64)]
    for op in ops:
        live.add_deadline(op)
    live.prune(0, lambda op: not op.ended)
    assert live.expired(math.inf) == ops  # few: kept, and dropped as they expire


def test_pruning_keeps_all_while_the_live_are_half_or_more() -> None:
    live = liveness()
    ops = [Op(10.0 + k, ended=k % 2 == 1) for k in range(100)]
    for op in ops:
        live.add_deadline(op)
    live.prune(50, lambda op: not op.ended)
    assert live.expired(math.inf) == ops


# ---- how long the engine may block -------------------------------------------------------------


def test_the_engine_may_block_until_the_next_beat_or_deadline() -> None:
    live = liveness()
    assert live.timeout(0.0) == 0.05  # no deadline: the next beat
    assert math.isclose(live.timeout(0.03), 0.02)
    live.add_deadline(Op(0.01))
    assert live.timeout(0.0) == 0.01  # the deadline comes first
    assert live.timeout(0.02) == 0.0  # past due: not at all


def test_a_far_deadline_still_wakes_the_engine_for_the_next_beat() -> None:
    live = liveness(peer_timeout=100.0)  # a beat every second
    live.add_deadline(Op(60.0))
    assert live.timeout(0.25) == 0.75


# ---- both engines' operation records fit -------------------------------------------------------


def test_an_ordered_operation_has_its_deadline_only_with_a_timeout() -> None:
    def posted(timeout: float | None) -> Posted:
        request: Request[None] = Request("x", CallbackRunner("asyncreduce-test-callbacks"))
        flat = np.zeros(1, np.float32)
        return Posted((b"x", 0), "'x'", None, request, lambda: None, timeout,  # type: ignore[arg-type]
                      "allreduce", flat, None, "sum", 0)  # fmt: skip

    forever, soon = posted(None), posted(2.0)
    assert forever.deadline == math.inf
    assert soon.deadline == soon.started + 2.0
    live: Liveness[Posted] = Liveness(0, 2, 2.0, now=soon.started)
    live.add_deadline(soon)
    assert live.expired(soon.started + 1.9) == []
    assert live.expired(soon.started + 2.0) == [soon]


# ---- the one wording of a silent peer ----------------------------------------------------------


def test_a_silent_peer_is_worded_once_with_the_peer_timeout_as_the_cause() -> None:
    assert unheard({2, 1}, 2.0) == (
        "ranks 1, 2 sent nothing for 2 s, not even a heartbeat (stopped, or cut off?)"
    )
    error = silent_for(Labelled("allreduce 'w'#0"), 0, {1}, 2.5)
    assert isinstance(error, BrokenError)
    assert str(error) == (
        "allreduce 'w'#0 failed on rank 0: rank 1 sent nothing for 2.5 s, not even a heartbeat "
        "(stopped, or cut off?)"
    )
    assert isinstance(error.__cause__, TimeoutError)
    assert "ASYNCREDUCE_PEER_TIMEOUT" in str(error.__cause__)
