"""The output of a run: text tables, the ``--json`` document, and the plot's file.

A report starts with the ``preamble`` (machine line, skipped libraries, failed sets, notes),
then the benchmark's own tables, drawn by ``render_table`` with times in ``fmt_ms``. Every
JSON document starts with ``json_head`` (benchmark, command line, date, elapsed, machine);
``write_json`` adds what a ``Run`` holds and the benchmark's summary. Plots go through
matplotlib's Agg backend to PNG files only (``pyplot``, ``save_figure``).
"""

from __future__ import annotations

import datetime
import importlib
import json
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .machine import machine_line
from .workers import Run, set_words

__all__ = [
    "fmt_ms",
    "json_head",
    "preamble",
    "pyplot",
    "render_table",
    "report_per_n",
    "save_figure",
    "save_json",
    "write_json",
]


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    if ms < 10:
        return f"{ms:.2f}"
    if ms < 1000:
        return f"{ms:.1f}"
    return f"{ms:.0f}"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Columns padded to fit; the first ``left`` columns left-aligned, the rest right."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(widths[i]) if i < left else c.rjust(widths[i]) for i, c in enumerate(cells)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def preamble(run: Run, machine: dict[str, Any]) -> list[str]:
    """The lines every report starts with: machine, skipped, failures, notes."""
    lines = [machine_line(machine)]
    lines += [f"skipped {lib}: {why}" for lib, why in run.skipped.items()]
    for f in run.failures:
        lines.append(f"FAILED {set_words(f['lib'], f['nprocs'], f.get('where'))}: {f['error']}")
    lines += [f"note: {text}" for text in run.notes]
    return lines


def json_head(
    name: str, argv: Sequence[str], elapsed: float, machine: dict[str, Any], **command: Any
) -> dict[str, Any]:
    """What every ``--json`` document starts with (``command`` adds to its command entry)."""
    return {
        "benchmark": name,
        "command": {
            "line": shlex.join(["asyncreduce", "bench", name, *argv]),
            "argv": list(argv),
            **command,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(elapsed, 2),
        "machine": machine,
    }


def save_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def report_per_n(run: Run, machine: dict[str, Any], table: Callable[[Run, int], str]) -> str:
    """The preamble, then ``table(run, N)`` for each process count, a blank line before each."""
    lines = preamble(run, machine)
    for nprocs in run.settings["nprocs"]:
        lines += ["", table(run, nprocs)]
    return "\n".join(lines)


def write_json(
    path: Path, run: Run, machine: dict[str, Any], argv: Sequence[str], elapsed: float,
    summary: dict[str, Any],
) -> None:  # fmt: skip
    document = {
        **json_head(run.benchmark, argv, elapsed, machine),
        "settings": run.settings,
        "skipped": run.skipped,
        "failures": run.failures,
        "notes": run.notes,
        "set_seconds": run.set_seconds,
        "results": run.results,
        "summary": summary,
    }
    save_json(path, document)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    matplotlib: Any = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def save_figure(plt: Any, fig: Any, path: Path) -> None:
    """Lay out ``fig``, write it to ``path`` as a PNG and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
