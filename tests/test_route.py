"""Which way an operation goes (protocol/route.py): every combination of the facts, against
the rules as the README states them, and the one threshold of "small"."""

from __future__ import annotations

import itertools

import pytest

from asyncreduce.algorithms import SMALL_ALLREDUCE_BYTES
from asyncreduce.protocol.route import Reach, Way, route, small

KINDS = ("allreduce", "barrier", "broadcast", "allgather", "reduce_scatter", "alltoall")
SIZES = (0, 1024, SMALL_ALLREDUCE_BYTES, SMALL_ALLREDUCE_BYTES + 1, 1 << 24)


def expected(kind: str, nbytes: int, named: bool, reach: Reach, waiting: bool, whole: bool) -> Way:
    """The rules, written out one by one."""
    shortcut = kind == "barrier" or (kind == "allreduce" and nbytes <= 64 << 10)
    if not shortcut:
        return Way.ENGINE  # only small allreduces and barriers take a shorter way
    lane_takes = reach is Reach.NAMED or (reach is Reach.UNNAMED and not named)
    if lane_takes:
        return Way.LANE  # the lane first: shared memory, no socket
    if waiting and whole:
        return Way.DIRECT  # a caller that waits runs it itself, on the world's numbering
    return Way.ENGINE


@pytest.mark.parametrize("kind", KINDS)
def test_every_combination_of_facts_goes_the_way_the_rules_say(kind: str) -> None:
    for nbytes, named, reach, waiting, whole in itertools.product(
        SIZES, (False, True), tuple(Reach), (False, True), (False, True)
    ):
        facts = (kind, nbytes, named, reach, waiting, whole)
        assert route(*facts) is expected(*facts), facts


def test_small_is_up_to_64_kib_inclusive() -> None:
    assert SMALL_ALLREDUCE_BYTES == 64 << 10
    assert small(0) and small(64 << 10)
    assert not small((64 << 10) + 1)


def test_a_large_allreduce_never_leaves_the_engine_and_a_barrier_of_any_size_may() -> None:
    assert route("allreduce", (64 << 10) + 1, False, Reach.NAMED, True, True) is Way.ENGINE
    assert route("barrier", 1 << 30, True, Reach.NAMED, False, False) is Way.LANE


def test_a_named_operation_takes_the_lane_only_where_it_has_named_slots() -> None:
    assert route("allreduce", 4096, True, Reach.UNNAMED, True, True) is Way.DIRECT
    assert route("allreduce", 4096, True, Reach.UNNAMED, False, True) is Way.ENGINE
    assert route("allreduce", 4096, True, Reach.NAMED, False, True) is Way.LANE


def test_a_group_never_runs_directly() -> None:
    assert route("allreduce", 4096, False, Reach.NONE, True, False) is Way.ENGINE
    assert route("barrier", 0, False, Reach.NONE, True, True) is Way.DIRECT
