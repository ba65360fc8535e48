"""The concurrency, overlap and priority benchmarks end to end, on tiny sizes.

Each test runs ``python -m asyncreduce bench NAME`` as a user would (fresh worker processes,
asyncreduce only, N=2, JSON out) and checks the document's structure and that every time is a
positive finite number; the timings themselves are not judged.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(name: str, tmp_path: Path, *options: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    command = [
        sys.executable, "-m", "asyncreduce", "bench", name, "--nprocs", "2",
        "--libs", "asyncreduce", "--timeout", "60", "--json", str(out), *options,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "N=2" in done.stdout and f"wrote {out}" in done.stdout
    document: dict[str, Any] = json.loads(out.read_text())
    assert document["benchmark"] == name
    assert document["failures"] == [] and document["skipped"] == {}
    assert document["machine"]["cores"] >= 1
    assert "--json" in document["command"]["argv"]
    assert document["elapsed_s"] > 0
    return document


def _positive(*values: Any) -> bool:
    return all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values)


def test_concurrency_benchmark_writes_json(tmp_path: Path) -> None:
    document = _run(
        "concurrency", tmp_path, "--tensors", "3", "--elements", "64K", "--repeats", "1"
    )
    assert document["settings"]["tensors"] == 3 and document["settings"]["elements"] == 65536
    rows = {r["variant"]: r for r in document["results"]}
    plain = {"sequential", "threads", "requests"}
    assert set(rows) == plain | {f"window-{v}" for v in plain}
    for r in rows.values():
        assert r["lib"] == "asyncreduce" and r["nprocs"] == 2
        assert r["verified"] is True, r  # every rank held the right sums
        assert _positive(r["seconds"], *r["repeats_s"]) and len(r["repeats_s"]) == 1
    summary = document["summary"]["2"]
    for family in ("asyncreduce", "asyncreduce window"):  # each against its own sequential
        mine = summary[family]
        assert mine["best_variant"] in rows and _positive(mine["best_s"], mine["sequential_s"])
        assert mine["best_variant"].startswith("window-") == family.endswith("window")
        assert _positive(mine["concurrent_vs_sequential"])


def test_overlap_benchmark_writes_json(tmp_path: Path) -> None:
    document = _run("overlap", tmp_path, "--bytes", "1M", "--repeats", "2", "--matrix", "64")
    (r,) = document["results"]
    assert r["lib"] == "asyncreduce" and r["call"] == "iallreduce + wait" and r["matmuls"] >= 1
    assert _positive(r["t_comm_s"], r["t_compute_s"], r["t_both_s"], r["compute_in_both_s"])
    assert len(r["both_repeats_s"]) == 2 and _positive(*r["both_repeats_s"])
    assert 0.0 <= r["overlap"] <= 1.0 and math.isfinite(r["overlap_raw"])
    expected = 1 - (r["t_both_s"] - max(r["t_comm_s"], r["t_compute_s"])) / min(
        r["t_comm_s"], r["t_compute_s"]
    )
    assert r["overlap_raw"] == pytest.approx(expected)
    assert document["summary"]["2"]["asyncreduce"]["overlap"] == r["overlap"]


def test_priority_benchmark_writes_json(tmp_path: Path) -> None:
    document = _run("priority", tmp_path, "--big", "2M", "--repeats", "2")
    rows = {r["case"]: r for r in document["results"]}
    assert set(rows) == {"small_alone", "big_alone", "small_high", "small_low"}
    assert rows["small_alone"]["big_s"] is None and _positive(rows["small_alone"]["small_s"])
    assert rows["big_alone"]["small_s"] is None and _positive(rows["big_alone"]["big_s"])
    for case in ("small_high", "small_low"):
        r = rows[case]
        assert _positive(r["small_s"], r["big_s"], r["small_over_big"])
        assert len(r["rounds"]) == 2


def test_benchmarks_are_listed() -> None:
    from asyncreduce import bench

    names = bench.available(BENCHMARKS)
    for name in ("concurrency", "overlap", "priority"):
        assert names.get(name), f"{name} missing or without a docstring"
