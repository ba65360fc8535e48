"""The small-operation path: what changes when an allreduce is latency-bound.

An operation of at most ``SMALL_ALLREDUCE_BYTES`` is *small*: its events make the progress
thread busy-poll for ``settings.spin`` instead of sleeping in the kernel (engine.py ``_poll``),
and completing it hands the core to its waiter at once, or its waiter runs the engine's loop
itself (progress in the call, ``Engine.drive``). The fallback is the sleeping path,
``ASYNCREDUCE_SPIN_US=0``, where the progress thread alone moves everything. A blocking one
runs on its caller's thread when the engine is quiet (``Engine.run_direct``), its frames straight
through the sockets; ``ASYNCREDUCE_DIRECT=0`` leaves that to the waiter that drives the loop.
The path tests run all three, on real processes over real sockets: small operations from
several threads beside large ones from another (over TCP, in the same queues), every value
checked; a peer killed while the others spin; and what the spin leaves behind once it is
over (no core kept busy). The direct run is tested for exact, bitwise-equal results at 2-4
ranks (a power of two or not), beside a rank that never runs one, with a rank that
disagrees, for long enough that beats must flow, and from threads posting in different
orders.
Waiters that drive the loop are tested on their own too: they complete their operations, a
bug in their turn breaks every rank, a close while they drive fails them. The sans-IO side
(which events start a spin) is tested in one process.
"""

from __future__ import annotations

import functools
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import asyncreduce as ar
from asyncreduce import engine as engine_module
from asyncreduce.algorithms import SMALL_ALLREDUCE_BYTES
from asyncreduce.engine import Engine
from asyncreduce.flight import culprit, load_dumps
from asyncreduce.protocol import Settings
from spmd import in_threads, run_ranks
from wire import Wire

TCP = {"ASYNCREDUCE_SHM": "0", "ASYNCREDUCE_CMA": "0"}  # bulk and small frames share a queue
PATHS = {
    "direct": TCP,  # a blocking one runs on its caller's thread where the engine is quiet
    "direct-python": {**TCP, "ASYNCREDUCE_NATIVE": "0"},  # the same, its look in Python
    "drive": {**TCP, "ASYNCREDUCE_DIRECT": "0"},  # its waiter drives the engine's loop
    "fallback": {**TCP, "ASYNCREDUCE_SPIN_US": "0"},  # the progress thread alone, sleeping
}
BULK_FLOATS = 4 << 20  # 16 MiB: a ring allreduce over TCP, well above the small limit
THREADS, PER_THREAD = 4, 40
BULK_OPS = 16


def _engine(comm: ar.Communicator) -> Engine:
    engine = comm._backend.engine
    assert isinstance(engine, Engine)
    return engine


def _spin_of(comm: ar.Communicator) -> float:
    return float(_engine(comm).settings.spin)


def _small_size(j: int) -> int:
    """1 to 16384 float32 (4 B to 64 KiB): every small size class, the largest at the limit."""
    return 1 << (j % 15)


def body_small_beside_large(comm: ar.Communicator) -> dict[str, Any]:
    """Four threads run blocking small allreduces (their own names, so the ranks' global
    orders differ with the threads' timing) while a fifth runs 16 MiB ones, all over TCP, the
    small frames in the same connections' queues as the bulk; every value is checked; returns
    how long each small one took, when each bulk one ended, and the spin setting in force."""
    r, n = comm.rank, comm.world_size
    bulk_done: list[float] = []
    small_took: list[float] = []

    def bulk() -> None:
        for i in range(BULK_OPS):
            x = np.full(BULK_FLOATS, float(r + i), np.float32)
            comm.allreduce(x, name="bulk")
            assert np.all(x == sum(q + i for q in range(n))), f"bulk {i}: {x[:4]}"
            bulk_done.append(time.perf_counter())

    def small(t: int) -> None:
        for j in range(PER_THREAD):
            x = np.full(_small_size(j), float(r * 1000 + t * 100 + j), np.float32)
            assert x.nbytes <= SMALL_ALLREDUCE_BYTES
            began = time.perf_counter()
            comm.allreduce(x, name=f"t{t}")
            small_took.append(time.perf_counter() - began)
            expect = sum(q * 1000 + t * 100 + j for q in range(n))
            assert np.all(x == expect), f"thread {t} op {j}: {x[:4]} != {expect}"

    comm.barrier()
    start = time.perf_counter()
    in_threads(bulk, *(functools.partial(small, t) for t in range(THREADS)))
    return {
        "spin": _spin_of(comm),
        "driven": _engine(comm).driven,
        "direct": _engine(comm).direct,
        "small": sorted(small_took),
        "bulk": sorted(t - start for t in bulk_done),
    }


