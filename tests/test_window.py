"""Shared windows (``Communicator.shared_empty``) over real processes (see spmd.py).

An allreduce of a buffer in a window reads the peers' buffers in place; these tests check that
the path is really taken (the flight record names the window), that results are exact and
bitwise identical on every rank (whole windows, slices, torch tensors on them, several threads
in shuffled orders), that no file is left in /dev/shm, that a rank passing an ordinary buffer
fails the operation everywhere, and that without shared memory the call degrades to a plain
array.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

import asyncreduce as ar
from spmd import (
    run_ranks,
    shm_files,
    shuffled_in_threads,
    survive_the_death_of_rank_2,
    window_against_ordinary,
)

COUNT = 100_003  # above SMALL_ALLREDUCE_BYTES for every dtype here, and prime


def _window_ops(comm: ar.Communicator) -> int:
    return sum("in shared window" in r["what"] for r in comm.flight_record()["records"])


def body_window(comm: ar.Communicator) -> dict[str, str]:
    r, n = comm.rank, comm.world_size
    digests = {}
    for dtype in (np.float32, np.float64, np.int64):
        x = comm.shared_empty((3, COUNT), dtype)
        assert x.shape == (3, COUNT) and x.dtype == dtype and not shm_files(os.getpid())
        ramp = np.arange(3 * COUNT, dtype=dtype).reshape(3, COUNT)
        x[:] = ramp * (r + 1) + r
        assert comm.allreduce(x) is x
        want = sum(ramp * (q + 1) + q for q in range(n))
        np.testing.assert_array_equal(x, want)
        digests[np.dtype(dtype).name] = hashlib.sha256(x.tobytes()).hexdigest()
    row = x[1]  # a slice of a window (int64): its own offset there
    row[:] = r + 1
    comm.allreduce(row, "max")
    assert np.all(row == n) and np.all(x[0] == want[0])
    f = comm.shared_empty(COUNT, np.float32)
    f[:] = r
    comm.allreduce(f, "avg")
    assert np.all(f == np.float32(sum(range(n)) / n))
    assert _window_ops(comm) == 5
    return digests


@pytest.mark.parametrize("n", [2, 3, 4])
def test_window_allreduce_is_exact_and_identical_everywhere(n: int) -> None:
    results = run_ranks(n, body_window)
    assert all(results[r] == results[0] for r in range(n))


def body_threads(comm: ar.Communicator, ops: int, threads: int) -> dict[int, str]:
    r, n = comm.rank, comm.world_size
    window = comm.shared_empty((ops, 20_000), np.float64)
    results: dict[int, str] = {}

    def work(mine: list[int]) -> None:
        reqs = []
        for i in mine:
            window[i] = np.arange(20_000) * (r + 1) + i
            reqs.append((i, comm.iallreduce(window[i], name=f"op{i}", priority=i % 3)))
        for i, req in reqs:
            req.wait(timeout=60)
            want = sum(np.arange(20_000, dtype=np.float64) * (q + 1) + i for q in range(n))
            np.testing.assert_array_equal(window[i], want)
            results[i] = hashlib.sha256(window[i].tobytes()).hexdigest()

    shuffled_in_threads(r, ops, threads, work)
    assert _window_ops(comm) == ops
    return results


def test_threads_post_window_allreduces_in_shuffled_orders() -> None:
    results = run_ranks(3, body_threads, 40, 4)
    assert sorted(results[0]) == list(range(40))
    assert all(results[r] == results[0] for r in range(3))


def body_torch(comm: ar.Communicator) -> bool:
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(comm.shared_empty(COUNT, np.float32))
    t.fill_(comm.rank + 1.0)
    assert comm.allreduce(t) is t
    return bool(torch.all(t == sum(range(1, comm.world_size + 1)))) and _window_ops(comm) == 1


def test_a_torch_tensor_on_a_window_takes_the_window_path() -> None:
    pytest.importorskip("torch")
    assert all(run_ranks(2, body_torch).values())


def test_an_ordinary_buffer_against_a_window_fails_on_every_rank() -> None:
    for rank, message in run_ranks(2, window_against_ordinary, COUNT).items():
        assert "in shared window 1" in message and "'w'" in message, f"rank {rank}: {message}"


def body_no_shm(comm: ar.Communicator) -> bool:
    x = comm.shared_empty(COUNT, np.float32)
    x[:] = comm.rank + 1
    comm.allreduce(x)
    return bool(np.all(x == 3)) and _window_ops(comm) == 0


def test_without_shared_memory_it_is_an_ordinary_array() -> None:
    assert all(run_ranks(2, body_no_shm, env={"ASYNCREDUCE_SHM": "0"}).values())


def test_a_world_of_one_gets_an_ordinary_array_and_bad_arguments_a_usage_error() -> None:
    with ar.init(0, 1) as comm:
        x = comm.shared_empty((2, np.int64(3)), np.int32)
        x[:] = 7
        assert x.shape == (2, 3) and np.all(comm.allreduce(x) == 7)
        for shape, dtype, match in [((2, -1), np.float32, "non-negative"),
                                    (2.5, np.float32, "sequence of ints"),
                                    (4, object, "numeric dtype"),
                                    (4, "no-such-type", "not a numpy dtype")]:  # fmt: skip
            with pytest.raises(ar.UsageError, match=match):
                comm.shared_empty(shape, dtype)
    with pytest.raises(ar.ClosedError):
        comm.shared_empty(4)


def test_ranks_that_disagree_about_the_window_number_are_refused() -> None:
    """Records carry each rank's window number; a rank that made another one is named."""
    from asyncreduce.samehost.window import WindowError, Windows, _record

    records = np.stack([_record("/dev/shm/asyncreduce-1-x", 8, 1), _record("/x", 8, 2)])
    with pytest.raises(WindowError, match="rank 1 made window 2 where rank 0 made window 1"):
        Windows._map_peers(0, 1, records)


def body_alone(comm: ar.Communicator) -> str:
    if comm.rank == 1:  # never makes the window: rank 0 times out, and both are broken
        with pytest.raises(ar.BrokenError):
            comm.barrier(name="later", timeout=20)
        return "broken"
    with pytest.raises(TimeoutError) as info:
        comm.shared_empty(1000, timeout=1.0)
    return str(info.value)


def test_a_rank_that_never_calls_shared_empty_times_the_others_out() -> None:
    results = run_ranks(2, body_alone)
    assert "timeout" in results[0] and "rank 1" in results[0], results[0]
    assert results[1] == "broken"
    assert not shm_files()


def body_victim(comm: ar.Communicator) -> str:
    x = comm.shared_empty(16 << 20, np.float32)  # 64 MiB
    x[:] = 1
    return survive_the_death_of_rank_2(comm, x, 0.02)


def test_a_rank_killed_during_window_allreduces_is_named_by_the_survivors() -> None:
    messages = run_ranks(3, body_victim, expect_dead=frozenset({2}))
    assert set(messages) == {0, 1}
    assert all("rank 2" in m for m in messages.values()), messages
    assert not shm_files()
