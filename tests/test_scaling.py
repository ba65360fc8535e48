"""``benchmarks/scaling.py``: the emulated ResNet-50, the ideal schedule, and a short real run.

The model tests need only PyTorch: the emulated ResNet-50 must have torchvision's parameter
shapes (25,557,032 parameters in 161 tensors, 107 layers), its emulated compute must take the
time it was given, and its gradients must arrive layer by layer from the output backwards, as
``DataParallel``'s hooks expect. The ideal schedule must give the seed's blocking number
(1 / (1 + 0.5) at K=4). The end-to-end test builds real emulated hosts (root, ``ip netns``
and ``tc`` needed; skipped otherwise) and runs the benchmark's quick path on 1 and 2 hosts with
a short emulated compute, then checks that every method produced a sane scaling.
"""

from __future__ import annotations

import json
import subprocess
import sys
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
import scaling_models  # noqa: E402

RESNET50_PARAMS = 25_557_032  # torchvision.models.resnet50(): sum(p.numel() ...)
METHODS = ("blocking", "backward", "forward", "double_buffer", "ddp", "local")


def _cluster() -> ModuleType:
    import harness

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
