"""Failure paths of the ordered backends that used to hang or leak (issue 35, items 1, 4, 7 and
11): a stopped peer while this rank is in an MPI call, deadlines that kept finished operations
and their buffers alive, torch process groups left behind by each init/close, and an MPI init
that a rank never joins. Each test is the review's sketch (docs/reliability.md has the rows)."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

import asyncreduce as ar
from asyncreduce.backends.ordered.failure import Breaker
from asyncreduce.backends.ordered.posted import Posted
from asyncreduce.flight import FlightRecorder
from asyncreduce.protocol import describe
from asyncreduce.protocol.liveness import Liveness
from asyncreduce.request import CallbackRunner, Request
from spmd import mpi_available, run_ranks

needs_mpi = pytest.mark.skipif(not mpi_available(), reason="needs Open MPI")


# ---- item 1: a stopped peer while this rank is in an MPI call -----------------------------------


def body_stopped_peer(
    comm: ar.Communicator, where: str, count: int
) -> tuple[float, float, float, str]:  # fmt: skip
    """Rank 1 posts 'w' and stops 0.3 s later (a child resumes it after 8 s, so the job ends);
    rank 0 posts 'w' with timeout=2 at 1 s, so its engine runs the MPI call while rank 1 is
    stopped. Rank 0 returns (seconds from its post to the error, from rank 1's stop to the
    error, close() seconds, the error's message)."""
    x = np.ones(count, np.float32)
    comm.barrier()
    if comm.rank == 1:
        subprocess.Popen(["sh", "-c", f"sleep 8; kill -CONT {os.getpid()}"])
        request = comm.iallreduce(x, name="w")
        time.sleep(0.3)
        Path(where, "stopped").write_text(repr(time.monotonic()))  # (one clock for the host)
        os.kill(os.getpid(), signal.SIGSTOP)
        try:  # resumed: rank 0 broke and left meanwhile
            request.wait(timeout=10)
        except Exception as exc:
            return 0.0, 0.0, 0.0, type(exc).__name__
        return 0.0, 0.0, 0.0, "completed"
    time.sleep(1.0)
    start = time.monotonic()
    with pytest.raises((TimeoutError, ar.BrokenError)) as info:  # (its deadline; a silent peer)
        comm.allreduce(x, name="w", timeout=2)
    raised = time.monotonic()
    comm.close()
    closed = time.monotonic() - raised
    stopped = float(Path(where, "stopped").read_text())
    return raised - start, raised - stopped, closed, str(info.value)


@needs_mpi
@pytest.mark.parametrize(("peer_timeout", "count"), [("2", 256), ("60", 1 << 20)])
def test_a_stopped_peer_during_an_mpi_call_fails_it_in_time_and_close_returns(
    peer_timeout: str, count: int, tmp_path: Path
) -> None:
    """The engine thread never sits in a call no deadline can end: with the peer timeout at 2 s
    the silent peer is named 2 s after it stopped; at 60 s the call's own timeout=2 fires.
    1 KiB and 4 MiB: the two sizes that were blocking MPI_Allreduce calls on that thread."""
    env = {"ASYNCREDUCE_PEER_TIMEOUT": peer_timeout}
    results = run_ranks(2, body_stopped_peer, str(tmp_path), count, backend="mpi", env=env,
                        timeout=60)  # fmt: skip
    after_post, after_stop, closed, message = results[0]
    if peer_timeout == "2":  # the silence (rank 1 stopped 0.7 s before rank 0 posted)
        assert 2.0 <= after_stop <= 2.6, (after_stop, message)
        assert "rank 1" in message, message
    else:  # the deadline
        assert 2.0 <= after_post <= 2.5, (after_post, message)
        assert "timeout of 2" in message, message
    assert after_post <= 2.5, after_post
    assert closed <= 5.0, closed  # the linger (2 s for calls, 2 s for goodbyes), no more


def _breaker() -> tuple[Breaker, Liveness[Posted]]:
    """Rank 0's failure path (of 2 ranks, peer timeout 2 s), with one operation pending."""
    liveness: Liveness[Posted] = Liveness(0, 2, peer_timeout=2.0, now=0.0)
    request: Request[None] = Request("'w'", CallbackRunner("asyncreduce-test-callbacks"))
    flat = np.zeros(4, np.float32)  # (no descriptor, no dtype: nothing here reads them)
    op = Posted((b"w", 0), "'w'", None, request, lambda: None, None,  # type: ignore[arg-type]
                "allreduce", flat, None, "sum", 0)  # fmt: skip
    flight = FlightRecorder(0, 2, 10, describe)
    breaker = Breaker(0, flight, None, threading.Lock(), liveness, {op.key: op}, [],
                      lambda kind, body: None)  # fmt: skip
    return breaker, liveness


def _looks(breaker: Breaker, liveness: Liveness[Posted], times: list[float]) -> list[str | None]:
    """What the engine's housekeeping does at each of ``times`` (a beat, then the silence
    check): the error it broke on by then, or None."""
    seen = []
    for t in times:
        if liveness.beat_due(t):
            breaker.fail_if_silent(t)
        seen.append(None if breaker.broken is None else str(breaker.broken))
    return seen


def test_silence_is_not_judged_on_heard_times_older_than_this_ranks_own_absence() -> None:
    """After the engine thread itself was away (a long call, no GIL), what peers sent meanwhile
    is read before anyone is called silent; a peer that stays silent is still named."""
    beats = [k / 20 for k in range(1, 21)]  # every 0.05 s (the beat at a 2 s peer timeout)
    breaker, liveness = _breaker()
    assert _looks(breaker, liveness, beats) == [None] * 20
    assert _looks(breaker, liveness, [10.0]) == [None]  # away 1 s to 10 s: not rank 1's silence
    liveness.heard[1] = 10.01  # what rank 1 sent meanwhile, read by the next poll
    later = [10 + t for t in beats] + [11 + t for t in beats]
    assert _looks(breaker, liveness, later) == [None] * 40
    assert _looks(breaker, liveness, [12.1])[0] is not None  # silent since 10.01 s: named now
    steady, clock = _breaker()  # looking at every beat
    assert _looks(steady, clock, beats + [1 + t for t in beats]) == [None] * 40
    assert "rank 1 sent nothing for 2 s" in (_looks(steady, clock, [2.1])[0] or "")
    slow, clock = _breaker()  # a thread that looks every 0.5 s
    named = _looks(slow, clock, [k / 2 for k in range(1, 7)])
    assert any(named), "a silent peer must still be named"


def body_close_in_turn(comm: ar.Communicator) -> float:
    """Rank 1 closes; rank 0 closes 0.5 s later, having read rank 1's goodbye meanwhile:
    rank 1's close() seconds (it waits for rank 0's goodbye, which must come)."""
    comm.barrier()
    if comm.rank == 1:
        start = time.monotonic()
        comm.close()
        return time.monotonic() - start
    time.sleep(0.5)
    comm.close()
    return 0.0


def test_a_rank_that_heard_the_goodbye_first_still_says_its_own() -> None:
    """Else the first to close waits out the whole linger (4 s) for it."""
    results = run_ranks(2, body_close_in_turn, backend="mpi" if mpi_available() else "torch")
    assert results[1] < 1.5, results


# ---- item 4: operations with timeout= are forgotten once they end -------------------------------


def body_deadlines(comm: ar.Communicator) -> tuple[int, int, bool]:
    """A 4 MiB buffer posted once, then 5,000 small allreduces, all with timeout=600: returns
    (deadline entries held, operations pending, whether the big buffer is gone)."""
    big = np.ones(1 << 20, np.float32)
    gone = weakref.ref(big)
    comm.allreduce(big, name="big", timeout=600)
    del big
    x = np.ones(4, np.float32)
    for _ in range(5000):
        comm.allreduce(x, timeout=600)
    gc.collect()
    engine = comm._ordered
    assert engine is not None
    held = len(engine._liveness._deadlines)
    pending = sum(not op.request.done() for op in engine._pending())
    return held, pending, gone() is None


def test_operations_with_a_timeout_are_not_kept_until_their_deadline() -> None:
    """Over MPI where it is installed (5,000 operations take 1 s there, 10 s over Gloo)."""
    backend = "mpi" if mpi_available() else "torch"
    results = run_ranks(2, body_deadlines, backend=backend, timeout=120)
    for rank, (held, pending, gone) in results.items():
        assert held <= 2 * pending + 64, (rank, held, pending)
        assert gone, f"rank {rank}: the 4 MiB buffer is still alive after del and gc.collect()"


# ---- item 7: init(backend="torch") + close() leaves nothing behind ------------------------------


def body_cycles(rank: int, n: int, port: int, cycles: int) -> list[tuple[int, int, int]]:
    """``cycles`` init(backend="torch") + allreduce + close() in one Gloo job: after each,
    (open descriptors, torch process groups, OS threads)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    seen = []
    try:
        for _ in range(cycles):
            with ar.init(backend="torch", timeout=30) as comm:
                comm.allreduce(np.ones(4, np.float32))
            gc.collect()
            seen.append((len(os.listdir("/proc/self/fd")), len(c10d._world.pg_map),
                         len(os.listdir("/proc/self/task"))))  # fmt: skip
    finally:
        dist.destroy_process_group()
    return seen


def test_torch_init_and_close_cycles_leak_no_process_group_descriptor_or_thread() -> None:
    results = run_ranks(2, body_cycles, 13, connect=False, timeout=120)
    for rank, seen in results.items():
        fds, groups, threads = zip(*seen, strict=True)
        assert len(set(groups[2:])) == 1, (rank, groups)
        assert max(fds[2:]) <= fds[2], (rank, fds)
        assert max(threads[2:]) <= threads[2], (rank, threads)


# ---- item 11: an MPI init that a rank never joins ------------------------------------------------

NEVER_JOINS = """
import json, os, sys, time
from mpi4py import MPI  # every rank starts MPI; rank 1 never calls init
import asyncreduce as ar
if MPI.COMM_WORLD.Get_rank() == 1:
    time.sleep(float(sys.argv[1]) + 3)
    os._exit(0)  # no MPI_Finalize: mpirun ends the job (a rank 0 still inside init included)
start = time.monotonic()
try:
    ar.init(backend="mpi", timeout=float(sys.argv[1]))
    outcome = ["joined", ""]
except BaseException as exc:
    outcome = [type(exc).__name__, str(exc)]
print(json.dumps([time.monotonic() - start, *outcome]), flush=True)
os._exit(0)
"""


@needs_mpi
def test_mpi_init_is_bounded_by_its_timeout_when_a_rank_never_calls_it(tmp_path: Path) -> None:
    script = tmp_path / "never_joins.py"
    script.write_text(NEVER_JOINS)
    done = subprocess.run(["mpirun", "-n", "2", "--allow-run-as-root", "--oversubscribe",
                           "--mca", "btl_tcp_if_include", "lo", sys.executable, str(script), "2"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert lines, f"rank 0 never came out of init: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    elapsed, kind, message = json.loads(lines[0])
    assert kind == "TimeoutError", (kind, message)
    assert 2.0 <= elapsed <= 3.0, elapsed
    assert "init" in message and "2" in message, message


# ---- item 1's helper thread: gone once close() returned ------------------------------------------


class _Wakes:
    """What the helper needs of its adapter: a ``wake`` to call once a run of calls returned."""

    def wake(self) -> None:
        pass


def test_the_mpi_blocking_helper_is_joined_by_stop_when_it_is_idle() -> None:
    """close() checks that no asyncreduce thread is left (CI once found the helper still alive
    right after close, test_comm's body_close_pending under mpi): stop() joins an idle helper.
    A helper that is stuck in a call stays abandoned: stop() returns within its bound."""
    from asyncreduce.backends.ordered.mpi import _Helper

    for _ in range(20):
        helper = _Helper(0, _Wakes())
        job = helper.call(lambda: None, None)
        helper.stop()
        assert job.done()
        assert not helper._thread.is_alive()
    stuck = _Helper(0, _Wakes())
    gate = __import__("threading").Event()
    stuck.call(gate.wait, None)
    start = time.monotonic()
    stuck.stop(wait=0.2)
    assert time.monotonic() - start < 1.0 and stuck._thread.is_alive()
    gate.set()
