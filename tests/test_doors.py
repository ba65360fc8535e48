"""Doors (bootstrap/doors.py): how a restarted rank finds a running elastic job. Real stores
over real sockets in one process: a knock on a live door is answered with the admission a
member writes there; a knock on dead doors moves on and times out; malformed settings and
admissions are refused with what was wrong."""

from __future__ import annotations

import threading
import time

import pytest

from asyncreduce.bootstrap.doors import Admission, Door, doors_from_env, knock, restart_count
from asyncreduce.errors import UsageError
from asyncreduce.launch import free_port


def test_doors_and_restarts_are_read_from_the_environment() -> None:
    env = {"ASYNCREDUCE_DOORS": "10.0.0.1:29700, host-b:29701", "ASYNCREDUCE_RESTART": "2"}
    assert doors_from_env(env) == [("10.0.0.1", 29700), ("host-b", 29701)]
    assert restart_count(env) == 2 and restart_count({}) == 0 and doors_from_env({}) is None
    for bad in ("10.0.0.1", "h:0", "h:port", ":29700", "h:70000"):
        with pytest.raises(UsageError, match="is not host:port"):
            doors_from_env({"ASYNCREDUCE_DOORS": f"a:1,{bad}"})
    with pytest.raises(UsageError, match="not a count of restarts"):
        restart_count({"ASYNCREDUCE_RESTART": "-1"})


def test_an_admission_survives_its_bytes_and_a_bad_one_is_refused() -> None:
    admission = Admission(("10.0.0.1", 29700), "asyncreduce/grow/7/5/", 3, 4, (0, 1, 3, 2))
    assert Admission.from_bytes(admission.to_bytes()) == admission
    good = b'{"host": "h", "port": 1, "namespace": "n", "rank": 0, "slots": [0]}'
    assert Admission.from_bytes(good).slots == (0,)
    for bad in (
        b'{"host": "h", "port": 1, "namespace": "n", "rank": 1, "slots": [0]}',  # rank outside
        b'{"host": "h", "port": true, "namespace": "n", "rank": 0, "slots": [0]}',  # bool port
        b'{"host": "h", "port": 1, "namespace": "n", "rank": 0, "slots": [0, 0]}',  # twice
        b'{"host": "h", "port": 1, "namespace": "n", "rank": 0, "slots": [0], "x": 1}',
        b'{"host": "h", "port": 1, "namespace": 5, "rank": 0, "slots": [0]}',
        b"[1, 2]",
    ):
        with pytest.raises(ValueError):
            Admission.from_bytes(bad)


def test_a_knock_is_heard_at_a_live_door_and_answered_with_its_admission() -> None:
    """Slot 1 knocks: door 0 is dead (nothing listens), door 2 is a member's. The member
    looks at its door until the knock is there and admits that nonce; the knock returns it,
    and the door forgets the knock once answered."""
    dead, live = ("127.0.0.1", free_port()), ("127.0.0.1", free_port())
    door = Door(live)
    admission = Admission(live, "asyncreduce/grow/1/x/", 2, 3, (0, 2, 1))
    got: list[Admission] = []

    def knock_now() -> None:
        got.append(knock([dead, ("127.0.0.1", 1), live], 1, time.monotonic() + 30, patience=5))

    thread = threading.Thread(target=knock_now)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not (heard := door.knocks([1, 2])) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert list(heard) == [1], heard
        door.admit(1, heard[1], admission)
        thread.join(30)
        assert got == [admission]
        door.forget(1, heard[1])
        assert door.knocks([1]) == {}
    finally:
        thread.join(1)
        door.close()


def test_a_knock_that_nobody_answers_times_out_naming_the_doors() -> None:
    doors = [("127.0.0.1", free_port()) for _ in range(3)]
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="no member let this process in"):
        knock(doors, 0, time.monotonic() + 3, patience=1)
    assert time.monotonic() - began < 10
    with pytest.raises(UsageError, match="no place among the 3 doors"):
        knock(doors, 3, time.monotonic() + 1)


def test_a_spare_waits_to_be_told_the_rank_it_restarts() -> None:
    """A spare (ASYNCREDUCE_SPARE=1) blocks in ar.init()'s first step until its launcher writes
    '<rank> <restart>' on its stdin, then carries on as that rank's restart; an end of input
    ends it quietly, and anything else is refused."""
    import os
    import subprocess
    import sys

    code = ("import os; from asyncreduce.bootstrap.doors import stand_in; stand_in(); "
            "print(os.environ['RANK'], os.environ['ASYNCREDUCE_RESTART'], "
            "'ASYNCREDUCE_SPARE' in os.environ)")  # fmt: skip
    env = {**os.environ, "ASYNCREDUCE_SPARE": "1"}
    env.pop("RANK", None)

    def spare(told: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code], input=told, env=env, text=True,
                              capture_output=True, timeout=60, check=False)  # fmt: skip

    called = spare("2 3\n")
    assert called.returncode == 0 and called.stdout.split() == ["2", "3", "False"], called
    ended = spare("")
    assert ended.returncode == 0 and ended.stdout == "", ended
    bad = spare("two\n")
    assert bad.returncode == 1 and "not '<rank> <restart>'" in bad.stderr, bad.stderr[-500:]
