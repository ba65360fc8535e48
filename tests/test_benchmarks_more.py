"""The concurrency, overlap and priority benchmarks end to end, on tiny sizes.

Each test runs ``python -m asyncreduce bench NAME`` as a user would (fresh worker processes,
asyncreduce only, N=2, JSON out) and checks the document's structure and that every time is a
positive finite number; the timings themselves are not judged. The overlap benchmark also runs
its reference (``tcp``: raw TCP streams, no library) on one host, and once on two emulated hosts
(``--quick --hosts 2 --rate 1gbit``, every library installed and the reference by default;
root, ``ip`` and ``tc`` needed, skipped otherwise), where every row must say where it ran and the
reference row must say it is one; without a way to emulate hosts, ``--hosts`` must refuse at
once, saying why. The reference's sockets also meet and move bytes in a ring of three, in
threads of this process.
"""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
LIBS = ("asyncreduce", "gloo", "mpi")
REFERENCE = "tcp"  # the overlap benchmark's raw TCP streams


def _load(name: str, path: Path) -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # the harness, which loads the others by path
    import harness

    return harness.load_module(name, path)


def _cluster() -> ModuleType:
    return _load("asyncreduce_scripts.cluster", ROOT / "scripts" / "cluster.py")


def _run(name: str, tmp_path: Path, *options: str) -> dict[str, Any]:
    return _run_with_output(name, tmp_path, *options)[0]


def _run_with_output(name: str, tmp_path: Path, *options: str) -> tuple[dict[str, Any], str]:
    """The JSON document and the printed report of ``asyncreduce bench NAME`` (N=2)."""
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
    return document, done.stdout


def _positive(*values: Any) -> bool:
    return all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values)


