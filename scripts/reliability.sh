#!/usr/bin/env bash
# The long fault-injection run behind docs/reliability.md: every fault scenario repeated
# ASYNCREDUCE_FAULT_SCALE times (default 5; CI runs them once), the hostile-input and
# authentication runs at ASYNCREDUCE_FUZZ_SCALE (default 10), then the table of what was measured.
# Usage: bash scripts/reliability.sh [pytest args...]   (writes results/reliability.jsonl)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p results
report=results/reliability.jsonl
rm -f "$report"
ASYNCREDUCE_FAULT_SCALE="${ASYNCREDUCE_FAULT_SCALE:-5}" \
ASYNCREDUCE_FUZZ_SCALE="${ASYNCREDUCE_FUZZ_SCALE:-10}" \
ASYNCREDUCE_RELIABILITY_REPORT="$PWD/$report" \
    .venv/bin/pytest -q -p no:cacheprovider --timeout 1800 \
    tests/test_faults.py tests/test_cluster.py tests/test_auth.py tests/test_hostile.py "$@"
.venv/bin/python scripts/reliability_table.py "$report"
