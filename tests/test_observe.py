"""What a user sees of a job: the log line of each communicator, per-operation lines only on
request, and timelines of all ranks on one clock. Started for real under ``asyncreduce run``."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import asyncreduce as ar
from asyncreduce.trace import Timeline
from spmd import run_ranks

SCRIPT = """
import logging, sys
import numpy as np
import asyncreduce as ar
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout,
                    format="%(name)s %(levelname)s %(message)s")
with ar.init(timeout=30) as comm:
    comm.allreduce(np.ones(4), name="quiet")
    if "ops" in sys.argv:
        logging.getLogger("asyncreduce.ops").setLevel(logging.DEBUG)
    comm.allreduce(np.ones(4), name="asked")
"""


def run_job(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> list[str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "asyncreduce", "run", "-n", "3", str(script), *args]
    full_env = None
    if env:
        import os

        full_env = {**os.environ, **env}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True,
                         env=full_env)  # fmt: skip
    return out.stdout.splitlines()


@pytest.mark.timeout(150)
def test_each_communicator_says_once_who_it_is_and_which_data_plane_it_took(
    tmp_path: Path,
) -> None:
    lines = run_job(tmp_path)
    joined = [line for line in lines if "joined (launcher: asyncreduce run;" in line]
    assert sorted(line[:3] for line in joined) == ["[0]", "[1]", "[2]"], "\n".join(lines)
    rank1 = next(line for line in joined if line.startswith("[1]"))
    assert "INFO" in rank1 and "rank 1 of 3" in rank1, rank1
    assert "rank 0: shared memory (same host)" in rank1 and "rank 2: shared memory" in rank1
    assert "cross-memory attach:" in rank1 and "shared windows: on" in rank1, rank1
    assert not [line for line in lines if "asyncreduce.ops" in line], "per-op lines by default"


@pytest.mark.timeout(150)
def test_tcp_only_is_named_with_its_reason(tmp_path: Path) -> None:
    lines = run_job(tmp_path, env={"ASYNCREDUCE_SHM": "0"})
    rank0 = next(line for line in lines if line.startswith("[0]") and "joined" in line)
    assert "rank 1: tcp (ASYNCREDUCE_SHM=0 here)" in rank0, rank0
    assert "shared windows: off" in rank0, rank0


@pytest.mark.timeout(150)
def test_per_operation_lines_come_only_when_asked_for(tmp_path: Path) -> None:
    ops = [line for line in run_job(tmp_path, "ops") if "asyncreduce.ops" in line]
    assert ops, "asyncreduce.ops at DEBUG printed nothing"
    assert all("'asked'" in line for line in ops), ops
    assert {line[:3] for line in ops if " posts " in line} == {"[0]", "[1]", "[2]"}, ops
    assert {line[:3] for line in ops if " ends " in line} == {"[0]", "[1]", "[2]"}, ops


def body_timeline(comm: ar.Communicator) -> list[tuple[float, float]]:
    """Each rank makes its timeline at a different moment, then times one barrier."""
    time.sleep(0.3 * comm.rank)
    timeline = Timeline(comm)
    with timeline.span("barrier"):
        comm.barrier(name="timed")
    events: list[Any] = timeline.to_chrome()["traceEvents"]  # type: ignore[assignment]
    return [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "barrier"]


@pytest.mark.timeout(90)
def test_timelines_of_all_ranks_share_one_clock() -> None:
    """The ranks leave a barrier together (within a message latency, milliseconds on a loaded
    2-core machine), so on a shared clock its ends line up; timelines counting from their own
    creation would put them 0.3 s apart per rank."""
    spans = [v[0] for v in run_ranks(3, body_timeline).values()]
    ends = [end for _, end in spans]
    assert max(ends) - min(ends) < 50_000, spans  # microseconds
    latest_start = max(start for start, _ in spans)
    assert latest_start <= min(ends), spans