@pytest.mark.parametrize("path", sorted(PATHS))
def test_small_operations_from_threads_complete_beside_large_ones(path: str) -> None:
    results = run_ranks(3, body_small_beside_large, env=PATHS[path], timeout=120)
    for rank, got in results.items():
        assert (got["spin"] > 0) == (path != "fallback"), f"rank {rank}: spin {got['spin']}"
        # where it spins, waiters drive the loop (some, not all: one drives at a time, and the
        # progress thread finishes what completes while it holds the loop); else none does.
        # (With the bulk in flight the engine is never quiet: no small one runs direct.)
        assert (got["driven"] > 0) == (path != "fallback"), f"rank {rank}: {got['driven']}"
        if not path.startswith("direct"):  # (turned off: none runs directly)
            assert got["direct"] == 0, f"rank {rank}: {got['direct']} direct"
        assert len(got["small"]) == THREADS * PER_THREAD and len(got["bulk"]) == BULK_OPS
        # small operations cut in: queued behind the bulk, each would take a bulk operation
        median_small = got["small"][len(got["small"]) // 2]
        one_bulk = got["bulk"][-1] / BULK_OPS
        assert median_small < one_bulk / 2, f"rank {rank}: {median_small} vs {one_bulk}"


def body_peer_dies_mid_spin(comm: ar.Communicator) -> dict[str, Any]:
    """Every rank runs 4 KiB allreduces back to back (the spinning state); rank 2 SIGKILLs
    itself 0.3 s in. The survivors return how many completed, how long the failure took to
    reach them, its message, and the CPU their process used in the 0.5 s after it."""
    x = np.ones(1024, np.float32)
    comm.barrier()
    if comm.rank == 2:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    completed = 0
    start = time.monotonic()
    killed_at = start + 0.3
    try:
        while True:
            comm.allreduce(x)
            completed += 1
    except ar.BrokenError as exc:
        message = str(exc)
    noticed = time.monotonic() - killed_at
    cpu = time.process_time()
    time.sleep(0.5)
    cpu = time.process_time() - cpu
    with pytest.raises(ar.BrokenError):
        comm.allreduce(x)  # broken for good, at once
    return {"spin": _spin_of(comm), "completed": completed, "noticed": noticed,
            "message": message, "idle_cpu": cpu, "direct": _engine(comm).direct}  # fmt: skip


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_peer_dying_mid_spin_breaks_every_survivor_and_stops_the_spin(path: str) -> None:
    results = run_ranks(3, body_peer_dies_mid_spin, env=PATHS[path], expect_dead=frozenset({2}),
                        timeout=90)  # fmt: skip
    assert set(results) == {0, 1}
    for rank, got in results.items():
        assert (got["spin"] > 0) == (path != "fallback")
        assert (got["direct"] > 0) == path.startswith("direct"), f"rank {rank}: {got['direct']}"
        assert got["completed"] >= 10, f"rank {rank}: died before the run began ({got})"
        assert "rank 2" in got["message"], got["message"]
        assert got["noticed"] < 10, f"rank {rank}: the loss took {got['noticed']:.1f} s"
        # nothing left spinning: a busy-polling thread would use ~0.5 s of CPU here
        assert got["idle_cpu"] < 0.2, f"rank {rank}: {got['idle_cpu']:.2f} s CPU while idle"


# ---- progress in the call: a waiter that runs the engine's loop ---------------------------


def body_waiters_drive(comm: ar.Communicator) -> dict[str, Any]:
    """Small allreduces posted and waited for back to back, over TCP, one thread: returns how
    many of them the waiter completed driving the loop, and whether every value was right. (A
    waiter drives for 50 ms past the last event here, not 2: a rank that lost its core for a
    scheduler slice must not make the count flaky.)"""
    engine_module._DRIVE_SPIN = 0.05
    exact = True
    for i in range(200):
        x = np.full(256, float(comm.rank + i), np.float32)
        comm.iallreduce(x).wait()
        exact &= bool(np.all(x == sum(r + i for r in range(comm.world_size))))
    return {"driven": _engine(comm).driven, "exact": exact}


def test_a_waiter_drives_the_loop_and_completes_its_own_operation() -> None:
    results = run_ranks(2, body_waiters_drive, env=TCP, timeout=60)
    for rank, got in results.items():
        assert got["exact"], f"rank {rank}: wrong values"
        # nearly every one: the progress thread stands aside for a waiter that asks, within
        # a turn of its loop (a few finish on it before the waiter got there)
        assert got["driven"] >= 100, f"rank {rank}: only {got['driven']} of 200 driven"


def body_overflow_on_a_waiter_that_raises(comm: ar.Communicator) -> dict[str, Any]:
    """The caller asks numpy to raise on overflow; its small allreduces overflow float32, and
    they are reduced on its thread: waited for (it drives the loop), then blocking (it runs
    them directly; a waiter that drives reads the peer's next frame early, so the first of
    these may not). Returns whether each ended at inf."""
    engine_module._DRIVE_SPIN = 0.05
    old = np.seterr(all="raise")
    try:
        ends = []
        for i in range(40):
            x = np.full(16, 3e38, np.float32)
            comm.allreduce(x) if i >= 20 else comm.iallreduce(x).wait()
            ends.append(bool(np.all(np.isinf(x))))
    finally:
        np.seterr(**old)
    return {"ends": ends, "driven": _engine(comm).driven, "direct": _engine(comm).direct}


def test_overflow_on_a_driving_waiter_is_the_data_not_a_crash() -> None:
    for rank, got in run_ranks(2, body_overflow_on_a_waiter_that_raises, env=TCP).items():
        assert got["ends"] == [True] * 40, f"rank {rank}: {got['ends']}"
        assert got["driven"] > 0, f"rank {rank}: no waiter drove the loop"
        assert got["direct"] > 0, f"rank {rank}: no allreduce ran directly"


def body_driver_bug(comm: ar.Communicator, how: str) -> dict[str, Any]:
    """On rank 1, a frame that a waiter's turn takes in raises (a bug in the loop, on the
    waiter's thread: ``how`` "wait", as it drives the loop; "direct", as it runs a blocking
    allreduce itself); every rank returns the error it ended with. (Rank 1 breaks once it is
    through the barrier: a slower rank may hear of it while still in the barrier.)"""
    engine = _engine(comm)
    began = time.monotonic()
    try:
        comm.barrier()
        if comm.rank == 1:
            _plant_a_bug(engine, how)
        for _ in range(1000):
            x = np.ones(16, np.float32)
            comm.allreduce(x) if how == "direct" else comm.iallreduce(x).wait()
    except ar.BrokenError as exc:
        return {"error": str(exc), "took": time.monotonic() - began, "driven": engine.driven}
    return {"error": None, "took": time.monotonic() - began, "driven": engine.driven}


def _plant_a_bug(engine: Engine, how: str) -> None:
    """What the waiting thread calls raises on it: the transport's ``take_frame`` for a
    direct run, else the session's ``on_frame`` and ``on_view`` (a small frame comes as a
    view, an early or control one whole)."""

    def buggy(real: Any) -> Any:
        def on_waiters_thread(*args: Any) -> Any:
            if threading.current_thread() is threading.main_thread():
                raise RuntimeError("a bug in the loop, on the waiter's thread")
            return real(*args)

        return on_waiters_thread

    if how == "direct":
        engine.transport.take_frame = buggy(engine.transport.take_frame)  # type: ignore[method-assign]
    else:
        engine.session.on_frame = buggy(engine.session.on_frame)  # type: ignore[method-assign]
        engine.session.on_view = buggy(engine.session.on_view)  # type: ignore[method-assign]


@pytest.mark.parametrize("how", ["wait", "direct"])
def test_a_bug_in_a_waiters_turn_breaks_the_communicator_on_every_rank(how: str) -> None:
    results = run_ranks(3, body_driver_bug, how, env=TCP, timeout=90)
    error = results[1]["error"]
    assert error is not None and "a bug in the loop" in error, error
    # waiting, the bug is raised on the progress thread; running directly, it fails the
    # operation on the caller's thread at once, and the progress thread breaks the rest
    assert ("progress thread crashed" if how == "wait" else "rank 1:") in error, error
    for rank, got in results.items():
        assert got["error"] is not None, f"rank {rank} ran 1000 allreduces past the bug"
        assert got["took"] < 30, f"rank {rank} took {got['took']:.1f} s to hear of it"


def body_close_while_driving(comm: ar.Communicator) -> dict[str, Any]:
    """Rank 0's threads wait on small allreduces rank 1 never posts, each driving the loop (or
    asking for it) for up to 30 s; once all three do, the main thread closes. Returns what
    each waiter ended with, and how long the close took."""
    if comm.rank == 1:
        comm.barrier()
        time.sleep(1.0)
        return {}
    comm.barrier()
    engine_module._DRIVE_SPIN = 30.0  # a driver that missed the close would hold it this long
    engine = _engine(comm)
    ended: list[str] = []

    def wait_one(t: int) -> None:
        try:
            comm.allreduce(np.ones(64, np.float32), name=f"never{t}")
            ended.append("completed")
        except ar.ClosedError:
            ended.append("closed")

    waiters = [threading.Thread(target=wait_one, args=(t,)) for t in range(3)]
    for w in waiters:
        w.start()
    while len(engine._loop.drivers) < 3:
        time.sleep(0.001)
    began = time.monotonic()
    comm.close()
    took = time.monotonic() - began
    for w in waiters:
        w.join(10)
    return {"ended": sorted(ended), "took": took, "alive": sum(w.is_alive() for w in waiters)}


def test_a_close_while_waiters_drive_fails_them_and_returns() -> None:
    got = run_ranks(2, body_close_while_driving, env=TCP, timeout=60)[0]
    assert got["alive"] == 0, got
    assert got["ended"] == ["closed"] * 3, got
    assert got["took"] < 5, got


# ---- a blocking small allreduce run on its caller's thread: Engine.run_direct -------------------


CASES = [(np.float32, "sum"), (np.int64, "max"), (np.float64, "avg"), (np.int32, "prod")]


def body_direct(comm: ar.Communicator) -> dict[str, Any]:
    """Blocking small allreduces back to back over TCP, every size class, four dtype and
    reduction pairs, unnamed and named; returns whether every value was exact, a digest of
    every result (the ranks must agree bitwise), and how many ran directly."""
    exact, digest = True, hashlib.sha256()
    for i in range(240):
        dtype, op = CASES[i % len(CASES)]
        count = _small_size(i)
        x = (np.arange(count) % 7 + comm.rank + i % 3).astype(dtype)
        parts = [(np.arange(count) % 7 + r + i % 3).astype(dtype) for r in range(comm.world_size)]
        want = {"sum": sum, "max": lambda p: np.max(p, axis=0), "prod": lambda p: np.prod(p, 0),
                "avg": lambda p: sum(p) / len(p)}[op](parts)  # fmt: skip
        comm.allreduce(x, op=op, name=None if i % 2 else "named")
        exact &= bool(np.allclose(x, want, rtol=1e-12 if dtype == np.float64 else 1e-6))
        digest.update(x.tobytes())
    return {"exact": exact, "digest": digest.hexdigest(), "direct": _engine(comm).direct}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_blocking_small_allreduces_run_on_the_callers_thread_and_agree_bitwise(n: int) -> None:
    results = run_ranks(n, body_direct, env=TCP, timeout=120)
    assert len({got["digest"] for got in results.values()}) == 1, "the ranks differ"
    for rank, got in results.items():
        assert got["exact"], f"rank {rank}: wrong values"
        # most run directly (a beat due, a look at every connection due, a partner that lost
        # its core for 2 ms, or a peer's frame read early by a turn of the loop, hands some to
        # the engine, which completes them as any other)
        assert got["direct"] >= 60, f"rank {rank}: only {got['direct']} of 240 ran directly"


def test_a_rank_that_never_runs_them_directly_agrees_with_those_that_do() -> None:
    """The frames of a direct run are the engine's own: a rank with ASYNCREDUCE_DIRECT=0 (its
    waiter drives the loop) runs with ranks that run them directly."""
    results = run_ranks(3, body_direct, env=TCP, rank_env={1: {"ASYNCREDUCE_DIRECT": "0"}},
                        timeout=120)  # fmt: skip
    assert len({got["digest"] for got in results.values()}) == 1, "the ranks differ"
    assert all(got["exact"] for got in results.values())
    assert results[1]["direct"] == 0
    assert results[0]["direct"] > 0 and results[2]["direct"] > 0


def body_direct_against_general(comm: ar.Communicator) -> dict[str, Any]:
    """The same allreduces through ``DirectCalls`` (a contiguous, writable numpy array, in
    place) and through the general path (a copy: inplace=False; a read-only array; a list),
    interleaved, so their keys interleave too; then the errors of bad calls, which the
    general path raises for both. Returns whether each pair agreed bitwise, the errors, and
    how many ran directly."""
    agree, errors = True, []
    rng = np.random.default_rng(comm.rank)
    for i in range(60):
        dtype, op = CASES[i % len(CASES)]
        x = (rng.standard_normal((3, _small_size(i) // 3 + 1)) * 100).astype(dtype)
        copied = comm.allreduce(x, op=op, inplace=False)  # (the general path)
        readonly = x.copy()
        readonly.flags.writeable = False
        general = comm.allreduce(readonly, op=op, inplace=False)
        comm.allreduce(x, op=op)  # (DirectCalls: 2-D, reshaped)
        agree &= x.tobytes() == copied.tobytes() == general.tobytes()
    for bad in ({"op": "mean"}, {"op": ["sum"]}, {"priority": 1.5}, {"name": ""}):
        try:
            comm.allreduce(np.ones(4, np.float32), **bad)
        except ar.UsageError as exc:
            errors.append(str(exc))
    try:
        comm.allreduce(np.ones(4, np.float32)[::2])  # (not contiguous)
    except ar.UsageError as exc:
        errors.append(str(exc))
    comm.barrier()
    ran = _engine(comm).direct
    comm.close()
    try:
        comm.allreduce(np.ones(4, np.float32))
    except ar.ClosedError as exc:
        errors.append(str(exc))
    return {"agree": agree, "errors": errors, "direct": ran}


def test_direct_calls_and_the_general_path_agree_and_refuse_alike() -> None:
    results = run_ranks(2, body_direct_against_general, env=TCP, timeout=120)
    for rank, got in results.items():
        assert got["agree"], f"rank {rank}: the paths differ"
        assert got["direct"] >= 30, got["direct"]
        errors = got["errors"]
        assert len(errors) == 6, errors
        assert "mean" in errors[0] and "priority" in errors[2] and "name" in errors[3]
        assert "contiguous" in errors[4] and "closed" in errors[5]


def body_barriers_between_lane_allreduces(comm: ar.Communicator) -> dict[str, Any]:
    """On one host with the same-host lane open: unnamed small allreduces (the lane's) and
    blocking barriers (the engine's, each noting its slot in the lane) in turn, unnamed and
    named, then an average whose division underflows, under numpy errors that raise."""
    sums = []
    for i in range(30):
        x = np.full(8, float(comm.rank + i), np.float32)
        comm.allreduce(x)
        sums.append(float(x[0]))
        comm.barrier(name=None if i % 3 else "b")
    tiny = np.full(4, np.finfo(np.float32).smallest_subnormal * (comm.rank + 1), np.float32)
    with np.errstate(all="raise"):
        comm.allreduce(tiny, op="avg", name="tiny")  # (1.5 x the smallest: inexact)
    return {"sums": sums, "lane": comm.data_plane.lane, "tiny": tiny.tolist()}


def test_barriers_between_lane_allreduces_keep_the_lane_going() -> None:
    results = run_ranks(2, body_barriers_between_lane_allreduces, timeout=60)
    for rank, got in results.items():
        assert got["lane"], "the lane did not open: this test needs it"
        assert got["sums"] == [float(2 * i + 1) for i in range(30)], rank
        assert got["tiny"] == results[0]["tiny"] and got["tiny"][0] > 0


def body_after_back_pressure(comm: ar.Communicator) -> dict[str, Any]:
    """Rank 0 posts eight 256 KiB named allreduces while rank 1 sleeps (a 64 KiB cap:
    rank 1 says Hold), then rank 1 posts them in the other order; then 100 blocking 1 KiB
    ones. Returns whether rank 1 said Hold, whether every hold ended, the values' check,
    and how many of the small ones ran directly."""
    engine, flow = _engine(comm), _engine(comm).session.flow
    xs = {f"big{i}": np.full(64 << 10, comm.rank + i, np.float32) for i in range(8)}
    names = list(xs) if comm.rank == 0 else list(xs)[::-1]
    if comm.rank == 1:
        time.sleep(1.0)  # rank 0's frames arrive for operations not posted here
    held = bool(flow.told)
    ar.wait_all([comm.iallreduce(xs[name], name=name) for name in names])
    comm.barrier()
    time.sleep(0.3)  # (a Resume in flight lands; the beat after it has gone)
    before = engine.direct
    x = np.ones(256, np.float32)
    for _ in range(100):
        x[:] = comm.rank + 1
        comm.allreduce(x)
    exact = all(np.all(v == 1 + 2 * int(n[3:])) for n, v in xs.items()) and np.all(x == 3)
    return {"held": held, "holds": bool(flow.told or flow.holding_back or flow.kept),
            "exact": bool(exact), "direct": engine.direct - before}  # fmt: skip


def test_back_pressure_ends_and_small_operations_run_directly_again() -> None:
    """A hold (flow.py) ends once the slow rank took what it held: the senders send as it
    comes again, and the small blocking allreduces after it run on the caller's thread (a
    hold for good kept them off it, ``Session.quiet``, and cost every operation a PostNotice)."""
    env = {**TCP, "ASYNCREDUCE_HELD_BYTES": str(64 << 10)}
    results = run_ranks(2, body_after_back_pressure, env=env, timeout=60)
    assert results[1]["held"], "rank 1 never told rank 0 to hold: the test tests nothing"
    for rank, got in results.items():
        assert got["exact"], f"rank {rank}: wrong values"
        assert not got["holds"], f"rank {rank}: the hold did not end"
        # (a hold for good ran none directly; a partner late by 2 ms hands one to the engine)
        assert got["direct"] >= 10, f"rank {rank}: only {got['direct']} of 100 ran directly"


def body_flight_of_direct_runs(comm: ar.Communicator, where: str) -> int:
    """100 blocking 1 KiB allreduces (unnamed, then "named"), then the flight record dumped
    to ``where``; returns how many ran directly."""
    x = np.ones(256, np.float32)
    for i in range(100):
        comm.allreduce(x, name="named" if i >= 50 else None)
    comm.barrier()
    comm.dump_flight_record(where)
    return _engine(comm).direct


def test_direct_runs_are_in_the_flight_record_and_culprit_finds_nothing(tmp_path: Path) -> None:
    """A rank that runs them on its caller's thread records them as one that never does
    (``ASYNCREDUCE_DIRECT=0``): ``culprit`` finds the ranks alike, where it used to say that
    the second posted what the first never did."""
    results = run_ranks(2, body_flight_of_direct_runs, str(tmp_path), env=TCP,
                        rank_env={1: {"ASYNCREDUCE_DIRECT": "0"}}, timeout=60)  # fmt: skip
    assert results[0] >= 10 and results[1] == 0, results  # (else it tests nothing)
    dumps = load_dumps([str(tmp_path)])
    assert culprit(dumps) == ["every rank posted the same operations and none failed"]
    for dump in dumps:
        done = {(r["name"], r["instance"]) for r in dump["records"] if r["state"] == "done"}
        want = {("", i) for i in range(50)} | {("named", i) for i in range(50)}
        assert want <= done, (dump["rank"], sorted(want - done)[:5])


def body_direct_mismatch(comm: ar.Communicator) -> dict[str, Any]:
    """Blocking 1 KiB allreduces back to back; at the 50th, rank 2 posts 257 floats instead
    of 256. Returns how many completed, and the error the 50th ended with."""
    completed = 0
    try:
        for i in range(100):
            count = 257 if (comm.rank == 2 and i == 50) else 256
            comm.allreduce(np.ones(count, np.float32))
            completed += 1
    except ar.MismatchError as exc:
        return {"completed": completed, "error": str(exc), "direct": _engine(comm).direct}
    return {"completed": completed, "error": None, "direct": _engine(comm).direct}


_WITHOUT_C = textwrap.dedent(
    """
    import sys
    for helper in ("transport._stream_core", "samehost._mailbox_core", "samehost._named_core"):
        sys.modules["asyncreduce." + helper] = None  # (importing it raises ImportError)
    import numpy as np
    import asyncreduce as ar
    from asyncreduce.samehost import mailbox, named
    from asyncreduce.transport import pairs
    assert pairs.native_swaps is None and pairs.native_take is None
    assert mailbox.Core is None and named.NamedCore is None
    comm = ar.init()
    n = comm.world_size
    for i in range(150):
        x = np.full(256, comm.rank + i, np.float32)
        comm.allreduce(x)
        assert np.all(x == sum(r + i for r in range(n))), x[:3]
        y = np.full(8, float(comm.rank), np.float64)
        comm.allreduce(y, op="avg")
        assert np.all(y == (n - 1) / 2), y[:3]
        comm.barrier()
    print("ok", comm.rank, comm._backend.engine.direct, flush=True)
    comm.close()
    """
)


def test_installed_without_the_c_helpers_every_call_runs_in_python(tmp_path: Path) -> None:
    """Where the set-up had no C compiler (the helpers absent: their import fails), a real
    launch of four ranks still runs blocking small allreduces and barriers on the caller's
    thread, with the Python look and numpy's combine, and right."""
    script = tmp_path / "rank.py"
    script.write_text(_WITHOUT_C)
    command = [sys.executable, "-m", "asyncreduce", "run", "-n", "4", sys.executable, str(script)]
    done = subprocess.run(command, env={**os.environ, **TCP}, capture_output=True, text=True,
                          timeout=150, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    ran = [line.split() for line in done.stdout.splitlines() if " ok " in f" {line} "]
    assert sorted(int(words[-2]) for words in ran) == [0, 1, 2, 3], done.stdout
    assert all(int(words[-1]) >= 300 for words in ran), done.stdout  # (of 450: most direct)


@pytest.mark.parametrize("n", [3, 4])
def test_a_rank_that_looks_in_python_agrees_with_those_that_look_in_c(n: int) -> None:
    """A direct run's look at its partner's stream is C's (_stream_core) or Python's
    (ASYNCREDUCE_NATIVE=0), each rank on its own: the same frames, the same results. With
    four ranks every step is a swap, which C combines as it arrives and Python with numpy."""
    results = run_ranks(n, body_direct, env=TCP, rank_env={1: {"ASYNCREDUCE_NATIVE": "0"}},
                        timeout=120)  # fmt: skip
    assert len({got["digest"] for got in results.values()}) == 1, "the ranks differ"
    for rank, got in results.items():
        assert got["exact"] and got["direct"] >= 60, f"rank {rank}: {got}"


def test_a_rank_that_posts_another_size_fails_every_rank_with_a_mismatch() -> None:
    """A partner's frame that differs is not taken around the engine: the engine reads it
    and fails the operation on every rank, naming both sides, as for any other operation."""
    results = run_ranks(3, body_direct_mismatch, env=TCP, timeout=60)
    for rank, got in results.items():
        assert got["completed"] == 50, f"rank {rank}: {got}"
        assert got["error"] is not None and "float32[256]" in got["error"], got["error"]
        assert "float32[257]" in got["error"], got["error"]
        assert got["direct"] >= 10, f"rank {rank}: {got['direct']} direct"


def body_barriers(comm: ar.Communicator) -> dict[str, Any]:
    """60 blocking barriers (unnamed, then "named"), before every other one a random rank
    late by up to 20 ms (every rank draws the same from a shared seed); returns when each
    rank entered and left each one (one host: one clock), and how many ran directly."""
    rng = np.random.default_rng(7)
    entered, left = [], []
    for i in range(60):
        late, delay = int(rng.integers(comm.world_size)), float(rng.uniform(0, 0.02))
        if comm.rank == late and i % 2:
            time.sleep(delay)
        entered.append(time.time())
        comm.barrier(name="named" if i >= 30 else None)
        left.append(time.time())
    return {"entered": entered, "left": left, "direct": _engine(comm).direct}


@pytest.mark.parametrize(("n", "path"), [(2, "direct"), (3, "direct"), (4, "direct"),
                                         (5, "direct"), (3, "direct-python")])  # fmt: skip
def test_a_blocking_barrier_runs_on_the_callers_thread_and_waits_for_every_rank(
    n: int, path: str
) -> None:
    """The dissemination barrier runs as a small allreduce does (``Engine.run_direct``: a power of
    two or not; its frames carry no payload, looked for in C or in Python): no rank leaves
    one before the last rank entered it."""
    results = run_ranks(n, body_barriers, env=PATHS[path], timeout=60)
    for i in range(60):
        last_in = max(got["entered"][i] for got in results.values())
        first_out = min(got["left"][i] for got in results.values())
        assert first_out >= last_in, f"barrier {i}: a rank left {last_in - first_out:.6f} s early"
    for rank, got in results.items():
        # (half have a rank late by up to 20 ms: those, and some after them, go to the engine)
        assert got["direct"] >= 5, f"rank {rank}: only {got['direct']} of 60 ran directly"


def body_barrier_against_allreduce(comm: ar.Communicator) -> str:
    """Rank 1 posts a 1-float allreduce where the others post their 21st barrier."""
    for _ in range(20):
        comm.barrier()
    with pytest.raises(ar.MismatchError) as info:
        if comm.rank == 1:
            comm.allreduce(np.ones(1, np.float32))
        else:
            comm.barrier()
    return str(info.value)


def test_a_barrier_against_another_operation_fails_every_rank_with_a_mismatch() -> None:
    for rank, error in run_ranks(3, body_barrier_against_allreduce, env=TCP, timeout=60).items():
        assert "barrier" in error and "allreduce float32[1]" in error, (rank, error)


def body_direct_for_a_while(comm: ar.Communicator) -> dict[str, Any]:
    """Blocking 4-float allreduces back to back for 1.5 s by rank 0's clock (it says stop in
    the data, so every rank stops at the same one), with a peer timeout of 0.3 s (a beat due
    every 20 ms): returns how many ran, how many directly, and any error."""
    engine = _engine(comm)
    comm.barrier()
    ran, end = 0, time.monotonic() + 1.5
    x = np.zeros(4, np.float32)
    try:
        while not x[1]:
            x[:] = (1, comm.rank == 0 and time.monotonic() > end, 0, 0)
            comm.allreduce(x)
            assert x[0] == comm.world_size
            ran += 1
        comm.barrier()
    except ar.BrokenError as exc:
        return {"ran": ran, "direct": engine.direct, "error": str(exc)}
    return {"ran": ran, "direct": engine.direct, "error": None}


def test_ranks_that_run_them_directly_for_long_still_hear_each_other() -> None:
    """A direct run reads only its own frames and sends no beat: the ranks must still count
    as alive (each frame taken is heard from its rank; a beat due hands that operation to
    the engine, whose turn sends it), well past the peer timeout."""
    env = {**TCP, "ASYNCREDUCE_PEER_TIMEOUT": "0.3"}
    results = run_ranks(3, body_direct_for_a_while, env=env, timeout=60)
    for rank, got in results.items():
        assert got["error"] is None, f"rank {rank}: {got['error']}"
        assert got["direct"] > got["ran"] // 4, f"rank {rank}: {got}"
        assert got["direct"] < got["ran"], f"rank {rank}: no beat ever handed one over"


def body_threads_in_orders_of_their_own(comm: ar.Communicator) -> dict[str, Any]:
    """Three threads run blocking small named allreduces, each rank starting its threads in
    another order (so the ranks post in different orders); returns whether every value was
    right and how many ran directly."""
    exact: list[bool] = []

    def run(t: int) -> None:
        for j in range(60):
            x = np.full(_small_size(j), float(comm.rank + t + j), np.float32)
            comm.allreduce(x, name=f"thread{t}")
            exact.append(bool(np.all(x == sum(r + t + j for r in range(comm.world_size)))))

    order = [(t + comm.rank) % 3 for t in range(3)]
    in_threads(*(functools.partial(run, t) for t in order))
    return {"exact": all(exact) and len(exact) == 180, "direct": _engine(comm).direct}


def test_blocking_small_allreduces_from_threads_in_different_orders_all_complete() -> None:
    """A thread that runs one directly gives way to another thread's post or wait (it is
    taken over where it stands), so named ones posted in different orders on different ranks
    all complete, each with its own values."""
    for rank, got in run_ranks(3, body_threads_in_orders_of_their_own, env=TCP).items():
        assert got["exact"], f"rank {rank}: wrong values or missing operations"


# ---- sans-IO: which events start a spin -----------------------------------------------------


def test_only_small_operations_make_the_engine_spin() -> None:
    """A small operation's post and end set ``spin_until`` to the event's time plus the spin;
    a large one's leave it; spin=0 (the fallback) never sets it past the present."""
    for spin, n_floats, spins in ((1e-3, 1024, True), (1e-3, 1 << 20, False), (0.0, 1024, False)):
        wire = Wire(2, seed=7, settings=Settings(spin=spin))
        for rank in wire.ranks:
            rank.now = 100.0
        xs = [np.full(n_floats, float(r + 1), np.float32) for r in range(2)]
        for r in range(2):
            wire.post(r, "allreduce", "x", xs[r])
        posted_until = [rank.session.spin_until for rank in wire.ranks]
        for rank in wire.ranks:
            rank.now = 200.0
        wire.run()
        assert all(np.all(x == 3) for x in xs)
        ended_until = [rank.session.spin_until for rank in wire.ranks]
        if spins:
            assert posted_until == [100.0 + spin] * 2, posted_until
            assert ended_until == [200.0 + spin] * 2, ended_until
        elif spin:  # a large operation: untouched from the start
            assert posted_until == ended_until == [0.0, 0.0], (posted_until, ended_until)
        else:  # spin=0: never past the event's own time
            assert max(posted_until) <= 100.0 and max(ended_until) <= 200.0
