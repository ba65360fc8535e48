"""Fault injection with real processes: nothing hangs, every survivor names the culprit.

Each scenario runs real ranks (tests/spmd.py) over both data planes where it matters, under a
hard deadline (run_ranks' timeout and pytest-timeout), so a hang fails the test. Figures are
reported for docs/reliability.md when ASYNCREDUCE_RELIABILITY_REPORT is set (tests/faults.py);
ASYNCREDUCE_FAULT_SCALE repeats them for the long run (``bash scripts/reliability.sh``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import asyncreduce as ar
from asyncreduce.flight import culprit, load_dumps
from faults import SCALE, report
from spmd import _CTX, free_port, run_ranks, shm_segments

TRANSPORTS = {"shm": {"ASYNCREDUCE_SHM": "1"}, "tcp": {"ASYNCREDUCE_SHM": "0"}}
SIZES = {"small": 1024, "large": 8 << 20}  # float32 elements: 4 KiB and 32 MiB
VICTIM = 2
_SETTLE = 0.2  # seconds the victim waits after "warm" before its phase begins


# ---- SIGKILL of one rank of four ----------------------------------------------------------------


def body_killed(comm: ar.Communicator, phase: str, count: int) -> tuple[str, float]:
    x = np.ones(count, np.float32)
    comm.allreduce(np.ones(4, np.float32), name="warm")  # every rank is here, links are up
    if comm.rank == VICTIM:
        _die(phase, comm, x)
    start = time.monotonic()
    with pytest.raises((ar.BrokenError, TimeoutError)) as info:
        for _ in range(10_000):
            comm.allreduce(x, name="op", timeout=30)
    return str(info.value), time.monotonic() - start


def _die(phase: str, comm: ar.Communicator, x: np.ndarray) -> None:
    me = os.getpid()
    time.sleep(_SETTLE)  # its last "warm" frames have surely been read: a kill resets unread data
    if phase == "before-send":  # dies before it posts: nothing of "op" ever leaves it
        os.kill(me, signal.SIGKILL)
    if phase == "after-receive":  # its peers' first frames have reached it; it never answers
        time.sleep(0.3)
        os.kill(me, signal.SIGKILL)
    threading.Timer(0.02, os.kill, (me, signal.SIGKILL)).start()  # mid-payload
    while True:
        comm.allreduce(x, name="op", timeout=30)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("phase", ["before-send", "mid-payload", "after-receive"])
def test_sigkill_of_one_rank_is_named_by_every_survivor(
    phase: str, size: str, transport: str
) -> None:
    times = []
    for _ in range(SCALE):
        results = run_ranks(
            4, body_killed, phase, SIZES[size], expect_dead=frozenset({VICTIM}),
            env=TRANSPORTS[transport], timeout=90,
        )  # fmt: skip
        assert set(results) == {0, 1, 3}
        for rank, (message, elapsed) in results.items():
            assert f"rank {VICTIM}" in message, f"rank {rank}: {message}"
            assert elapsed < 5.0, f"rank {rank} took {elapsed:.2f} s to notice: {message}"
            times.append(elapsed - _SETTLE - (0.3 if phase == "after-receive" else 0.0))
    report(
        f"SIGKILL 1 of 4 ranks, {phase}, {size}, {transport}",
        "every survivor raises naming the dead rank",
        runs=SCALE, hangs=0, median_s=statistics.median(times), max_s=max(times),
    )  # fmt: skip


# ---- SIGSTOP: a frozen rank -----------------------------------------------------------------


def body_frozen(comm: ar.Communicator) -> tuple[str, str, float]:
    comm.allreduce(np.ones(4, np.float32), name="warm")
    if comm.rank == VICTIM:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises((TimeoutError, ar.BrokenError)) as info:
        comm.allreduce(np.ones(1000, np.float32), name="stuck")
    error = info.value  # a silent peer: BrokenError (a wait of ours ran out: TimeoutError)
    return type(error).__name__, str(error), time.monotonic() - start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("peer_timeout", [2.0])
def test_a_frozen_rank_is_named_within_its_timeout_and_no_earlier(peer_timeout: float) -> None:
    env = {"ASYNCREDUCE_PEER_TIMEOUT": str(peer_timeout)}
    late, times = max(0.5, 0.1 * peer_timeout), []
    for _ in range(SCALE):
        results = run_ranks(4, body_frozen, expect_dead=frozenset({VICTIM}), env=env, timeout=60)
        for rank, (cause, message, elapsed) in results.items():
            assert cause == "BrokenError", f"rank {rank}: {message}"
            assert f"rank {VICTIM}" in message, f"rank {rank}: {message}"
            assert peer_timeout - 0.05 <= elapsed <= peer_timeout + late, (rank, elapsed)
            times.append(elapsed)
    report(
        f"SIGSTOP 1 of 4 ranks (ASYNCREDUCE_PEER_TIMEOUT={peer_timeout:g})",
        f"BrokenError naming it (TimeoutError its cause), within [T, T + {late:g} s]",
        runs=SCALE, hangs=0, min_s=min(times), max_s=max(times),
    )  # fmt: skip


def body_frozen_receiver(comm: ar.Communicator) -> tuple[str, float]:
    comm.allreduce(np.ones(4, np.float32), name="warm")
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()  # rank 0 only sends: it waits for room, never for data
    with pytest.raises(ar.BrokenError) as info:  # a silent peer (the peer timeout its cause)
        comm.broadcast(np.ones(32 << 20, np.float32), root=0, name="big")
    return str(info.value), time.monotonic() - start


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_root_sending_to_a_frozen_rank_fails_in_time(transport: str) -> None:
    env = {"ASYNCREDUCE_PEER_TIMEOUT": "2", **TRANSPORTS[transport]}
    results = run_ranks(2, body_frozen_receiver, expect_dead=frozenset({1}), env=env, timeout=45)
    message, elapsed = results[0]
    assert "rank 1" in message and 1.95 <= elapsed <= 2.5, (elapsed, message)


# ---- a rank skips a collective: the stall inspector and the flight recorder ----------------------


def body_skip(comm: ar.Communicator) -> tuple[list[str], str]:
    comm.allreduce(np.ones(4, np.float32), name="warm")
    name = "x" if comm.rank == 3 else "w"  # rank 3 skips "w" and waits in "x"
    with pytest.raises((TimeoutError, ar.BrokenError)) as info:
        comm.allreduce(np.ones(100, np.float32), name=name, timeout=6)
    return comm.stall_reports, str(info.value)


@pytest.mark.timeout(120)
def test_a_skipped_collective_is_named_by_the_stall_inspector_and_the_culprit_script(
    tmp_path: Path,
) -> None:
    env = {"ASYNCREDUCE_STALL_WARNING": "1", "ASYNCREDUCE_FLIGHT_DIR": str(tmp_path)}
    results = run_ranks(4, body_skip, env=env, timeout=60)
    for rank in (0, 1, 2):
        reports = results[rank][0]
        assert any("'w'#0" in r and "never posted by rank 3" in r for r in reports), reports
    assert any("'x'#0" in r and "never posted by ranks 0, 1, 2" in r for r in results[3][0])
    findings = culprit(load_dumps([str(tmp_path)]))
    assert any("'w'#0" in f and "never by rank 3" in f for f in findings), findings
    report(
        "a rank skips a collective (ASYNCREDUCE_STALL_WARNING=1)",
        "stall warning names the op and the missing rank; culprit script agrees",
        runs=1, hangs=0, named=True,
    )  # fmt: skip


# ---- the mismatch matrix, after many good operations ------------------------------------------


def body_mismatch(comm: ar.Communicator, case: str, good: int) -> tuple[str, str]:
    for _ in range(good):
        comm.allreduce(np.full(16, 1.0, np.float32), name="good")
    r, x = comm.rank, np.ones(1000, np.float32)
    with pytest.raises((ar.MismatchError, ar.BrokenError)) as info:
        if case == "count":
            comm.allreduce(np.ones(1200 if r == 1 else 1000, np.float32), name="m")
        elif case == "shape":
            comm.allreduce(np.ones((10, 2) if r == 1 else (10,), np.float32), name="m")
        elif case == "dtype":
            comm.allreduce(x.astype(np.float64) if r == 1 else x, name="m")
        elif case == "reduction":
            comm.allreduce(x, "max" if r == 2 else "sum", name="m")
        elif case == "kind":
            (comm.broadcast if r == 1 else comm.allreduce)(x, name="m")
        elif case == "root":
            comm.broadcast(x, root=1 if r == 2 else 0, name="m")
        comm.allreduce(np.ones(4, np.float32), name="after")  # sticky: this fails if "m" did not
    error = info.value
    cause = error if isinstance(error, ar.MismatchError) else error.__cause__
    return type(cause).__name__, str(error)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["count", "shape", "dtype", "reduction", "kind", "root"])
def test_mismatch_matrix_after_many_good_operations(case: str) -> None:
    good = 500 * SCALE
    start = time.monotonic()
    results = run_ranks(3, body_mismatch, case, good, timeout=90)
    for rank, (cause, message) in results.items():
        assert cause == "MismatchError", f"rank {rank}: {message}"
    report(
        f"mismatch ({case}) after {good} good operations, 3 ranks",
        "MismatchError (or BrokenError caused by it) on every rank",
        runs=1, hangs=0, total_s=time.monotonic() - start,
    )  # fmt: skip


# ---- abort() ------------------------------------------------------------------------------------


def body_abort(comm: ar.Communicator, pending: int) -> tuple[float, int, str]:
    comm.allreduce(np.ones(4, np.float32), name="warm")
    if comm.rank == 0:
        x = np.ones(1024, np.float32)
        reqs = [comm.iallreduce(x, name=f"never{i}", inplace=False) for i in range(pending)]
        start = time.monotonic()
        comm.abort("test abort")
        took = time.monotonic() - start
        failed = sum(isinstance(r.exception(timeout=5), ar.BrokenError) for r in reqs)
        return took, failed, ""
    start = time.monotonic()
    with pytest.raises(ar.BrokenError) as info:
        comm.allreduce(np.ones(4, np.float32), name="waits-forever")
    return time.monotonic() - start, 0, str(info.value)


@pytest.mark.timeout(60)
def test_abort_returns_fast_with_a_thousand_requests_and_peers_follow() -> None:
    results = run_ranks(3, body_abort, 1000, timeout=45)
    took, failed, _ = results[0]
    assert took < 2.0 and failed == 1000, (took, failed)
    for rank in (1, 2):
        elapsed, _, message = results[rank]
        assert "test abort" in message, message
        assert elapsed < 2.0, (rank, elapsed)
    report(
        "abort() with 1000 requests in flight, 3 ranks",
        "returns within 2 s; every request fails; peers fail within a heartbeat",
        runs=1, hangs=0, abort_s=took, peers_max_s=max(results[r][0] for r in (1, 2)),
    )  # fmt: skip


def _resources() -> tuple[int, int, int]:
    fds = len(os.listdir("/proc/self/fd"))
    shm = len(shm_segments())
    return fds, threading.active_count(), shm


def body_rebuild(comm: ar.Communicator, ports: list[int]) -> tuple[Any, Any, int]:
    comm.abort("first")
    time.sleep(0.2)
    baseline, done = _resources(), 0
    for port in ports:
        with ar.init(comm.rank, comm.world_size, "127.0.0.1", port, timeout=30) as c:
            assert c.allreduce(np.ones(8, np.float32), name="check")[0] == c.world_size
            reqs = []
            with contextlib.suppress(ar.BrokenError):  # rank 0 may abort while rank 1 posts
                for i in range(20):
                    reqs.append(c.iallreduce(np.ones(4096, np.float32), name=f"p{i}"))
            if c.rank == 0:
                c.abort("cycle")
            for r in reqs:
                r.exception(timeout=10)  # done one way or another, never hanging
            done += 1
    time.sleep(0.2)
    return baseline, _resources(), done


@pytest.mark.timeout(300)
def test_abort_and_rebuild_cycles_leave_no_descriptor_thread_or_segment() -> None:
    cycles = 10 * SCALE
    ports = [free_port() for _ in range(cycles)]
    results = run_ranks(2, body_rebuild, ports, timeout=240)
    for rank, (baseline, after, done) in results.items():
        assert done == cycles
        assert after == baseline, f"rank {rank}: (fds, threads, shm) {baseline} -> {after}"
    report(
        f"{cycles} abort-and-rebuild cycles, 2 ranks",
        "descriptors, threads and shared-memory segments back to baseline",
        runs=cycles, hangs=0, leaked=0,
    )  # fmt: skip


# ---- back-pressure ------------------------------------------------------------------------------


def body_slow_rank(comm: ar.Communicator, ops: int) -> tuple[int, bool]:
    x = [np.full(256 << 10, float(comm.rank + 1), np.float32) for _ in range(ops)]  # 1 MiB each
    comm.allreduce(np.ones(4, np.float32), name="warm")
    if comm.rank == 0:  # fast: posts everything at once
        reqs = [comm.iallreduce(x[i], name=f"op{i}") for i in range(ops)]
        ar.wait_all(reqs, timeout=120)
    else:  # ten times slower: one at a time, after "computing"
        for i in range(ops):
            time.sleep(0.005)
            comm.allreduce(x[i], name=f"op{i}", timeout=120)
    engine = comm._engine
    assert engine is not None
    return engine.held_peak, all(bool(np.all(a == 3.0)) for a in x)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_slow_rank_holds_at_most_its_cap_of_early_frames(transport: str) -> None:
    ops, cap = 300, 8 << 20
    free = run_ranks(2, body_slow_rank, ops, env=TRANSPORTS[transport], timeout=120)
    capped = run_ranks(
        2, body_slow_rank, ops, env={**TRANSPORTS[transport], "ASYNCREDUCE_HELD_BYTES": str(cap)},
        timeout=120,
    )  # fmt: skip
    assert free[1][1] and capped[1][1] and capped[0][1], "wrong results"
    assert free[1][0] > 100 << 20, f"without a cap the slow rank held only {free[1][0]} bytes"
    # Beyond the cap: what was already on its way when the sender heard "hold": over TCP the
    # two socket buffers (8 MiB each once the kernel doubles them) and write bursts, sent at
    # full speed since every connection has TCP_NODELAY (measured 31-59 MiB held over TCP;
    # 10-12 MiB before, when the sender's side was Nagled and slower); over shared memory the
    # arena. Either way far below what an uncapped rank holds.
    slack = (64 if transport == "tcp" else 16) << 20
    assert capped[1][0] <= cap + slack, f"held {capped[1][0]} bytes with a cap of {cap}"
    assert capped[1][0] < free[1][0] / 2, (capped[1][0], free[1][0])
    report(
        f"a 10x slower rank, {ops} x 1 MiB posted at once by the other, {transport}",
        "early frames held by the slow rank stay near the cap (ASYNCREDUCE_HELD_BYTES)",
        runs=1, hangs=0, held_without_cap_mib=free[1][0] / 2**20,
        held_with_8mib_cap_mib=capped[1][0] / 2**20,
    )  # fmt: skip


# ---- the store dies during rendezvous -----------------------------------------------------------


def _store_then_die(port: int) -> None:
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    ar.init(0, 3, "127.0.0.1", port, timeout=30)


def _join(rank: int, port: int, out: Any) -> None:
    time.sleep(1.0 if rank == 2 else 0.0)  # rank 2 comes late: the store is dead by then
    start = time.monotonic()
    try:
        ar.init(rank, 3, "127.0.0.1", port, timeout=5)
        out.put((rank, "joined", 0.0))
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        out.put((rank, f"{type(exc).__name__}: {exc}", time.monotonic() - start))


@pytest.mark.timeout(60)
def test_store_killed_during_rendezvous_fails_every_rank_in_time() -> None:
    port = free_port()
    store = _CTX.Process(target=_store_then_die, args=(port,), daemon=True)
    store.start()
    out = _CTX.Queue()
    ranks = [_CTX.Process(target=_join, args=(r, port, out), daemon=True) for r in (1, 2)]
    for p in ranks:
        p.start()
    got = [out.get(timeout=30) for _ in ranks]
    for p in [store, *ranks]:
        p.join(timeout=10)
    for rank, message, elapsed in got:
        assert message != "joined", f"rank {rank} joined a job whose store died"
        assert "store" in message or "rank 0" in message, f"rank {rank}: {message}"
        assert elapsed < 8.0, f"rank {rank} took {elapsed:.1f} s"
    report(
        "the store (rank 0) SIGKILLed during rendezvous",
        "every rank fails within its init timeout, naming the store",
        runs=1, hangs=0, max_s=max(g[2] for g in got),
    )  # fmt: skip
