"""Which way an operation goes (protocol/route.py): every combination of the facts, against
the rules as the README states them, and the one threshold of "small"."""

from __future__ import annotations

import itertools

import pytest

from asyncreduce.algorithms import SMALL_ALLREDUCE_BYTES
from asyncreduce.protocol.route import (
    DIRECT,
    ENGINE,
    LANE,
    NAMED,
    NO_LANE,
    UNNAMED,
    route,
    small,
)

KINDS = ("allreduce", "barrier", "broadcast", "allgather", "reduce_scatter", "alltoall")
SIZES = (0, 1024, SMALL_ALLREDUCE_BYTES, SMALL_ALLREDUCE_BYTES + 1, 1 << 24)


def expected(kind: str, nbytes: int, named: bool, reach: int, waiting: bool, whole: bool) -> int:
    """The rules, written out one by one."""
    shortcut = kind == "barrier" or (kind == "allreduce" and nbytes <= 64 << 10)
    if not shortcut:
        return ENGINE  # only small allreduces and barriers take a shorter way
    lane_takes = reach == NAMED or (reach == UNNAMED and not named)
    if lane_takes:
        return LANE  # the lane first: shared memory, no socket
    if waiting and whole:
        return DIRECT  # a caller that waits runs it itself, on the world's numbering
    return ENGINE


@pytest.mark.parametrize("kind", KINDS)
def test_every_combination_of_facts_goes_the_way_the_rules_say(kind: str) -> None:
    for nbytes, named, reach, waiting, whole in itertools.product(
        SIZES, (False, True), (NO_LANE, UNNAMED, NAMED), (False, True), (False, True)
    ):
        facts = (kind, nbytes, named, reach, waiting, whole)
        assert route(*facts) == expected(*facts), facts


def test_small_is_up_to_64_kib_inclusive() -> None:
    assert SMALL_ALLREDUCE_BYTES == 64 << 10
    assert small(0) and small(64 << 10)
    assert not small((64 << 10) + 1)


def test_a_large_allreduce_never_leaves_the_engine_and_a_barrier_of_any_size_may() -> None:
    assert route("allreduce", (64 << 10) + 1, False, NAMED, True, True) == ENGINE
    assert route("barrier", 1 << 30, True, NAMED, False, False) == LANE


def test_a_named_operation_takes_the_lane_only_where_it_has_named_slots() -> None:
    assert route("allreduce", 4096, True, UNNAMED, True, True) == DIRECT
    assert route("allreduce", 4096, True, UNNAMED, False, True) == ENGINE
    assert route("allreduce", 4096, True, NAMED, False, True) == LANE


def test_a_group_never_runs_directly() -> None:
    assert route("allreduce", 4096, False, NO_LANE, True, False) == ENGINE
    assert route("barrier", 0, False, NO_LANE, True, True) == DIRECT
