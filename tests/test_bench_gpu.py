"""``asyncreduce bench gpu --standin``: the GPU benchmark's plumbing, run for real on the CPU.

The run starts 2 ranks as a user would (``python -m asyncreduce bench gpu``), each with the CPU
stand-in for a GPU registered inside it (``asyncreduce.torch.standin``), and checks its JSON:
every row is there; DataParallel's exact modes (and DDP over the asyncreduce backend) end with
the parameters of DDP over Gloo, bit for bit; on the training thread no step synchronizes and
none moves data outside the device; every bucket goes out and comes back once per step; the
staged rows have numbers; every number says it is the stand-in's; and every target of the
issue, a GPU target, is "unmeasured". The timings themselves are not judged.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.torch]

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_setup import EXACT, MODES, ROWS, STANDIN  # noqa: E402
from gpu_staged import KINDS  # noqa: E402

_RUN: dict[str, Any] = {}


def run_standin(tmp_path: Path) -> tuple[dict[str, Any], str]:
    """The stand-in run, once per session: (its JSON, its stdout)."""
    if not _RUN:
        out = tmp_path / "gpu.json"
        command = [
            sys.executable,
            "-m",
            "asyncreduce",
            "bench",
            "gpu",
            "--standin",
            "--ranks",
            "2",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "gpu.png"),
        ]
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=90, check=False,
                              cwd=ROOT)  # fmt: skip
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert (tmp_path / "gpu.png").stat().st_size > 0
        _RUN.update(doc=json.loads(out.read_text()), stdout=done.stdout,
                    seconds=time.monotonic() - started)  # fmt: skip
    return _RUN["doc"], _RUN["stdout"]


@pytest.mark.timeout(120)
def test_every_row_is_there_and_says_it_is_the_stand_in(tmp_path: Path) -> None:
    doc, stdout = run_standin(tmp_path)
    assert doc["standin"] is True and doc["measured_on"] == STANDIN
    assert STANDIN in stdout and "never a GPU's" in stdout
    rows = {r["key"]: r for r in doc["rows"]}
    assert list(rows) == list(ROWS)
    for key, row in rows.items():
        assert row["measured_on"] == STANDIN, key
        if key in ("ddp_nccl", "dp_nccl"):
            assert row["status"].startswith("skipped: needs 2 GPUs"), row
            continue
        assert row["status"] == "ok", row
        assert row["steps_per_s"] > 0, row
        assert row["ranks_agree"] == (key != "ceiling"), row  # its ranks never average
    assert 0.0 <= rows["backward"]["hidden_share"] <= 1.0


@pytest.mark.timeout(120)
def test_exact_modes_end_with_ddp_over_gloos_parameters(tmp_path: Path) -> None:
    rows = {r["key"]: r for r in run_standin(tmp_path)[0]["rows"]}
    reference = rows["ddp_gloo"]["digest"]
    for key in (*EXACT, "ddp_asyncreduce"):
        assert rows[key]["digest"] == reference, (key, rows[key]["digest"], reference)
        assert rows[key]["param_check"] == "equal", rows[key]
    assert rows["ddp_gloo"]["param_check"] == "reference"
    steps = {row["steps_total"] for row in rows.values() if row["status"] == "ok"}
    assert len(steps) == 1, steps  # every row trained as many steps: the digests compare


@pytest.mark.timeout(120)
def test_no_syncs_no_reads_and_one_copy_each_way_per_bucket(tmp_path: Path) -> None:
    rows = {r["key"]: r for r in run_standin(tmp_path)[0]["rows"]}
    for mode in MODES:
        counts = rows[mode]["counts"]
        assert counts["syncs"] == 0, (mode, counts)
        assert counts["reads"] == 0, (mode, counts["reads_found"])
        assert counts["buckets"] >= 1, (mode, counts)
        assert counts["to_host"] == counts["to_device"] == counts["buckets"], (mode, counts)
    assert rows["forward"]["counts"]["buckets"] == 3  # one per layer of the tiny MLP


@pytest.mark.timeout(120)
def test_staged_rows_have_numbers(tmp_path: Path) -> None:
    doc = run_standin(tmp_path)[0]
    assert [e["bytes"] for e in doc["staged"]] == doc["settings"]["sizes"]
    assert doc["staged_failures"] == []
    for entry in doc["staged"]:
        assert entry["errors"] == {} and entry["measured_on"] == STANDIN, entry
        for kind in KINDS:
            assert entry["ms"][kind] is not None and entry["ms"][kind] > 0, (kind, entry)
        assert entry["staged_vs_host"] > 0 and entry["staged_vs_gloo"] > 0


@pytest.mark.timeout(120)
def test_gpu_targets_are_unmeasured_on_the_stand_in(tmp_path: Path) -> None:
    doc, stdout = run_standin(tmp_path)
    verdicts = doc["verdicts"]
    assert {"backward_vs_gloo", "backward_vs_ceiling", "forward_vs_gloo",
            "double_buffer_vs_gloo", "staged_vs_host", "staged_vs_gloo", "no_host_syncs",
            "ddp_asyncreduce_vs_gloo", "exact", "nccl"} <= set(verdicts)  # fmt: skip
    for name, verdict in verdicts.items():
        assert verdict["verdict"] == "unmeasured", (name, verdict)
    assert " met " not in stdout and "not met" not in stdout
    assert _RUN["seconds"] < 90


def test_resnet50_without_torchvision_has_torchvisions_parameters() -> None:
    """The network the GPU run trains where torchvision is missing: ResNet-50's 161 tensors."""
    import torch

    import gpu_models
    import scaling_models

    model = gpu_models.ResNet50Like()
    params = dict(model.named_parameters())
    want = {f"{layer.name}.{kind}": shape for layer in scaling_models.resnet50_layers()
            for kind, shape in zip(("weight", "bias"), layer.shapes, strict=False)}  # fmt: skip
    assert {n: tuple(p.shape) for n, p in params.items()} == want
    assert sum(p.numel() for p in params.values()) == 25_557_032
    with torch.no_grad():
        assert model.eval()(torch.zeros(1, 3, 64, 64)).shape == (1, 1000)
