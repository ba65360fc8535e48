"""Going on without lost ranks (asyncreduce.shrink, issue 37 item 1) on real processes over real
sockets: a rank killed mid-operation (rank 0 included, the store's host), the survivors agree on
who remains and go on over their connections with correct sums; a rank stopped past the peer
timeout is excluded like a dead one and, once it runs again, learns it was excluded."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Any

import numpy as np
import pytest

import asyncreduce as ar
from spmd import mpi_available, run_ranks

FAST = {"ASYNCREDUCE_PEER_TIMEOUT": "2"}


def _until_broken(comm: ar.Communicator, x: np.ndarray) -> str:
    """Allreduce until the communicator breaks (within 10 s); the error's message."""
    start = time.monotonic()
    try:
        while time.monotonic() - start < 10:
            comm.allreduce(x.copy())
    except ar.BrokenError as exc:
        return str(exc)
    raise AssertionError("10 s of allreduces went through without the lost rank")


def body_kill_then_shrink(comm: ar.Communicator, victim: int, size: int) -> dict[str, Any]:
    """``victim`` SIGKILLs itself in the middle of an allreduce; every other rank goes on
    with ``shrink``: a communicator of the rest, whose allreduces (small, large, named and
    not, from two threads) are right; the old one refuses."""
    comm.barrier()
    x = np.full(size, float(comm.rank), np.float32)
    if comm.rank == victim:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        while True:
            comm.allreduce(x.copy())
    broke = _until_broken(comm, x)
    start = time.monotonic()
    survivors = ar.shrink(comm, timeout=20)
    took = time.monotonic() - start
    alive = [r for r in range(comm.world_size) if r != victim]
    want = float(sum(alive))
    got = [survivors.allreduce(np.full(n, float(comm.rank), np.float32))[0] for n in (4, 1 << 18)]
    named = survivors.iallreduce(np.ones(8, np.float32), name="after")
    other = threading.Thread(target=lambda: survivors.allreduce(np.ones(3), name="thread"))
    other.start()
    other.join(20)
    with pytest.raises(ar.BrokenError, match="earlier membership|broken"):
        comm.allreduce(np.ones(4))
    result = {"rank": survivors.rank, "size": survivors.world_size, "broke": broke, "sums": got,
              "want": want, "named": float(named.wait(20)[0]), "took": took}  # fmt: skip
    survivors.close()
    return result


@pytest.mark.parametrize("victim", [3, 0])
def test_the_survivors_of_a_killed_rank_agree_and_go_on(victim: int) -> None:
    results = run_ranks(4, body_kill_then_shrink, victim, 16, expect_dead=frozenset({victim}),
                        env=FAST, timeout=90)  # fmt: skip
    alive = [r for r in range(4) if r != victim]
    assert sorted(results) == alive
    for old, got in results.items():
        assert got["size"] == 3 and got["rank"] == alive.index(old), got
        assert got["sums"] == [got["want"]] * 2, got
        assert got["named"] == 3.0, got
        assert f"rank {victim}" in got["broke"] or "broke" in got["broke"], got["broke"]
        assert got["took"] < 5.0, got  # (the agreement itself: a few round trips)


def body_stopped_rank(comm: ar.Communicator) -> dict[str, Any]:
    """Rank 2 stops itself for 6 s (a helper wakes it), longer than the 2 s peer timeout: the
    others exclude it and go on; once it runs again, its shrink says it was excluded."""
    comm.barrier()
    if comm.rank == 2:
        subprocess.Popen(["sh", "-c", f"sleep 6; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        try:
            comm.allreduce(np.ones(4))
        except ar.BrokenError:
            pass
        with pytest.raises(ar.BrokenError, match="was excluded") as info:
            ar.shrink(comm, timeout=20)
        return {"excluded": str(info.value)}
    broke = _until_broken(comm, np.ones(4))
    survivors = ar.shrink(comm, timeout=20)
    total = float(survivors.allreduce(np.ones(4))[0])
    time.sleep(8)  # rank 2 comes back meanwhile: nothing it sends disturbs these
    again = float(survivors.allreduce(np.ones(4))[0])
    survivors.close()
    return {"broke": broke, "size": survivors.world_size, "sums": (total, again)}


def test_a_stopped_rank_is_excluded_and_learns_it_when_it_runs_again() -> None:
    results = run_ranks(4, body_stopped_rank, env=FAST, timeout=90)
    assert "was excluded" in results[2]["excluded"], results[2]
    for rank in (0, 1, 3):
        assert results[rank]["size"] == 3 and results[rank]["sums"] == (3.0, 3.0), results[rank]
        assert "rank 2" in results[rank]["broke"], results[rank]["broke"]


def body_group_shrink(comm: ar.Communicator) -> str:
    group = comm.group([0, 1])
    with pytest.raises(ar.UsageError, match="communicator this group lives on") as info:
        ar.shrink(group)
    return str(info.value)


def test_shrink_refuses_a_group_and_says_why() -> None:
    results = run_ranks(2, body_group_shrink)
    assert all("lives on" in text for text in results.values())


def body_shrink_elsewhere(comm: ar.Communicator) -> str:
    with pytest.raises(ar.UsageError, match="native engine") as info:
        ar.shrink(comm)
    return str(info.value)


@pytest.mark.parametrize("backend", ["torch", "mpi"])
def test_shrink_over_another_engine_is_refused_with_the_reason(backend: str) -> None:
    if backend == "mpi" and not mpi_available():
        pytest.skip("Open MPI and mpi4py are not installed")
    results = run_ranks(2, body_shrink_elsewhere, backend=backend)
    assert all("Open MPI 4 ends the whole job" in text for text in results.values())


def test_the_exclusion_benchmark_runs_and_a_stopped_rank_waits_out_the_timeout(
    tmp_path: Any,
) -> None:
    """benchmarks/exclusion.py, one trial of each fault: a killed rank is excluded long before
    the peer timeout, a stopped one not before it (it might only be slow)."""
    import json
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "exclusion.py"
    out = tmp_path / "exclusion.json"
    done = subprocess.run([sys.executable, str(script), "--trials", "1", "--peer-timeout", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=240,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {(r["fault"], r["victim"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 4 and "excluded p50" in done.stdout
    for (fault, _), row in rows.items():
        excluded = row["excluded_s"]["p50"]
        assert excluded >= row["detected_s"]["p50"]
        assert excluded < 1.0 if fault == "kill" else excluded >= 1.0, (fault, excluded)
