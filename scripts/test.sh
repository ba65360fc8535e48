#!/usr/bin/env bash
# Set everything up, then run the whole test suite (what CI runs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# as root with apt (CI), also Open MPI from Debian's packages and mpi4py, so the mpirun tests
# (one host, across emulated hosts, MPI's own bootstrap) run instead of skipping
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  bash scripts/setup.sh --mpi
else
  bash scripts/setup.sh
fi
echo "== ruff"
.venv/bin/ruff check src tests benchmarks examples
echo "== mypy --strict"
.venv/bin/mypy
echo "== pytest"
exec .venv/bin/python -m pytest -q "$@"
