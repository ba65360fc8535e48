"""The Communicator over the ordered backends: backend="mpi" under a real mpirun (Open MPI from
Debian, mpi4py), and backend="torch" over a real torch.distributed Gloo job. The bodies are the
native tests' own (test_comm.py, test_torch_dp.py) wherever they are not about a native transport;
results must equal native ones bit for bit where the arithmetic is exact."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import asyncreduce as ar
import test_comm as tc
import test_torch_dp as tdp
from spmd import mpi_available, run_ranks

BACKENDS = [
    pytest.param("mpi", marks=pytest.mark.skipif(not mpi_available(), reason="needs Open MPI")),
    "torch",
]


NATIVE_COLLECTIVES: dict[int, dict[str, bytes]] = {}  # world size: the native engine's digests


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives_are_exact_and_equal_to_native(n: int, backend: str) -> None:
    if n not in NATIVE_COLLECTIVES:  # the same for every backend: run once per world size
        NATIVE_COLLECTIVES[n] = run_ranks(n, tc.body_collectives)[0]
    results = run_ranks(n, tc.body_collectives, backend=backend, timeout=90)
    assert all(results[r] == NATIVE_COLLECTIVES[n] for r in range(n))



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 4])
def test_eight_threads_shuffled_give_what_native_gives_bitwise(n: int, backend: str) -> None:
    native = run_ranks(n, tc.body_threads, 60, 8, timeout=120)
    results = run_ranks(n, tc.body_threads, 60, 8, timeout=120, backend=backend)
    for r in range(n):
        assert results[r] == native[0], f"rank {r} differs from native"


def body_exchanges(comm: ar.Communicator, backend: str) -> list[float]:
    """reduce, gather, scatter, alltoall, tagged point-to-point and the dtypes, as natively."""
    r, n = comm.rank, comm.world_size
    tc.exchange_checks(comm)
    assert comm.allreduce(np.array([r == 0, True, False]), "sum").tolist() == [True, True, False]
    assert comm.allreduce(np.array([1 << r, 7], np.int8), "bor").tolist() == [(1 << n) - 1, 7]
    z = comm.allreduce(np.full(3, (r + 1) * (1 - 2j), np.complex128), "avg")
    assert np.all(z == (n + 1) / 2 * (1 - 2j))
    h = comm.allreduce(np.full(5, r + 0.5, np.float16), "max")
    assert h.dtype == np.float16 and np.all(h == n - 0.5)
    rs = comm.reduce_scatter(np.arange(2 * n, dtype=np.float64) * (r + 1))
    np.testing.assert_array_equal(rs, np.arange(2 * r, 2 * r + 2) * n * (n + 1) / 2)
    with pytest.raises(ar.UsageError, match="groups are not offered"):
        comm.group(list(range(n)))
    return comm.allgather(np.array([r + 0.25]))[:, 0].tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 3])
def test_exchanges_point_to_point_and_dtypes(n: int, backend: str) -> None:
    results = run_ranks(n, body_exchanges, backend, backend=backend, timeout=90)
    assert all(v == [q + 0.25 for q in range(n)] for v in results.values())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("field", "both"), [
    ("count", ("float32[1000]", "float32[1200]")),
    ("op", ("sum", "max")),
])  # fmt: skip
def test_a_mismatch_fails_on_every_rank_naming_both_sides(
    field: str, both: tuple[str, str], backend: str
) -> None:
    messages = run_ranks(3, tc.body_mismatch, field, backend=backend, timeout=90)
    for rank, message in messages.items():
        assert all(side in message for side in both), f"rank {rank}: {message}"
        assert "'w'" in message


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_send_and_recv_of_different_sizes_break_both_ranks(backend: str) -> None:
    results = run_ranks(2, tc.body_mismatched_p2p, backend=backend, timeout=90)
    assert set(results.values()) <= {"MismatchError", "BrokenError"}, results


def assert_all(results: dict[int, object]) -> None:
    assert all(results.values()), results


def check_timeout_named(messages: dict[int, str]) -> None:
    """body_timeout on any engine: rank 0 names its timeout and the rank it waited for, rank 1
    the rank whose timeout failed the operation (the ordered engines word the relay as "an
    operation failed on rank 0: ...", the native one as "... (reported by rank 0)")."""
    assert "0.5 s" in messages[0] and "rank 1" in messages[0], messages
    assert "0.5 s" in messages[1] and "rank 0" in messages[1], messages


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "body",
    [
        tc.body_timeout,
        tc.body_request_api,
        tc.body_usage,
        tc.body_types,
        tc.body_reused_name,
        tc.body_close_pending,
        tc.body_reuse_after_broadcast,
    ],
)
def test_the_native_request_usage_and_timeout_tests(backend: str, body) -> None:  # type: ignore[no-untyped-def]
    results = run_ranks(2, body, backend=backend, timeout=90)
    checks = {tc.body_request_api: tc.check_request_api, tc.body_usage: tc.check_usage,
              tc.body_types: tc.check_types, tc.body_timeout: check_timeout_named,
              tc.body_reuse_after_broadcast: lambda r: assert_all(r)}  # fmt: skip
    if body in checks:
        checks[body](results)
    if body is tc.body_reused_name:
        assert results == run_ranks(2, body, timeout=90)  # what native gives
    if body is tc.body_close_pending:  # (the sockets left are the engine's own: MPI, Gloo)
        assert results[0][1] == 5


