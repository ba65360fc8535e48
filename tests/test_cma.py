"""Cross-memory attach over real processes (see spmd.py and asyncreduce/cma.py).

With every rank on one host, an allreduce of an ordinary buffer of CROSS_MEMORY_BYTES or more
reads the peers' buffers with process_vm_readv instead of sending them. These tests check that
the path is really taken (the flight record says so) and only from that size, that results
are exact and bitwise identical on every rank (dtypes, slices, torch tensors, avg and max,
threads in shuffled orders), that one rank without it (ASYNCREDUCE_CMA=0) turns it off for
every rank instead of leaving them to disagree, that a buffer in a shared window against an
ordinary one fails everywhere, and that a rank killed mid-run is named by the survivors.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import asyncreduce as ar
from asyncreduce.algorithms import CROSS_MEMORY_BYTES
from spmd import (
    cross_memory_permitted,
    run_ranks,
    shm_files,
    shuffled_in_threads,
    survive_the_death_of_rank_2,
    window_against_ordinary,
)

COUNT = CROSS_MEMORY_BYTES // 4 + 13  # float32 elements just above the threshold (odd)


@pytest.fixture(autouse=True, scope="module")
def _permitted() -> None:
    if not cross_memory_permitted():
        pytest.skip(
            "this kernel does not let sibling processes read each other's memory "
            "(Yama ptrace_scope 1 or more, or a container without CAP_SYS_PTRACE)"
        )


def _cma_ops(comm: ar.Communicator) -> int:
    return sum("cross-memory" in r["what"] for r in comm.flight_record()["records"])


def body_exact(comm: ar.Communicator) -> dict[str, str]:
    r, n = comm.rank, comm.world_size
    assert comm._cross is not None
    digests = {}
    for dtype in (np.float32, np.float64, np.int64):
        ramp = np.arange(3 * COUNT, dtype=dtype).reshape(3, COUNT)
        x = ramp * (r + 1) + r
        assert comm.allreduce(x) is x
        np.testing.assert_array_equal(x, sum(ramp * (q + 1) + q for q in range(n)))
        digests[np.dtype(dtype).name] = hashlib.sha256(x.tobytes()).hexdigest()
    row = x[1]  # a slice: another address, not a page boundary
    row[:] = r + 1
    comm.allreduce(row, "max")
    assert np.all(row == n)
    f = np.full(COUNT, r, np.float32)
    comm.allreduce(f, "avg")
    assert np.all(f == np.float32(sum(range(n)) / n))
    small = np.full(CROSS_MEMORY_BYTES // 4 - 1, r, np.float32)  # below: the ring
    comm.allreduce(small)
    assert np.all(small == sum(range(n)))
    assert _cma_ops(comm) == 5
    return digests


@pytest.mark.parametrize("n", [2, 3, 4])
def test_cross_memory_allreduce_is_exact_and_identical_everywhere(n: int) -> None:
    results = run_ranks(n, body_exact)
    assert all(results[r] == results[0] for r in range(n))


def body_torch(comm: ar.Communicator) -> bool:
    import torch

    t = torch.full((2 * COUNT,), float(comm.rank + 1), dtype=torch.bfloat16)  # 2-byte items
    assert comm.allreduce(t) is t
    return bool((t == 3).all()) and _cma_ops(comm) == 1


def test_a_torch_tensor_takes_the_cross_memory_path() -> None:
    pytest.importorskip("torch")
    assert all(run_ranks(2, body_torch).values())


def body_threads(comm: ar.Communicator, ops: int, threads: int) -> dict[int, str]:
    r, n = comm.rank, comm.world_size
    results: dict[int, str] = {}

    def work(mine: list[int]) -> None:
        reqs = []
        for i in mine:
            x = np.arange(COUNT + i, dtype=np.float32) * (r + 1) + i
            reqs.append((i, x, comm.iallreduce(x, name=f"cma{i}")))
        for i, x, req in reqs:
            req.wait(timeout=60)
            expect = sum(np.arange(COUNT + i, dtype=np.float32) * (q + 1) + i for q in range(n))
            np.testing.assert_array_equal(x, expect)
            results[i] = hashlib.sha256(x.tobytes()).hexdigest()

    shuffled_in_threads(r, ops, threads, work)
    assert _cma_ops(comm) == ops
    return results


def test_threads_post_cross_memory_allreduces_in_shuffled_orders() -> None:
    results = run_ranks(3, body_threads, 24, 4, timeout=120)
    assert results[0] == results[1] == results[2]


def body_off(comm: ar.Communicator) -> bool:
    x = np.full(COUNT, comm.rank + 1, np.float32)
    comm.allreduce(x)
    return comm._cross is None and _cma_ops(comm) == 0 and bool(np.all(x == 6))


def test_one_rank_without_it_turns_it_off_for_every_rank() -> None:
    results = run_ranks(3, body_off, rank_env={1: {"ASYNCREDUCE_CMA": "0"}})
    assert all(results.values()), results


def test_a_window_buffer_against_an_ordinary_one_fails_on_every_rank() -> None:
    for rank, message in run_ranks(2, window_against_ordinary, COUNT).items():
        assert "in shared window 1" in message, f"rank {rank}: {message}"
        assert "cross-memory" in message, f"rank {rank}: {message}"


def body_victim(comm: ar.Communicator) -> str:
    return survive_the_death_of_rank_2(comm, np.ones(16 << 20, np.float32), 0.05)


def test_a_rank_killed_during_cross_memory_allreduces_is_named_by_the_survivors() -> None:
    messages = run_ranks(3, body_victim, expect_dead=frozenset({2}))
    assert set(messages) == {0, 1}
    assert all("rank 2" in m for m in messages.values()), messages
    assert not shm_files()
