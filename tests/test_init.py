"""Joining a job the ways users do: torchrun-style env (the launcher), a file store, mpirun."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import asyncreduce as ar

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import numpy as np, asyncreduce as ar
with ar.init(timeout=30) as comm:
    x = np.full(1000, comm.rank + 1.0)
    comm.allreduce(x)
    print(f"rank {comm.rank} of {comm.world_size} sum {x[0]:g}")
"""


def test_the_main_job_runs_under_the_launcher() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncreduce", "run", "-n", "3", str(ROOT / "examples/hello.py")],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if "as expected" in line]
    assert sorted(line[:3] for line in lines) == ["[0]", "[1]", "[2]"], out.stdout + out.stderr


def test_the_training_demo_runs_every_mode_and_ends_identical(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    demo = str(ROOT / "examples/train_demo.py")
    cmd = [sys.executable, "-m", "asyncreduce", "run", "-n", "2", demo, "--seconds", "0.5",
           "--width", "64", "--trace", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=True)
    rows = [line for line in out.stdout.splitlines() if "identical on every rank" in line]
    modes = [row.split()[1] for row in rows]
    assert modes == ["blocking", "backward", "forward", "double_buffer"], out.stdout + out.stderr
    trace = json.loads((tmp_path / "forward-rank1.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["name"].split()[0] for e in spans}
    assert {"forward", "backward", "step", "wait", "allreduce"} <= names
    assert all(e["dur"] >= 0 and e["pid"] == 1 for e in spans)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed")
def test_init_under_mpirun_needs_no_master_address(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    cmd = [
        "mpirun",
        "-n",
        "2",
        "--allow-run-as-root",
        "--oversubscribe",
        sys.executable,
        str(script),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    # mpirun forwards both ranks' output through one pipe: lines may run together
    assert sorted(re.findall(r"rank (\d) of 2 sum 3", out.stdout)) == ["0", "1"], out.stdout


def test_file_store_init_method(tmp_path: Path) -> None:
    results: dict[int, float] = {}

    def rank_main(rank: int) -> None:
        with ar.init(rank, 2, init_method=f"file://{tmp_path}/store", timeout=20) as comm:
            results[rank] = float(comm.allreduce(np.full(3, rank + 1.0))[0])

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {0: 3.0, 1: 3.0}


def test_a_world_of_one_needs_no_network() -> None:
    with ar.init(0, 1) as comm:
        x = np.arange(5.0)
        assert comm.allreduce(x, "avg") is x and x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert comm.allgather(np.ones(2)).shape == (1, 2)
        comm.barrier()


def test_missing_rank_information_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "RANK",
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ar.UsageError, match="RANK and WORLD_SIZE"):
        ar.init()
    with pytest.raises(ar.UsageError, match="within a world"):
        ar.init(rank=3, world_size=2)


@pytest.mark.parametrize("timeout", [None, 0, -1.0, "30", True, float("nan")])
def test_a_timeout_that_is_not_a_positive_number_is_a_usage_error(timeout: object) -> None:
    with pytest.raises(ar.UsageError, match=r"timeout must be a positive number of seconds"):
        ar.init(0, 1, timeout=timeout)  # type: ignore[arg-type]


def test_public_names_are_exactly_the_documented_ones() -> None:
    documented = {
        "init", "Communicator", "Request", "wait_all", "wait_any",
        "AsyncReduceError", "UsageError", "ClosedError", "BrokenError", "MismatchError",
        "AuthenticationError", "shrink",
    }  # fmt: skip
    assert set(ar.__all__) == documented
    readme = (ROOT / "README.md").read_text()
    for name in documented - {"AsyncReduceError", "Communicator", "Request"}:
        assert name in readme, f"{name} is public but the README does not mention it"
    methods = {m for m in dir(ar.Communicator) if not m.startswith("_")}
    for name in methods:
        assert name in readme or name in ("rank", "world_size"), (
            f"Communicator.{name} is undocumented"
        )