def body_stall(comm: ar.Communicator) -> list[str]:
    """Rank 1 never posts 'late': rank 0's stall report names it; then rank 1 posts it."""
    if comm.rank == 0:
        req = comm.iallreduce(np.ones(4), name="late")
        time.sleep(2.5)
        reports = list(comm.stall_reports)
        comm.barrier(name="go")
        req.wait(30)
        return reports
    comm.barrier(name="go")
    comm.allreduce(np.ones(4), name="late")
    return list(comm.stall_reports)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_stall_report_names_the_rank_that_never_posted(backend: str) -> None:
    results = run_ranks(2, body_stall, backend=backend, env={"ASYNCREDUCE_STALL_WARNING": "1"},
                        timeout=90)  # fmt: skip
    assert any("'late'" in m and "not posted by rank 1" in m for m in results[0]), results[0]
    assert all("'late'" not in m for m in results[1]), results[1]


def body_abort(comm: ar.Communicator) -> str:
    if comm.rank == 1:
        req = comm.iallreduce(np.ones(4), name="never")
        time.sleep(0.5)
        comm.abort("rank 1 gives up")
        with pytest.raises(ar.BrokenError):
            req.wait(5)
        return "aborted"
    start = time.monotonic()
    with pytest.raises(ar.BrokenError, match="rank 1 gives up"):
        comm.allreduce(np.ones(4), name="other", timeout=30)
    assert time.monotonic() - start < 5
    return "broken"


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_breaks_every_rank_with_its_reason(backend: str) -> None:
    results = run_ranks(2, body_abort, backend=backend, timeout=90)
    assert results == {0: "broken", 1: "aborted"}


def body_killed(comm: ar.Communicator) -> str:
    return tc.survive_the_death_of_rank_2(comm, np.ones(1 << 20, np.float32), 0.05)


def test_a_killed_rank_is_named_by_the_survivors_over_torch() -> None:
    messages = run_ranks(3, body_killed, backend="torch", expect_dead=frozenset({2}),
                         env={"ASYNCREDUCE_PEER_TIMEOUT": "5"}, timeout=90)  # fmt: skip
    assert all("rank 2" in m for m in messages.values()), messages


def test_a_frozen_peer_fails_pending_operations_naming_it_over_torch() -> None:
    env = {"ASYNCREDUCE_PEER_TIMEOUT": "2"}
    messages = run_ranks(2, tc.body_frozen, backend="torch", expect_dead=frozenset({1}),
                         env=env, timeout=60)  # fmt: skip
    assert "rank 1" in messages[0], messages


def body_own_mpi_calls(comm: ar.Communicator) -> list[int]:
    """The caller's own MPI calls (MPI_THREAD_MULTIPLE, mpi4py's default) beside ours."""
    from mpi4py import MPI

    errors: list[BaseException] = []

    def ours() -> None:
        try:
            for i in range(200):
                x = np.full(256, float(i))
                comm.allreduce(x, name="mine")
                assert np.all(x == i * comm.world_size)
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    t = threading.Thread(target=ours)
    t.start()
    theirs = [MPI.COMM_WORLD.allreduce(i + comm.rank) for i in range(200)]
    t.join()
    if errors:
        raise errors[0]
    return theirs[:3]


@pytest.mark.skipif(not mpi_available(), reason="needs Open MPI")
def test_the_callers_own_mpi_calls_keep_working_beside_ours() -> None:
    results = run_ranks(2, body_own_mpi_calls, backend="mpi", timeout=90)
    assert results[0] == results[1] == [1, 3, 5]


