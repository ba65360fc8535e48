"""One rank of a test body under a real mpirun (see spmd.run_ranks(..., backend="mpi")):
reads the body and its arguments from DIR/job, runs it over ar.init(backend="mpi"), writes
(ok, result or traceback) to DIR/out.RANK."""

from __future__ import annotations

import os
import pickle  # test harness only: files between the test and its own children
import sys
import traceback

import asyncreduce as ar

if __name__ == "__main__":
    where = sys.argv[1]
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    os.environ["ASYNCREDUCE_TEST_RANK"] = str(rank)
    try:
        with open(os.path.join(where, "job"), "rb") as f:
            body, args = pickle.load(f)
        with ar.init(backend="mpi", timeout=30) as comm:
            outcome = (True, body(comm, *args))
    except BaseException:
        outcome = (False, traceback.format_exc())
    with open(os.path.join(where, f"out.{rank}"), "wb") as f:
        pickle.dump(outcome, f)
