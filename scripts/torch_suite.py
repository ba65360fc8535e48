#!/usr/bin/env python3
"""Run PyTorch's backend-agnostic distributed test suite for a backend and world size.

    .venv/bin/python scripts/torch_suite.py --backend asyncreduce --world-size 2 [-k EXPR]
    .venv/bin/python scripts/torch_suite.py --backend gloo --world-size 3 --json results/g3.json

Each test spawns WORLD_SIZE ranks (PyTorch's MultiProcessTestCase). Prints pytest's summary;
``--json`` writes {test name: passed | failed | skipped} for comparing backends.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "tests" / "torch_suite" / "test_distributed_suite.py"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="asyncreduce", choices=["asyncreduce", "gloo"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("-k", default="", help="pytest -k selection (default: every test)")
    parser.add_argument("--json", help="write each test's outcome here")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as temp:
        os.mkdir(os.path.join(temp, "barrier"))
        env = {**os.environ, "BACKEND": args.backend, "WORLD_SIZE": str(args.world_size),
               "TEMP_DIR": temp, "PYTHONPATH": str(ROOT / "src")}  # fmt: skip
        cmd = [sys.executable, "-m", "pytest", str(SUITE), "-q", "-rA", "-p", "no:cacheprovider",
               f"--timeout={args.timeout}", "-o", "filterwarnings=default"]  # fmt: skip
        if args.k:
            cmd += ["-k", args.k]
        out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    print(out.stdout[-20000:], out.stderr[-5000:], sep="\n")
    if args.json:
        outcomes = dict(re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR) \S+::(\w+)", out.stdout, re.M))
        found = {name: state.lower() for state, name in
                 re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR) \S+::(test_\w+)", out.stdout, re.M)}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(found or outcomes, indent=1, sort_keys=True))
    return out.returncode


if __name__ == "__main__":
    sys.exit(main())
