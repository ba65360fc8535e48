"""What a fresh user installs: the license, the changelog, the extras, the Python version."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the suite's own interpreter)

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_license_file_is_the_license_the_metadata_names() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert PROJECT["license"] == "MIT"
    assert text.startswith("MIT License"), text[:40]
    assert "Permission is hereby granted, free of charge" in text


def test_the_changelog_has_the_current_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(PROJECT['version'])}\b", text, re.M), text[:200]


def test_the_torch_extra_is_a_range_that_holds_the_tested_build() -> None:
    (spec,) = [s for s in PROJECT["optional-dependencies"]["torch"] if s.startswith("torch")]
    low = re.search(r">=\s*([\d.]+)", spec)
    high = re.search(r"<\s*([\d.]+)", spec)
    assert low and high and "==" not in spec, spec
    tested = (2, 13, 0)  # what scripts/setup.sh installs
    assert tuple(map(int, low.group(1).split("."))) <= tested, spec
    assert tuple(map(int, high.group(1).split(".")))[:2] > tested[:2], spec
    assert "torch==2.13.0" in (ROOT / "scripts/setup.sh").read_text()


def test_readme_and_metadata_name_the_same_oldest_python() -> None:
    oldest = re.fullmatch(r">=\s*3\.(\d+)", PROJECT["requires-python"])
    assert oldest, PROJECT["requires-python"]
    minor = int(oldest.group(1))
    readme = (ROOT / "README.md").read_text()
    claims = set(re.findall(r"Python 3\.(\d+)\+", readme))
    assert claims == {str(minor)}, f"README says Python 3.{claims}+, metadata 3.{minor}"
    tools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert tools["ruff"]["target-version"] == f"py3{minor}"
    assert tools["mypy"]["python_version"] == f"3.{minor}"


def test_asyncreduce_torch_without_torch_says_what_to_install() -> None:
    code = "import sys; sys.modules['torch'] = None\nimport asyncreduce.torch"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode != 0
    assert "pip install 'asyncreduce[torch]'" in out.stderr, out.stderr[-500:]
    assert "import asyncreduce as ar" not in out.stderr  # the core imported fine
    core = subprocess.run([sys.executable, "-c", code.replace(".torch", "")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert core.returncode == 0, core.stderr[-500:]
