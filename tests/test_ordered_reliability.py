"""Failure paths of the ordered backends that used to hang or leak (issue 35, items 1, 4, 7 and
11): a stopped peer while this rank is in an MPI call, deadlines that kept finished operations
and their buffers alive, torch process groups left behind by each init/close, and an MPI init
that a rank never joins. Each test is the review's sketch (docs/reliability.md has the rows)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import asyncreduce as ar
from spmd import mpi_available, run_ranks

needs_mpi = pytest.mark.skipif(not mpi_available(), reason="needs Open MPI")


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
