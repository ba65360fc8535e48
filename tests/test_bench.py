"""``asyncreduce bench``: finding benchmarks, and a short real run of the allreduce benchmark.

The end-to-end test runs ``python -m asyncreduce bench allreduce`` as a user would (fresh worker
processes, JSON out) on two small sizes and checks the JSON, not the timings. Gloo joins the run
when PyTorch is installed; without it the test still checks asyncreduce alone.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncreduce import bench
from asyncreduce.algorithms import SMALL_ALLREDUCE_BYTES
from asyncreduce.samehost.mailbox import supported

SIZES = (4 << 10, 256 << 10)


def test_lists_and_rejects_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert "allreduce" in bench.available()
    assert bench.main(["--list"]) == 0
    assert "allreduce" in capsys.readouterr().out
    assert bench.main(["no-such-benchmark"]) == 2
    assert "unknown benchmark 'no-such-benchmark'" in capsys.readouterr().err
    assert bench.main([]) == 2


def test_missing_benchmarks_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench, "BENCHMARKS_DIR", tmp_path / "nowhere")
    assert bench.main(["allreduce"]) == 2
    assert "no benchmarks folder" in capsys.readouterr().err


def test_allreduce_benchmark_writes_json(tmp_path: Path) -> None:
    libs = ["asyncreduce"]
    if importlib.util.find_spec("torch") is not None:
        libs.append("gloo")
    out = tmp_path / "allreduce.json"
    command = [
        sys.executable, "-m", "asyncreduce", "bench", "allreduce", "--nprocs", "2",
        "--sizes", "0,4K,256K", "--libs", ",".join(libs), "--min-time", "0.05",
        "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "N=2" in done.stdout and "4 KiB" in done.stdout and "256 KiB" in done.stdout
    assert re.search(r"^barrier +barrier ", done.stdout, re.M)  # size 0: each one's barrier

    document = json.loads(out.read_text())
    assert document["benchmark"] == "allreduce"
    assert document["failures"] == [] and document["skipped"] == {}
    assert document["machine"]["cores"] >= 1
    stolen = document["machine"]["cpu_stolen"]  # Linux: /proc/stat
    assert 0.0 <= stolen <= 100.0, stolen
    assert f"CPU stolen by the hypervisor during the run {stolen:.1f}%" in done.stdout
    assert "--json" in document["command"]["argv"]
    results = {(r["lib"], r["nprocs"], r["bytes"]): r for r in document["results"]}
    assert set(results) == {(lib, 2, size) for lib in libs for size in (0, *SIZES)}
    for (lib, _, size), r in results.items():
        assert r["latency_us"] > 0 and r["iters"] >= 1
        assert (r["busbw_gbps"] > 0) == (size > 0)  # a barrier moves no bytes
        if size == 0:
            assert r["algorithm"] == "barrier"
        elif lib == "asyncreduce":
            small = "lane" if supported() else "doubling"  # one host: the lane where it runs
            assert r["algorithm"] == (small if size <= SMALL_ALLREDUCE_BYTES else "ring")
        else:
            assert r["algorithm"] == "-"


def test_allreduce_rounds_start_every_set_again_and_take_medians(tmp_path: Path) -> None:
    """--rounds 2: every library's ranks start twice, the other library first in the second
    round; every point is kept per round, and a ratio is shown with its rounds' spread."""
    libs = ["asyncreduce", "gloo"] if importlib.util.find_spec("torch") else ["asyncreduce"]
    out = tmp_path / "rounds.json"
    command = [
        sys.executable, "-m", "asyncreduce", "bench", "allreduce", "--nprocs", "2",
        "--sizes", "4K", "--libs", ",".join(libs), "--min-time", "0.05", "--rounds", "2",
        "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(out.read_text())
    assert document["settings"]["rounds"] == 2
    rounds = sorted((r["lib"], r["round"]) for r in document["results"])
    assert rounds == sorted((lib, i) for lib in libs for i in (0, 1))
    order = list(document["set_seconds"])  # in the order the sets ran
    assert order == [f"{lib} N=2 round {i + 1}" for i in (0, 1) for lib in libs[i:] + libs[:i]]
    if len(libs) == 2:
        assert re.search(r"^4 KiB .* \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)$", done.stdout, re.M)


def test_allreduce_report_pairs_rounds() -> None:
    """A point is its median round; a ratio pairs each round's two libraries and takes the
    median of those ratios, skipping a round where one of them has no result."""
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(folder))
    try:
        import allreduce_report as report
    finally:
        sys.path.remove(str(folder))

    def result(lib: str, latency: float, round_: int) -> object:
        return report.Result(lib, 2, 1024, latency, 1.0, "-", latency, [latency], 1, 1, round_)

    settings = report.Settings([1024], [2], ["asyncreduce", "mpi-tcp"], 0.1, 1, 1, None, False, 4)
    run = report.Run(settings)
    mine = (10.0, 30.0, 12.0, 11.0)  # round 1: our ranks met a bad placement
    theirs = (5.0, 6.0, 6.0, None)  # round 3: the other library failed
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        run.results.append(result("asyncreduce", a, i))
        if b is not None:
            run.results.append(result("mpi-tcp", b, i))
    best = run.get("asyncreduce", 2, 1024)
    assert best is not None and best.latency_us == 11.0  # the lower middle of four
    assert run.ratios("asyncreduce", "mpi-tcp", 2, 1024, "bw") == [0.5, 0.2, 0.5]
    assert run.ratios("asyncreduce", "mpi-tcp", 2, 1024, "lat") == [2.0, 5.0, 2.0]
    assert "0.50x (0.20-0.50)" in report.table(run, 2)

    # against Gloo, latency over latency: but a barrier's cell is its speed (other / ours)
    settings = report.Settings([0, 1024], [2], ["asyncreduce", "gloo"], 0.1, 1, 1, None, False)
    run = report.Run(settings)
    for lib, barrier, allreduce in (("asyncreduce", 10.0, 20.0), ("gloo", 40.0, 400.0)):
        for nbytes, latency in ((0, barrier), (1024, allreduce)):
            run.results.append(
                report.Result(lib, 2, nbytes, latency, 1.0, "-", latency, [latency], 1, 1)
            )
    rows = {line.split()[0]: line.split() for line in report.table(run, 2).splitlines()[3:]}
    assert rows["barrier"][-2:] == ["4.00x", "4.00x"]  # lat/gloo, bw/gloo: 40 / 10
    assert rows["1"][-2:] == ["0.05x", "20.00x"]  # 1 KiB: 20 / 400, and 400 / 20