def body_progress(comm: ar.Communicator) -> float:
    """One 32 MiB allreduce posted, then 0.3 s of Python computing without touching MPI: the
    engine thread's polling is what makes MPI progress; returns the time wait() still took."""
    x = np.ones(8 << 20, np.float32)
    comm.barrier()
    req = comm.iallreduce(x)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        sum(range(1000))
    start = time.monotonic()
    req.wait(30)
    assert np.all(x == comm.world_size)
    return time.monotonic() - start


@pytest.mark.skipif(not mpi_available(), reason="needs Open MPI")
def test_mpi_progresses_while_the_caller_computes() -> None:
    results = run_ranks(2, body_progress, backend="mpi", timeout=90)
    assert all(t < 0.1 for t in results.values()), results


DP_KEYS = ["mlp/sgd/blocking", "mlp/sgd/backward", "mlp/sgd/forward", "mlp/sgd/double_buffer",
           "cnn/adam/forward", "lstm/sgd/forward", "dynamic/sgd/forward", "tied/sgd/backward",
           "mlp/sgd/forward/no_sync"]  # fmt: skip
_DP: dict[str, dict[int, dict]] = {}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", DP_KEYS)
def test_data_parallel_is_exact_in_every_mode(backend: str, key: str) -> None:
    if backend not in _DP:
        _DP[backend] = run_ranks(2, tdp.body_group, DP_KEYS, backend=backend, timeout=300)
    reports = [_DP[backend][r][key] for r in range(2)]
    for got in reports:
        assert "error" not in got, got.get("error")
    _, want = tdp.reference(key, 2)
    for got in reports:
        assert np.abs(got["final"] - want).max() <= tdp.ATOL
    assert reports[0]["bytes"] == reports[1]["bytes"]


def body_threads_named(comm: ar.Communicator) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("asyncreduce"))


def test_one_thread_owns_the_torch_engine() -> None:
    names = run_ranks(2, body_threads_named, backend="torch", timeout=60)
    assert sum(name.startswith("asyncreduce-ordered") for name in names[0]) == 1, names


KILLED = """
import os, signal, threading, numpy as np, asyncreduce as ar
comm = ar.init(backend="mpi")
comm.barrier()
if comm.rank == 2:
    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
x = np.ones(1 << 20, np.float32)
for _ in range(100000):
    comm.allreduce(x)
"""


