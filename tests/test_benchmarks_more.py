"""The concurrency, overlap and priority benchmarks end to end, on tiny sizes.

Each test runs ``python -m asyncreduce bench NAME`` as a user would (fresh worker processes,
asyncreduce only, N=2, JSON out) and checks the document's structure and that every time is a
positive finite number; the timings themselves are not judged. The overlap benchmark also runs
once on two emulated hosts (``--quick --hosts 2 --rate 1gbit``, every library installed; root,
``ip`` and ``tc`` needed, skipped otherwise), where every row must say where it ran; and without
a way to emulate hosts, ``--hosts`` must refuse at once, saying why.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
LIBS = ("asyncreduce", "gloo", "mpi")


def _load(name: str, path: Path) -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # common.py, which loads the others by path
    import common

    return common.load_module(name, path)


def _cluster() -> ModuleType:
    return _load("asyncreduce_scripts.cluster", ROOT / "scripts" / "cluster.py")


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


def _expected(row: dict[str, Any]) -> float:
    """The overlap, raw, from the row's own medians."""
    t_comm, t_compute = row["t_comm_s"], row["t_compute_s"]
    return float(1 - (row["t_both_s"] - max(t_comm, t_compute)) / min(t_comm, t_compute))


def test_overlap_benchmark_writes_json(tmp_path: Path) -> None:
    document = _run("overlap", tmp_path, "--bytes", "1M", "--repeats", "2", "--matrix", "64")
    (r,) = document["results"]
    assert r["lib"] == "asyncreduce" and r["call"] == "iallreduce + wait" and r["matmuls"] >= 1
    assert _positive(r["t_comm_s"], r["t_compute_s"], r["t_both_s"], r["compute_in_both_s"])
    assert len(r["both_repeats_s"]) == 2 and _positive(*r["both_repeats_s"])
    assert 0.0 <= r["overlap"] <= 1.0 and math.isfinite(r["overlap_raw"])
    assert r["overlap_raw"] == pytest.approx(_expected(r))
    assert document["summary"]["2"]["asyncreduce"]["overlap"] == r["overlap"]
    assert document["settings"]["hosts"] is None and document["settings"]["mtu"] is None
    assert (r["hosts"], r["rate"], r["rate_bps"], r["mtu"]) == (1, None, None, None)


@pytest.mark.skipif(
    _cluster().available() is not None, reason=f"no emulated hosts here: {_cluster().available()}"
)
def test_overlap_benchmark_on_two_emulated_hosts(tmp_path: Path) -> None:
    out = tmp_path / "overlap.json"
    command = [
        sys.executable, "-m", "asyncreduce", "bench", "overlap", "--quick", "--hosts", "2",
        "--rate", "1gbit", "--timeout", "60", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 hosts @ 1gbit" in done.stdout and "1 host " not in done.stdout
    document: dict[str, Any] = json.loads(out.read_text())
    assert document["failures"] == []
    s = document["settings"]
    assert (s["hosts"], s["nprocs"], s["rates"], s["mtu"]) == ([2], [2], ["1gbit"], 1500)
    ran = [lib for lib in LIBS if lib not in document["skipped"]]
    assert "asyncreduce" in ran
    rows = {r["lib"]: r for r in document["results"]}
    assert sorted(rows) == sorted(ran) and len(document["results"]) == len(ran)
    for lib, r in rows.items():
        assert (r["nprocs"], r["hosts"], r["rate"], r["mtu"]) == (2, 2, "1gbit", 1500), r
        assert r["rate_bps"] == 1e9 and r["bytes"] == 4 << 20 and r["matmuls"] >= 1
        assert _positive(r["t_comm_s"], r["t_compute_s"], r["t_both_s"], *r["both_repeats_s"])
        assert len(r["comm_repeats_s"]) == 3 and r["overlap_raw"] == pytest.approx(_expected(r))
        assert document["summary"]["2 hosts @ 1gbit"][lib]["overlap"] == r["overlap"]


def test_overlap_on_hosts_says_why_it_cannot(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    overlap = _load("asyncreduce_benchmarks.overlap", BENCHMARKS / "overlap.py")
    monkeypatch.setattr(
        overlap.cluster, "available", lambda: "creating network namespaces needs root"
    )
    assert overlap.main(["--hosts", "2", "--rate", "1gbit"]) == 2
    assert "--hosts needs root" in capsys.readouterr().err
    assert overlap.main(["--rate", "10gbit"]) == 2  # a rate means nothing on the loopback
    assert "--rate and --mtu need --hosts" in capsys.readouterr().err


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
