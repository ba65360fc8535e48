"""Shared pieces of the fault-injection tests: how long they run, and what they report.

``ASYNCREDUCE_FAULT_SCALE`` (default 1) multiplies repetitions and counts: CI runs the quick
version; ``bash scripts/reliability.sh`` runs a long one. With ``ASYNCREDUCE_RELIABILITY_REPORT``
set to a file, every scenario appends one JSON line (scenario, promise, figures) to it, and
``scripts/reliability_table.py`` turns those lines into the table of docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

SCALE = max(1, int(os.environ.get("ASYNCREDUCE_FAULT_SCALE", "1")))


def report(scenario: str, promise: str, **figures: Any) -> None:
    """Record what a scenario measured (only when a report file is asked for)."""
    path = os.environ.get("ASYNCREDUCE_RELIABILITY_REPORT")
    if not path:
        return
    line = {"scenario": scenario, "promise": promise, "at": time.time(), **figures}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
