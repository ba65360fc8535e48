"""docs/porting.md is true: its code is the example's, and its commands print what it shows.

Every ``$ asyncreduce run ...`` line of the page's console block is run for real, in order
(the ``--resume`` run continues from the checkpoint of the run before it), and must print the
lines under it, numbers within the last printed digit (the exact modes are also held to
DDP's result within 1e-6 by test_torch_ddp.py).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs/porting.md").read_text()
EXAMPLE = (ROOT / "examples/port_from_ddp.py").read_text().splitlines()


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", PAGE, re.M | re.S)


def test_the_pages_code_is_the_examples_code() -> None:
    found = blocks("python")
    assert len(found) >= 3, "the page lost its code"
    for block in found:
        lines = block.splitlines()
        starts = [i for i, line in enumerate(EXAMPLE) if line.strip() == lines[0].strip()]
        assert any(
            textwrap.dedent("\n".join(EXAMPLE[i : i + len(lines)])) == "\n".join(lines)
            for i in starts
        ), f"not in examples/port_from_ddp.py as written:\n{block}"


def numbers(line: str) -> tuple[str, list[float]]:
    return re.sub(r"\d+\.\d+", "#", line), [float(n) for n in re.findall(r"\d+\.\d+", line)]


@pytest.mark.timeout(300)
def test_every_command_on_the_page_prints_what_the_page_shows(tmp_path: Path) -> None:
    (console,) = blocks("console")
    runs: list[tuple[str, list[str]]] = []
    for line in console.splitlines():
        if line.startswith("$ "):
            runs.append((line[2:], []))
        else:
            runs[-1][1].append(line)
    assert len(runs) == 7, runs
    checkpoint = str(tmp_path / "ckpt.pt")
    for command, shown in runs:
        argv = shlex.split(command)
        assert argv[0] == "asyncreduce"
        full = [sys.executable, "-m", *argv, "--checkpoint", checkpoint]
        out = subprocess.run(full, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{command}:\n{out.stdout}\n{out.stderr}"
        printed = [line for line in out.stdout.splitlines() if line.startswith("[0] epoch")]
        assert len(printed) == len(shown), f"{command}:\n{out.stdout}"
        for got, want in zip(printed, shown, strict=True):
            (got_text, got_numbers), (want_text, want_numbers) = numbers(got), numbers(want)
            assert got_text == want_text, (command, got, want)
            assert got_numbers == pytest.approx(want_numbers, abs=1.5e-4), (command, got, want)
