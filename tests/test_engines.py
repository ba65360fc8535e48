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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives_are_exact_and_equal_to_native(n: int, backend: str) -> None:
    native = run_ranks(n, tc.body_collectives)
    results = run_ranks(n, tc.body_collectives, backend=backend, timeout=90)
    assert all(results[r] == native[0] for r in range(n))


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
    ],
)
def test_the_native_request_usage_and_timeout_tests(backend: str, body) -> None:  # type: ignore[no-untyped-def]
    results = run_ranks(2, body, backend=backend, timeout=90)
    native = run_ranks(2, body, timeout=90)
    if body is tc.body_reused_name:
        assert results == native
    if body is tc.body_close_pending:  # (the sockets left are the engine's own: MPI, Gloo)
        assert results[0][1] == native[0][1] == 5


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
