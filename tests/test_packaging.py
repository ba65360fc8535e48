"""What a fresh user installs: the license, the changelog, the extras, the Python version."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the suite's own interpreter)

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

#: The C helpers' sources, each next to its Python user, and the headers they include
C_SOURCES = ("samehost/_mailbox_core.pyx", "samehost/_named_core.pyx", "samehost/_spin.h",
             "samehost/_spin_fold.pxd", "transport/_stream_core.pyx", "kernels/_fold.h",
             "samehost/_mailbox_core.pyi", "samehost/_named_core.pyi",
             "transport/_stream_core.pyi")  # fmt: skip


def test_each_c_helper_is_built_from_its_place_with_headers_found_from_there() -> None:
    """pyproject's extensions are the C sources where they are, by their new names; every
    header a .pyx includes is found from its folder, as the C compiler looks (no include-dirs:
    `pip install .` and `cythonize -i` in scripts/gpu_check.sh build the same sources)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules = {m["name"]: m["sources"] for m in setuptools["ext-modules"]}
    assert modules == {
        "asyncreduce.samehost._mailbox_core": ["src/asyncreduce/samehost/_mailbox_core.pyx"],
        "asyncreduce.samehost._named_core": ["src/asyncreduce/samehost/_named_core.pyx"],
        "asyncreduce.transport._stream_core": ["src/asyncreduce/transport/_stream_core.pyx"],
    }
    package = ROOT / "src" / "asyncreduce"
    assert not list(package.glob("_*_core*")), "a C helper (or an old build of one) at the top"
    build = (ROOT / "scripts" / "gpu_check.sh").read_text()
    for sources in modules.values():
        (source,) = sources
        assert source in build, f"scripts/gpu_check.sh does not build {source}"
        pyx = ROOT / source
        text = pyx.read_text()
        for name in re.findall(r"from \.(\w+) cimport", text):  # a sibling's declarations
            pxd = pyx.parent / f"{name}.pxd"
            assert pxd.is_file(), f"{source} cimports {name}: no {pxd}"
            assert pxd.relative_to(package).as_posix() in C_SOURCES, pxd
            text += pxd.read_text()  # (its headers are included from the .pyx's folder)
        for header in re.findall(r'cdef extern from "([^"<>]+\.h)"', text):
            found = (pyx.parent / header).resolve()
            assert found.is_file(), f"{source} includes {header}: not at {found}"
            assert found.relative_to(package).as_posix() in C_SOURCES, found


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


@pytest.mark.slow
def test_without_a_c_compiler_it_installs_and_runs_on_the_python_mailbox(tmp_path: Path) -> None:
    """The C mailbox, named slots and stream look are optional: a wheel built where the
    compiler fails has no extension, installs, and folds with numpy (the suite runs both ways
    where they were built). It still ships their sources and headers (C_SOURCES)."""
    env = {**os.environ, "CC": "false", "LDSHARED": "false"}
    source, wheels = tmp_path / "source", tmp_path / "wheel"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(  # no earlier build's output
        ".git", ".venv", "build", "results", "*.so", "*.egg-info", "*_cache", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels),
                    str(source)], env=env, check=True, timeout=600)  # fmt: skip
    (wheel,) = wheels.glob("asyncreduce-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(tmp_path / "site"), str(wheel)], check=True, timeout=300)  # fmt: skip
    assert not list((tmp_path / "site" / "asyncreduce").rglob("*.so"))
    shipped = {p.relative_to(tmp_path / "site" / "asyncreduce").as_posix()
               for p in (tmp_path / "site" / "asyncreduce").rglob("_*")}  # fmt: skip
    assert set(C_SOURCES) <= shipped, set(C_SOURCES) - shipped
    probe = (
        "import numpy as np, asyncreduce.samehost.mailbox as m, asyncreduce.transport.pairs as t\n"
        "import asyncreduce.samehost.named as n\n"
        "assert m.Core is None and not m.native_wanted(), m.__file__\n"
        "assert n.NamedCore is None\n"
        "assert t.native_take is None and not t.native_take_wanted()\n"
        "r = [np.zeros(m.region_bytes(), np.uint8) for _ in range(2)]\n"
        "a, b = m.Mailbox(0, r[0], {1: r[1]}), m.Mailbox(1, r[1], {0: r[0]})\n"
        "from asyncreduce.kernels.reduction import DTYPES\n"
        "h = m.header(m.HERE, (1, 2, 1, 0, 3))\n"
        "a.publish(0, h, np.ones(3, np.float32)); b.publish(0, h, np.full(3, 2, np.float32))\n"
        "out = np.empty(3, np.float32)\n"
        "assert a.collect(0, h, out, DTYPES['float32'], 'sum') == m.AGREED\n"
        "print(out.tolist())\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env={"PYTHONPATH": str(tmp_path / "site")},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "[3.0, 3.0, 3.0]", done.stderr
