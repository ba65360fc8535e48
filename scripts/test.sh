#!/usr/bin/env bash
# Set everything up, then run the whole test suite (what CI runs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"
.venv/bin/ruff check src tests benchmarks examples
echo "== mypy --strict"
.venv/bin/mypy
echo "== pytest"
exec .venv/bin/python -m pytest -q "$@"
