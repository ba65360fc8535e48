"""``benchmarks/scaling.py``: the emulated ResNet-50, the ideal schedule, and a short real run.

The model tests need only PyTorch: the emulated ResNet-50 must have torchvision's parameter
shapes (25,557,032 parameters in 161 tensors, 107 layers), its emulated compute must take the
time it was given, and its gradients must arrive layer by layer from the output backwards, as
``DataParallel``'s hooks expect. The ideal schedule must give the seed's blocking number
(1 / (1 + 0.5) at K=4). The end-to-end test builds real emulated hosts (root, ``ip netns``
and ``tc`` needed; skipped otherwise) and runs the benchmark's quick path on 1 and 2 hosts with
a short emulated compute, then checks that every method produced a sane scaling.

Where the time goes (``scaling_usage``): the per-thread CPU reader must give a spinning thread
its CPU and a sleeping one none, the wait for a core must show two threads sharing one CPU,
the interface counters must grow with the bytes that cross an interface (loopback here, no
namespace needed), the window's split must add up, ``gather``'s
rows must survive the sum, and the report must print the second table from a synthetic run,
with "-" for results saved before these were measured.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPT = BENCHMARKS / "scaling.py"
sys.path.insert(0, str(BENCHMARKS))
import harness  # noqa: E402
import scaling_models  # noqa: E402
import scaling_report  # noqa: E402
import scaling_usage  # noqa: E402
from harness import ranks  # noqa: E402

RESNET50_PARAMS = 25_557_032  # torchvision.models.resnet50(): sum(p.numel() ...)
METHODS = ("blocking", "backward", "forward", "double_buffer", "ddp", "local")


def _cluster() -> ModuleType:
    return harness.load_module("asyncreduce_scripts.cluster", ROOT / "scripts" / "cluster.py")


def test_emulated_resnet50_has_torchvision_shapes() -> None:
    layers = scaling_models.resnet50_layers()
    assert len(layers) == 107
    kinds = [x.kind for x in layers]
    assert (kinds.count("conv"), kinds.count("bn"), kinds.count("fc")) == (53, 53, 1)
    assert sum(x.params for x in layers) == RESNET50_PARAMS
    by_name = {x.name: x for x in layers}
    assert by_name["conv1"].shapes == ((64, 3, 7, 7),)
    assert by_name["layer2.0.conv2"].shapes == ((128, 128, 3, 3),)
    assert by_name["layer4.0.downsample.0"].shapes == ((2048, 1024, 1, 1),)
    assert by_name["fc"].shapes == ((1000, 2048), (1000,))
    gmacs = sum(x.flops for x in layers) / 2e9
    assert 3.9 < gmacs < 4.3  # ResNet-50's well-known ~4.1 G multiply-adds

    model = scaling_models.EmulatedResNet50(seconds=0.0)
    tensors = list(model.parameters())
    assert len(tensors) == 161 and sum(p.numel() for p in tensors) == RESNET50_PARAMS


def test_emulated_compute_takes_its_time_and_gradients_arrive_in_reverse() -> None:
    model = scaling_models.EmulatedResNet50(seconds=0.3)
    order: list[int] = []
    for index, layer in enumerate(model.layers):
        weight: Any = layer.weight
        weight.register_post_accumulate_grad_hook(lambda p, i=index: order.append(i))
    began = time.perf_counter()
    model(model.example_input()).sum().backward()
    took = time.perf_counter() - began
    assert 0.3 <= took < 2.0
    assert order == list(reversed(range(107)))
    assert all(layer.weight.grad is not None for layer in model.layers)


def test_ideal_schedule_gives_the_seeds_blocking_number() -> None:
    link_s_per_byte = 1.5 * 8 / 0.95e9  # K=4, ring, 1 Gbit/s at the TCP ceiling
    compute = 4 * RESNET50_PARAMS * link_s_per_byte / 0.5  # blocking comm = 0.5 x compute
    blocking = compute / scaling_models.ideal_period("blocking", compute, link_s_per_byte)
    forward = compute / scaling_models.ideal_period("forward", compute, link_s_per_byte)
    assert blocking == pytest.approx(2 / 3, abs=0.005)
    assert forward == pytest.approx(1.0, abs=0.005)


@pytest.mark.skipif(
    _cluster().available() is not None, reason=f"no emulated hosts here: {_cluster().available()}"
)
def test_quick_run_on_one_and_two_hosts(tmp_path: Path) -> None:
    out = tmp_path / "scaling.json"
    command = [
        sys.executable, str(SCRIPT), "--quick", "--models", "resnet50", "--compute", "0.3",
        "--tcp-seconds", "0", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads(out.read_text())
    assert document["benchmark"] == "scaling" and document["failures"] == []
    scaling = document["summary"]["resnet50"]
    assert set(scaling) == set(METHODS), scaling
    for method, per_hosts in scaling.items():
        assert per_hosts["1"] == 1.0
        assert 0 < per_hosts["2"] <= 1.5, (method, per_hosts)
    for r in document["results"]:
        if r["hosts"] == 2 and r["method"] not in ("ddp", "local"):
            assert 0.0 <= r["hidden_share"] <= 1.0 and r["comm_s"] > 0, r
    assert "forward" in done.stdout and "ideal" in done.stdout


def _thread_cpu(work: Any) -> tuple[float, float, float]:
    """Run ``work`` in a real thread and, while it is still alive afterwards, read its CPU as
    ``thread_cpu_s`` and ``thread_ticks_s`` see it and as it saw itself (``thread_time``)."""
    worked, release, box = threading.Event(), threading.Event(), {}

    def body() -> None:
        work()
        box["own"] = time.thread_time()
        worked.set()
        release.wait(10)

    thread = threading.Thread(target=body, name="test-usage")
    thread.start()
    try:
        assert worked.wait(10)
        assert thread.native_id is not None
        seen = scaling_usage.thread_cpu_s(thread.native_id)
        ticks = scaling_usage.thread_ticks_s(thread.native_id)
    finally:
        release.set()
        thread.join(10)
    return seen, ticks, box["own"]


def test_thread_cpu_reader_sees_a_busy_thread_and_not_a_sleeping_one() -> None:
    def spin() -> None:  # 0.2 s of CPU, however busy the machine's 2 cores are
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass

    busy, busy_ticks, busy_own = _thread_cpu(spin)
    idle, idle_ticks, _ = _thread_cpu(lambda: time.sleep(0.2))
    assert busy >= 0.2 and busy == pytest.approx(busy_own, abs=0.01)
    assert busy_ticks == pytest.approx(busy, abs=0.03)  # ticks of 10 ms
    assert idle < 0.02 and idle_ticks < 0.03
    assert busy > idle + 0.15


def test_waits_for_a_core_show_two_threads_on_one_cpu_and_not_a_sleeping_one() -> None:
    """Two threads that spin on the same CPU take turns: each waits for it about as long as
    it runs. A sleeping thread is never runnable, so it waits for nothing. (The spinners hash
    a megabyte at a time, which hashlib does without the GIL: else they would take turns at
    the GIL, asleep, instead of at the CPU.)"""
    cpu, stop, ids, data = min(os.sched_getaffinity(0)), threading.Event(), [], bytes(1 << 20)

    def spin() -> None:
        os.sched_setaffinity(threading.get_native_id(), {cpu})
        ids.append(threading.get_native_id())
        while not stop.is_set():
            hashlib.sha256(data).digest()

    spinners = [threading.Thread(target=spin) for _ in range(2)]
    sleeper = threading.Thread(target=stop.wait, args=(5,))
    for thread in [*spinners, sleeper]:
        thread.start()
    try:
        time.sleep(0.5)
        assert sleeper.native_id is not None and len(ids) == 2
        waited = [scaling_usage.thread_waited_s(tid) for tid in ids]
        slept = scaling_usage.thread_waited_s(sleeper.native_id)
    finally:
        stop.set()
        for thread in [*spinners, sleeper]:
            thread.join(10)
    if any(math.isnan(w) for w in waited):
        pytest.skip("this kernel keeps no schedstat")
    assert sum(waited) >= 0.3, waited  # (0.5 s of the CPU for two: about 0.25 s each)
    assert slept < 0.05  # (at most a slice behind the spinners, once, as it starts)


def test_thread_cpu_of_a_thread_that_is_gone_is_zero() -> None:
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()  # Python's part is over; the kernel's thread may end a moment later
    assert thread.native_id is not None
    task, deadline = Path(f"/proc/self/task/{thread.native_id}"), time.monotonic() + 5
    while task.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not task.exists()
    assert scaling_usage.thread_cpu_s(thread.native_id) == 0.0
    assert scaling_usage.thread_ticks_s(thread.native_id) == 0.0
    assert scaling_usage.thread_waited_s(thread.native_id) == 0.0


def test_engine_threads_are_found_by_name() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name=f"{scaling_usage.ENGINE_PREFIX}7")
    thread.start()
    try:
        assert thread.native_id in scaling_usage.engine_native_ids()
    finally:
        stop.set()
        thread.join()
    assert thread.native_id not in scaling_usage.engine_native_ids()


def test_loopback_counters_grow_with_the_bytes_sent() -> None:
    payload = b"x" * (1 << 20)
    tx0, rx0 = scaling_usage.interface_bytes("lo")
    server = socket.create_server(("127.0.0.1", 0))
    with server, socket.create_connection(server.getsockname()) as out:
        peer, _ = server.accept()
        with peer:
            out.sendall(payload)
            got = 0
            while got < len(payload):
                got += len(peer.recv(1 << 16))
    tx1, rx1 = scaling_usage.interface_bytes("lo")
    assert tx1 - tx0 >= len(payload) and rx1 - rx0 >= len(payload)  # lo: sent is received


def test_link_bytes_add_every_interface_but_loopback(tmp_path: Path) -> None:
    for name, tx, rx in (("lo", 1000, 1000), ("eth0", 5, 7), ("eth1", 10, 20)):
        stats = tmp_path / name / "statistics"
        stats.mkdir(parents=True)
        (stats / "tx_bytes").write_text(f"{tx}\n")
        (stats / "rx_bytes").write_text(f"{rx}\n")
    assert scaling_usage.link_bytes(tmp_path) == (15, 27)
    assert scaling_usage.link_bytes(tmp_path / "absent") == (0, 0)


def test_window_splits_the_process_cpu() -> None:
    before = scaling_usage.Usage(1.0, {11: 2.0, 12: 5.0}, 10.0, 3.0, {11: 0.5, 12: 1.0}, 100,
                                 200, 50.0)  # fmt: skip
    after = scaling_usage.Usage(1.5, {11: 2.25, 13: 9.0}, 11.0, 3.125, {11: 0.75, 13: 4.0}, 1100,
                                3200, 52.0)  # fmt: skip
    got = scaling_usage.window(before, after)
    assert list(got) == list(scaling_usage.USAGE_FIELDS)
    assert got == {  # thread 11 alone was alive at both ends
        "train_cpu_s": 0.5, "progress_cpu_s": 0.25, "other_cpu_s": 0.25, "process_cpu_s": 1.0,
        "train_waited_s": 0.125, "progress_waited_s": 0.25,
        "tx_bytes": 1000.0, "rx_bytes": 3000.0, "window_s": 2.0,
    }  # fmt: skip
    here = scaling_usage.window(scaling_usage.Usage.now(), scaling_usage.Usage.now())
    assert here["window_s"] > 0 and here["train_cpu_s"] >= 0  # reads of the clocks, in order:
    assert here["process_cpu_s"] == pytest.approx(here["train_cpu_s"], abs=0.01)  # tens of us


def test_gather_rows_survive_the_sum_over_ranks() -> None:
    import numpy as np

    mine = [[0.5, 1e12, -3.0], [2.0, 7.0, 0.0], [1 / 3, 0.1, 9.5]]
    boxes = [ranks._rows(np.zeros(9), r, values) for r, values in enumerate(mine)]
    assert ranks._split(sum(boxes).tolist(), 3) == mine  # what allreduce(sum) leaves


def _usage(process: list[float], tx: list[float]) -> dict[str, Any]:
    k = len(process)
    return {
        "train_cpu_s": [0.2] * k, "progress_cpu_s": [0.4] * k, "other_cpu_s": [0.0] * k,
        "process_cpu_s": process, "train_waited_s": [0.06] * k, "progress_waited_s": [0.02] * k,
        "tx_bytes": tx, "rx_bytes": [b / 2 for b in tx], "window_s": [2.0] * k, "cpus": 2,
    }  # fmt: skip


def test_report_prints_where_the_time_goes() -> None:
    settings = {
        "hosts": [1, 2], "models": ["resnet50"], "methods": ["forward", "ddp"],
        "rate": "1gbit", "rate_bps": 1e9, "ratio": 0.5, "compute_s": 1.0, "cnn_batch": 16,
        "warmup": 1, "iterations": 2, "quick": False,
    }  # fmt: skip
    common = {"model": "resnet50", "iterations": 2, "warmup": 1, "seconds": 2.0, "late_s": 0.01}
    results = [
        {**common, "method": "forward", "hosts": 1, "usage": _usage([0.8], [0.0])},
        # 2 s for 2 iterations; 125 MB/s x 2 s = 250 MB: 50% and 100% tx, half that rx
        {**common, "method": "forward", "hosts": 2, "usage": _usage([0.8, 1.2], [125e6, 250e6])},
        {**common, "method": "ddp", "hosts": 2},  # saved before usage was measured
        {**common, "method": "ddp", "hosts": 1, "usage": _unready(_usage([0.8], [0.0]))},
    ]
    run = harness.Run("scaling", settings, results)
    text = scaling_report.report(run, {**harness.machine_info(), "library": {}})
    lines = text.splitlines()
    head = next(
        i for i, line in enumerate(lines) if line.startswith("method") and "train CPU" in line
    )
    assert lines[head].split("  ")[0] == "method" and lines[head].endswith("link rx")
    assert "where the time goes" in lines[head - 1]
    rows = {tuple(line.split()[:2]): line.split() for line in lines[head + 1 : head + 5]}
    # forward K=1: 0.1 train, 0.2 progress, 0 other, 0.4 process s/it; 0.03 and 0.01 s/it
    # ready; 0.4 / (2 x 1.0) = 20%
    assert rows["forward", "1"] == ["forward", "1", "0.100", "0.200", "0.000", "0.400", "0.030",
                                    "0.010", "20.0%", "-", "-"]  # fmt: skip
    # K=2: process 0.4 and 0.6 s/it, 1.0 / 2 = 50% of the cores; tx 75%, rx 37.5%
    assert rows["forward", "2"] == ["forward", "2", "0.100", "0.200", "0.000", "0.500", "0.030",
                                    "0.010", "50.0%", "75.0%", "37.5%"]  # fmt: skip
    assert rows["ddp", "2"] == ["ddp", "2"] + ["-"] * 9
    # saved before the waits for a core were measured, or where the kernel keeps no schedstat
    assert rows["ddp", "1"] == ["ddp", "1", "0.100", "0.200", "0.000", "0.400", "-", "-",
                                "20.0%", "-", "-"]  # fmt: skip
    # at the seed's ratio the target is 95%; where communication is at least compute, 90%
    assert "forward scales 100.0% at K=2 (target 95%)" in text
    text = scaling_report.report(dataclasses.replace(run, settings={**settings, "ratio": 1.0}),
                                 {**harness.machine_info(), "library": {}})  # fmt: skip
    assert "forward scales 100.0% at K=2 (target 90%)" in text
    assert "the target here: forward >= 90% and 10 points above ddp" in text


def _unready(usage: dict[str, Any]) -> dict[str, Any]:
    """``usage`` as a run saved before the waits for a core were measured, with one as the
    kernel without schedstat gives it (NaN)."""
    del usage["train_waited_s"]
    return {**usage, "progress_waited_s": [float("nan")]}


def test_trace_summary_reads_waits_per_bucket_and_the_comm_share(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """scripts/trace_summary.py over a timeline written by asyncreduce's own Timeline: three
    1 s steps, the first one skipped; waits per bucket and the union of overlapping allreduces."""
    import importlib.util

    from asyncreduce.trace import Timeline

    spec = importlib.util.spec_from_file_location(
        "trace_summary", Path(__file__).parents[1] / "scripts" / "trace_summary.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    timeline = Timeline(0)
    origin = timeline._origin
    for i in range(3):
        at = origin + i
        timeline.add("step", "train", at + 0.9, at + 1.0)
        timeline.add("wait layer1", "train", at + 0.1, at + 0.15)
        timeline.add("wait fc", "train", at + 0.2, at + 0.22)
        timeline.add("allreduce layer1", "comm", at + 0.3, at + 0.6)  # these two overlap:
        timeline.add("allreduce fc", "comm", at + 0.5, at + 0.7)  # 0.4 s in flight in all
    timeline.write(tmp_path / "resnet50-forward-K2-rank0.json")
    found = module.summary(module.events_of(tmp_path / "resnet50-forward-K2-rank0.json"), 1, 5)
    assert found["iterations"] == 2
    assert found["iteration_s"] == pytest.approx(1.0)
    assert found["wait_s"] == pytest.approx(0.07)
    assert [name for name, _ in found["longest"]] == ["layer1", "fc"]
    assert found["longest"][0][1] == pytest.approx(0.05)
    assert found["comm_busy"] == pytest.approx(0.4)
    assert module.main([str(tmp_path), "--skip", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 iterations of 1.000 s" in out and "layer1 50.0" in out and "40% of the time" in out