def test_concurrency_benchmark_writes_json(tmp_path: Path) -> None:
    rounds = 3
    document, report = _run_with_output(
        "concurrency", tmp_path, "--tensors", "3", "--elements", "64K", "--rounds", str(rounds)
    )
    assert document["settings"]["tensors"] == 3 and document["settings"]["elements"] == 65536
    assert document["settings"]["rounds"] == rounds
    rows = {r["variant"]: r for r in document["results"]}
    plain = {"sequential", "threads", "requests"}
    assert set(rows) == plain | {f"window-{v}" for v in plain}
    for r in rows.values():
        assert r["lib"] == "asyncreduce" and r["nprocs"] == 2
        assert r["verified"] is True, r  # every rank held the right sums
        assert _positive(r["seconds"], *r["rounds_s"]) and len(r["rounds_s"]) == rounds
        assert r["seconds"] == pytest.approx(sorted(r["rounds_s"])[rounds // 2])  # the median
    for index in range(rounds):  # every round ran every variant once, in the shared order
        order = sorted(rows, key=lambda v: rows[v]["positions"][index])
        assert [rows[v]["positions"][index] for v in order] == list(range(len(rows)))
        assert order == _concurrency().round_order(list(rows), index)
    summary = document["summary"]["2"]
    for family in ("asyncreduce", "asyncreduce window"):  # each against its own sequential
        mine = summary[family]
        assert mine["best_variant"] in rows and _positive(mine["best_s"], mine["sequential_s"])
        assert mine["best_variant"].startswith("window-") == family.endswith("window")
        assert _positive(mine["concurrent_vs_sequential"], mine["worst_concurrent_vs_sequential"])
        prefix = "window-" if family.endswith("window") else ""
        seq = rows[prefix + "sequential"]["rounds_s"]
        for variant in ("threads", "requests"):  # speed-up per round, against the same round
            ups = [a / b for a, b in zip(seq, rows[prefix + variant]["rounds_s"], strict=True)]
            stats = mine["vs_sequential"][prefix + variant]
            assert stats["median"] == pytest.approx(sorted(ups)[rounds // 2])
            assert (stats["min"], stats["max"]) == (
                pytest.approx(min(ups)),
                pytest.approx(max(ups)),
            )
    assert "median ms" in report and "min-max ms" in report and "vs seq" in report
    assert f"over {rounds} rounds" in report and "every median at least 1.00x" in report
    line = next(x for x in report.splitlines() if "10 threads" not in x and "iallreduce x10 +" in x)
    assert re.search(r"\d-\d.*\dx +\d\.\d\d-\d\.\d\d +ok$", line), line  # both spreads
    _concurrency_replays(tmp_path / "concurrency.json", report)


def _concurrency() -> ModuleType:
    return _load("asyncreduce_bench_concurrency_rank", BENCHMARKS / "concurrency_rank.py")


def _concurrency_replays(saved: Path, report: str) -> None:
    """``--from-json`` prints the same tables; a document of the old format is refused."""
    replay = _bench("concurrency", "--from-json", str(saved))
    assert replay.returncode == 0, replay.stderr
    assert report.split("\n(total")[0] in replay.stdout
    old = json.loads(saved.read_text())
    old["settings"]["repeats"] = old["settings"].pop("rounds")
    for r in old["results"]:
        r["repeats_s"] = r.pop("rounds_s")
    (saved.parent / "old.json").write_text(json.dumps(old))
    refused = _bench("concurrency", "--from-json", str(saved.parent / "old.json"))
    assert refused.returncode == 2 and "old format" in refused.stderr, refused


def _bench(name: str, *options: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "asyncreduce", "bench", name, *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_concurrency_rounds_option() -> None:
    """``--rounds`` (``--repeats`` is its alias), 9 by default and 3 with ``--quick``; every
    round's order is a permutation that each rank computes alike."""
    bench = _load("asyncreduce_bench_concurrency", BENCHMARKS / "concurrency.py")
    parser = bench._parser()
    rounds = [
        bench._settings(parser.parse_args(argv)).rounds
        for argv in ([], ["--quick"], ["--rounds", "7"], ["--repeats", "4"])
    ]
    assert rounds == [9, 3, 7, 4]
    names = ["sequential", "threads", "requests", "window-sequential"]
    orders = [_concurrency().round_order(names, index) for index in range(5)]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert len({tuple(order) for order in orders}) > 1  # shuffled, not one fixed order


def _expected(row: dict[str, Any]) -> float:
    """The overlap, raw, from the row's own medians."""
    t_comm, t_compute = row["t_comm_s"], row["t_compute_s"]
    return float(1 - (row["t_both_s"] - max(t_comm, t_compute)) / min(t_comm, t_compute))


def _check_overlap_row(r: dict[str, Any], repeats: int) -> None:
    """Finite positive times, an overlap in [0, 1] and the formula, from the row itself."""
    assert r["matmuls"] >= 1 and _positive(r["matmul_calibrated_s"], r["comm_estimate_s"])
    assert _positive(r["t_comm_s"], r["t_compute_s"], r["t_both_s"], r["compute_in_both_s"])
    for key in ("comm_repeats_s", "compute_repeats_s", "both_repeats_s"):
        assert len(r[key]) == repeats and _positive(*r[key]), (key, r)
    assert 0.0 <= r["overlap"] <= 1.0 and math.isfinite(r["overlap_raw"])
    assert r["overlap_raw"] == pytest.approx(_expected(r))
    assert r["overlap"] == pytest.approx(min(1.0, max(0.0, r["overlap_raw"])))


def _check_reference(r: dict[str, Any], summary: dict[str, Any], report: str) -> None:
    """The reference row says it is one, in the row, the summary and the table."""
    assert r["lib"] == REFERENCE and r["reference"] is True, r
    assert r["call"] == "raw TCP streams, no reduction"
    assert r["bytes_each_way"] == r["bytes"]  # N=2: 2(N-1)/N of the buffer = all of it
    assert summary[REFERENCE]["reference"] is True
    assert summary[REFERENCE]["overlap"] == r["overlap"]
    assert "tcp (reference)" in report and "raw TCP streams, no reduction" in report
    assert "tcp (reference): no library and no reduction" in report


def test_overlap_benchmark_writes_json(tmp_path: Path) -> None:
    document, report = _run_with_output(
        "overlap", tmp_path, "--bytes", "1M", "--repeats", "2", "--matrix", "64",
        "--libs", f"asyncreduce,{REFERENCE}",
    )  # fmt: skip
    rows = {r["lib"]: r for r in document["results"]}
    assert sorted(rows) == ["asyncreduce", REFERENCE] and len(document["results"]) == 2
    r = rows["asyncreduce"]
    assert r["call"] == "iallreduce + wait" and r["reference"] is False
    assert "bytes_each_way" not in r
    summary = document["summary"]["2"]
    assert summary["asyncreduce"]["overlap"] == r["overlap"]
    assert summary["asyncreduce"]["reference"] is False
    _check_reference(rows[REFERENCE], summary, report)
    for r in rows.values():
        _check_overlap_row(r, repeats=2)
        assert (r["hosts"], r["rate"], r["rate_bps"], r["mtu"]) == (1, None, None, None)
    assert document["settings"]["hosts"] is None and document["settings"]["mtu"] is None


def test_overlap_reference_is_opt_in_on_one_host() -> None:
    overlap = _load("asyncreduce_benchmarks.overlap", BENCHMARKS / "overlap.py")
    one_host = overlap._settings(overlap._parser().parse_args([]))
    assert one_host.libs == list(LIBS)
    hosts = overlap._settings(overlap._parser().parse_args(["--hosts", "2"]))
    assert hosts.libs == [*LIBS, REFERENCE]
    chosen = overlap._settings(overlap._parser().parse_args(["--hosts", "2", "--libs", "gloo"]))
    assert chosen.libs == ["gloo"]


def test_raw_tcp_ring_of_three_meets_moves_and_agrees() -> None:
    """Three reference ranks in threads: each receives its left neighbour's bytes, exactly a
    ring allreduce's share each way (2(N-1)/N, more than the buffer: cycled over), and max
    and barrier agree."""
    rawtcp = _load("asyncreduce_benchmarks.rawtcp", BENCHMARKS / "rawtcp.py")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        master = ("127.0.0.1", probe.getsockname()[1])
    nbytes = (1 << 20) + 12
    found: dict[int, tuple[float, bytes, int]] = {}

    def rank(r: int) -> None:
        me = rawtcp.RawTcpRank(r, 3, master)
        streams = me.streams(nbytes)
        streams.sending[:] = bytes([r + 1]) * nbytes
        for _ in range(2):
            me.barrier()
            streams.wait(streams.post())
        found[r] = (me.max(float(10 * r)), bytes(streams.receiving), streams.each_way)
        me.barrier()
        me.close()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(found) == [0, 1, 2], "a rank failed or hung"
    for r, (largest, received, each_way) in found.items():
        assert largest == 20.0 and each_way == rawtcp.ring_bytes(3, nbytes) == 4 * nbytes // 3
        assert received == bytes([(r - 1) % 3 + 1]) * nbytes, f"rank {r} got someone else's"


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
    ran = [lib for lib in (*LIBS, REFERENCE) if lib not in document["skipped"]]
    assert "asyncreduce" in ran and REFERENCE in ran  # the reference runs by default here
    rows = {r["lib"]: r for r in document["results"]}
    assert sorted(rows) == sorted(ran) and len(document["results"]) == len(ran)
    summary = document["summary"]["2 hosts @ 1gbit"]
    for lib, r in rows.items():
        assert (r["nprocs"], r["hosts"], r["rate"], r["mtu"]) == (2, 2, "1gbit", 1500), r
        assert r["rate_bps"] == 1e9 and r["bytes"] == 4 << 20
        _check_overlap_row(r, repeats=3)
        assert summary[lib]["overlap"] == r["overlap"]
        assert r["reference"] is (lib == REFERENCE) and summary[lib]["reference"] is r["reference"]
    _check_reference(rows[REFERENCE], summary, done.stdout)


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
