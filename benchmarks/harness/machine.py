"""What ran, where: this machine, its libraries, and the asyncreduce checkout under test.

``machine_info`` (cores, CPU, Python and library versions, asyncreduce's thresholds) and
``library_state`` (the checkout's commit, changed files in src/, the ASYNCREDUCE_*
environment) go into every ``--json`` document; ``machine_line`` is their first line of every
report. ``package_root`` is the folder of the asyncreduce this process imports: the workers
get it on PYTHONPATH, so they run the same code as their parent.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

__all__ = [
    "LoadWatch",
    "cpu_model",
    "library_state",
    "load_words",
    "machine_info",
    "machine_line",
    "package_root",
]


def package_root() -> Path | None:
    """The folder holding the ``asyncreduce`` package this process imports, or None."""
    spec = importlib.util.find_spec("asyncreduce")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).resolve().parents[1]


def library_state() -> dict[str, Any]:
    """Which asyncreduce ran: the checkout's commit, whether src/ differs from it, and the
    ASYNCREDUCE_* environment (e.g. ASYNCREDUCE_SHM=0 keeps ranks on TCP)."""
    root = package_root()
    state: dict[str, Any] = {
        "env": {k: v for k, v in os.environ.items() if k.startswith("ASYNCREDUCE_")}
    }
    if root is None or shutil.which("git") is None:
        return state
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "-C", str(root.parent)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        changed = subprocess.run([*git, "status", "--porcelain", "--", "src"], capture_output=True,
                                 text=True, timeout=10, check=True).stdout.splitlines()  # fmt: skip
        state.update(commit=head, src_changes=[line[3:] for line in changed])
    return state


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _open_mpi_version() -> str | None:
    if shutil.which("mpirun") is None:
        return None
    try:
        out = subprocess.run(
            ["mpirun", "--version"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = (out.stdout or out.stderr).strip().splitlines()
    return first[0] if first else None


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo, or None."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def machine_info() -> dict[str, Any]:
    import numpy as np

    from asyncreduce import algorithms

    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model() or platform.processor() or None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": _version("torch"),
        "mpi4py": _version("mpi4py"),
        "open_mpi": _open_mpi_version(),
        "asyncreduce": _version("asyncreduce"),
        "small_allreduce_bytes": algorithms.SMALL_ALLREDUCE_BYTES,
        "cross_memory_bytes": algorithms.CROSS_MEMORY_BYTES,
    }


def machine_line(machine: dict[str, Any]) -> str:
    parts = [
        f"{machine['cores']} cores" + (f" ({machine['cpu']})" if machine["cpu"] else ""),
        f"Python {machine['python']}",
        f"numpy {machine['numpy']}",
        f"torch {machine['torch'] or 'not installed'}",
        f"mpi4py {machine['mpi4py'] or 'not installed'}",
        machine["open_mpi"] or "Open MPI not found",
        f"asyncreduce {machine['asyncreduce']}" + _state_words(machine.get("library", {})),
    ]
    return "machine: " + "; ".join(parts + load_words(machine))


def load_words(machine: dict[str, Any]) -> list[str]:
    """The machine line's words on what else ran (``LoadWatch``), where the run measured it."""
    words = []
    load = machine.get("load_1min")
    if load:
        words.append(f"load average before/after {load['before']}/{load['after']}")
    stolen = machine.get("cpu_stolen")
    if stolen is not None:
        words.append(f"CPU stolen by the hypervisor during the run {stolen:.1f}%")
    return words


def _state_words(state: dict[str, Any]) -> str:
    words = []
    if state.get("commit"):
        changes = len(state.get("src_changes", []))
        words.append(
            f"git {state['commit']}" + (f" + {changes} changed in src/" if changes else "")
        )
    words += [f"{k}={v}" for k, v in state.get("env", {}).items()]
    return f" ({', '.join(words)})" if words else ""


def _load_1min() -> float:
    """The load average over the last minute, as the report shows it."""
    return round(os.getloadavg()[0], 2)


class LoadWatch:
    """What else took the cores while a benchmark ran: the load average before and after,
    and the share of CPU time the hypervisor gave to other guests (``steal`` in /proc/stat).
    On a shared host that share swings from 0 to 40% within minutes, and every latency with
    it; a report that says so tells a slow run from a slow library."""

    def __init__(self) -> None:
        self._load = _load_1min()
        self._cpu = _cpu_jiffies()

    def ended(self) -> dict[str, Any]:
        """``load_1min`` and ``cpu_stolen`` (percent of all CPU time, None where unknown)."""
        now = _cpu_jiffies()
        stolen = None
        if self._cpu is not None and now is not None and now[0] > self._cpu[0]:
            stolen = round(100.0 * (now[1] - self._cpu[1]) / (now[0] - self._cpu[0]), 1)
        return {"load_1min": {"before": self._load, "after": _load_1min()}, "cpu_stolen": stolen}


def _cpu_jiffies() -> tuple[int, int] | None:
    """All CPU time and the stolen part, in jiffies since boot (Linux); None elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
        ticks = [int(f) for f in fields]
    except (OSError, ValueError):
        return None
    return (sum(ticks), ticks[7]) if len(ticks) == 8 else None