@pytest.mark.skipif(not mpi_available(), reason="needs Open MPI")
def test_a_killed_rank_over_mpi_ends_the_job_instead_of_hanging(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Open MPI's mpirun kills every rank when one dies (Open MPI 4 has no recovery), so there
    are no survivors to report: what must hold is that nothing hangs."""
    import subprocess
    import sys

    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    start = time.monotonic()
    done = subprocess.run(["mpirun", "-n", "3", "--allow-run-as-root", "--oversubscribe",
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode != 0
    assert time.monotonic() - start < 45
    assert "signal 9" in done.stdout + done.stderr or "Killed" in done.stdout + done.stderr


@pytest.mark.skipif(not mpi_available(), reason="needs Open MPI")
def test_bench_engines_runs_every_row_and_writes_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "engines.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "engines.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--nprocs", "2", "--json",
                           str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())["results"]["2"]
    assert set(result["10x8M"]) == {"mpi", "ours-mpi", "native", "gloo", "ours-torch"}
    assert all(v > 0 for ways in result["10x8M"].values() for v in ways.values())
    assert set(result["4KiB"]) >= {"mpi", "ours-mpi", "native", "gloo", "ours-torch"}
    assert "ours over MPI, best / raw MPI's best" in done.stdout


LAUNCHED = """
import numpy as np, asyncreduce as ar
comm = ar.init()
x = comm.allreduce(np.full(3, comm.rank + 1.0))
print(f"rank {comm.rank} of {comm.world_size} over {type(comm._ordered.adapter).__name__}: {x[0]}")
comm.close()
"""


@pytest.mark.parametrize(
    "backend",
    [pytest.param("mpi", marks=pytest.mark.skipif(not mpi_available(), reason="needs Open MPI")),
     "torch"],
)  # fmt: skip
def test_asyncreduce_run_takes_the_backend(backend: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED)
    cmd = [sys.executable, "-m", "asyncreduce", "run", "--backend", backend, "-n", "2", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    adapter = {"mpi": "MpiAdapter", "torch": "TorchAdapter"}[backend]
    for rank in range(2):
        assert f"rank {rank} of 2 over {adapter}: 3.0" in done.stdout, done.stdout


def body_late_partner(comm: ar.Communicator, delay: float) -> str:
    """Rank 0 gives up on 'late' after 1 s; rank 1 posts it ``delay`` s in, around then. Rank 1
    must not be left alone in an engine call: it either completes with the right sum (rank 0
    ran it on a copy of its input, for rank 1's sake) or fails, within a few seconds."""
    x = np.full(1024, comm.rank + 1.0, np.float32)
    comm.barrier()
    if comm.rank == 0:
        with pytest.raises(TimeoutError):
            comm.allreduce(x, name="late", timeout=1.0)
        time.sleep(1.5)
        return "timed out"
    time.sleep(delay)
    start = time.monotonic()
    try:
        comm.allreduce(x, name="late", timeout=20)
    except (ar.BrokenError, TimeoutError) as exc:
        assert time.monotonic() - start < 5
        return f"failed: {type(exc).__name__}"
    assert np.all(x == 3.0)
    return "completed"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("delay", [1.02, 1.1, 1.3])
def test_a_timeout_on_one_rank_never_strands_the_other_in_the_engine(
    backend: str, delay: float
) -> None:
    results = run_ranks(2, body_late_partner, delay, backend=backend, timeout=90)
    assert results[0] == "timed out"
    assert results[1] in ("completed", "failed: BrokenError", "failed: TimeoutError"), results


def body_close_with_pending(comm: ar.Communicator) -> str:
    """Rank 0 posts 'x' and closes at once; rank 1 posts 'x' 0.3 s later: it completes (rank
    0 lingers, answering rounds, and runs what was agreed) or fails naming rank 0, never hangs."""
    x = np.full(1024, comm.rank + 1.0, np.float32)
    comm.barrier()
    if comm.rank == 0:
        req = comm.iallreduce(x, name="x")
        comm.close()
        with pytest.raises(ar.ClosedError):
            req.wait(5)
        return "closed"
    time.sleep(0.3)
    try:
        comm.allreduce(x, name="x", timeout=20)
    except ar.BrokenError as exc:
        assert "rank 0" in str(exc), exc
        return "failed"
    assert np.all(x == 3.0)
    return "completed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_closing_with_an_operation_pending_never_strands_its_peer(backend: str) -> None:
    results = run_ranks(2, body_close_with_pending, backend=backend, timeout=90)
    assert results[0] == "closed" and results[1] in ("completed", "failed"), results


def body_fused(comm: ar.Communicator) -> tuple[int, bool]:
    """32 small allreduces posted before any wait: agreed together, they run as fewer engine
    calls (fusion), each with its own right sum."""
    comm.barrier()
    engine = comm._ordered
    assert engine is not None
    before = engine.calls
    xs = [np.full(256, float(i + comm.rank)) for i in range(32)]
    ar.wait_all([comm.iallreduce(x, name=f"f{i}") for i, x in enumerate(xs)], timeout=30)
    right = all(np.all(x == 2 * i + 1) for i, x in enumerate(xs))
    return engine.calls - before, right


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_allreduces_agreed_together_are_fused(backend: str) -> None:
    results = run_ranks(2, body_fused, backend=backend, timeout=90)
    for calls, right in results.values():
        assert right and calls < 32, results
    assert results[0] == results[1], "the ranks issued different engine calls"


def body_refused_on_one_rank(comm: ar.Communicator) -> tuple[str, float]:
    """Rank 0 posts an unnamed allreduce this engine cannot run (a priority past 64 bits);
    it is refused before it takes a key, so the next unnamed allreduce still pairs up."""
    message = ""
    if comm.rank == 0:
        with pytest.raises(ar.UsageError) as refused:
            comm.allreduce(np.ones(4), priority=1 << 63)
        message = str(refused.value)
    x = np.full(4, float(comm.rank + 1))
    comm.allreduce(x, timeout=20)
    return message, float(x[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_refused_on_one_rank_leaves_the_keys_in_step(backend: str) -> None:
    results = run_ranks(2, body_refused_on_one_rank, backend=backend, timeout=90)
    assert "priority must fit in 64 bits" in results[0][0], results
    assert results[0][1] == results[1][1] == 3.0, results
