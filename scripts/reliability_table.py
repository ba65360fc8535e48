"""Print the table of docs/reliability.md from the JSON lines the fault tests report.

Usage: python scripts/reliability_table.py results/reliability.jsonl
"""

from __future__ import annotations

import json
import sys


def figures(line: dict[str, object]) -> str:
    """Every measured figure of one scenario, seconds to milliseconds where that reads better."""
    skip = {"scenario", "promise", "at", "runs", "hangs"}
    parts = []
    for key, value in line.items():
        if key in skip:
            continue
        if key.endswith("_s") and isinstance(value, float):
            parts.append(f"{key[:-2]} {value * 1000:.0f} ms")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.1f}")
        else:
            parts.append(f"{key} {value}")
    return ", ".join(parts)


def main(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(text) for text in f if text.strip()]
    print("| scenario | promise | runs | hangs | measured |")
    print("| --- | --- | --- | --- | --- |")
    for line in lines:
        print(
            f"| {line['scenario']} | {line['promise']} | {line.get('runs', 1)} | "
            f"{line.get('hangs', 0)} | {figures(line)} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