def test_small_ops_benchmark_takes_an_allreduce_apart(tmp_path: Path) -> None:
    """Each part is measured and none can exceed the whole: an engine on TCP is never faster
    than the raw exchange under it, and the protocol alone costs less than an operation
    that goes through it."""
    out = tmp_path / "small.json"
    command = [sys.executable, "-m", "asyncreduce", "bench", "small_ops", "--nprocs", "2",
               "--repeats", "1", "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "whole allreduce N=2" in done.stdout
    us = json.loads(out.read_text())["us"]
    assert 0 < us["floor_busy"] < us["n2_spin_latency"], us
    # the protocol alone costs less than an operation that goes through it: the progress
    # thread's path (a blocking one over TCP with the spin runs around it, Engine.run_direct, and
    # may well cost less than the protocol's frames and events)
    assert 0 < us["protocol_cpu"] < us["n2_sleep_cpu"], us
    assert 0 < us["call"] < us["n2_spin_latency"], us
    assert us["n2_sleep_latency"] > 0 and us["n2_sleep_cpu"] > 0, us
    assert us["n2_lane_latency"] > 0 and us["n2_lane_cpu"] > 0, us
    # the lane's whole call in one thread costs less than one operation on the engine's path
    # (not compared with the lane's real ranks: their CPU per operation is about the same),
    # and less with the C mailbox than with the Python one (which now costs about as much as
    # a direct run over TCP: not compared with it)
    assert 0 < us["lane_cpu"] < us["n2_spin_cpu"], us
    assert 0 < us["lane_cpu"] < us["lane_python_cpu"], us
