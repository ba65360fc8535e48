"""The core pool (kernels/pool.py, issue 38) on real processes of one host: large allreduces
through shared windows, cross-memory reads and the arenas' ring give bitwise the same result
whatever the pool's size (forced with ASYNCREDUCE_POOL_THREADS; this machine has no spare core
of its own), and a forced pool's threads really take pieces."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import numpy as np
import pytest

import asyncreduce as ar
from asyncreduce.kernels.pool import pool_size
from spmd import run_ranks

COUNT = (6 << 20) // 4 + 123  # 6 MiB of float32 and a bit: several segments per rank


def body_large_allreduces(comm: ar.Communicator) -> dict[str, Any]:
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(COUNT).astype(np.float32) * 1e3
    digests = {}
    ordinary = x.copy()  # (cross-memory reads, or the arenas' ring with ASYNCREDUCE_CMA=0)
    comm.allreduce(ordinary, op="sum")
    digests["ordinary"] = hashlib.sha256(ordinary.tobytes()).hexdigest()
    window = comm.shared_empty(COUNT, np.float32)
    window[:] = x
    comm.allreduce(window, op="avg")
    digests["window"] = hashlib.sha256(window.tobytes()).hexdigest()
    lent = [t.name for t in threading.enumerate() if t.name.startswith("asyncreduce-core")]
    return {"digests": digests, "lent": len(lent)}


@pytest.mark.parametrize("cma", ["1", "0"])
def test_large_allreduces_are_bitwise_the_same_with_and_without_a_pool(cma: str) -> None:
    found = {}
    for threads in ("0", "3"):
        env = {"ASYNCREDUCE_POOL_THREADS": threads, "ASYNCREDUCE_CMA": cma}
        results = run_ranks(3, body_large_allreduces, env=env, timeout=120)
        digests = {r: results[r]["digests"] for r in results}
        assert len({str(d) for d in digests.values()}) == 1, digests  # every rank the same
        found[threads] = digests[0]
        lent = {results[r]["lent"] for r in results}
        assert lent == ({0} if threads == "0" else {3}), lent
    assert found["0"] == found["3"]


def test_the_pool_is_the_ranks_share_of_the_cores_less_one(monkeypatch: Any) -> None:
    import os

    monkeypatch.delenv("ASYNCREDUCE_POOL_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert pool_size(1) == cores - 1
    assert pool_size(cores) == 0  # one rank per core: nothing to spare (this machine's case)
    assert pool_size(4 * cores) == 0
    monkeypatch.setenv("ASYNCREDUCE_POOL_THREADS", "5")
    assert pool_size(cores) == 5
    monkeypatch.setenv("ASYNCREDUCE_POOL_THREADS", "-1")
    with pytest.raises(ar.UsageError, match="ASYNCREDUCE_POOL_THREADS"):
        pool_size(2)
