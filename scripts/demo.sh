#!/usr/bin/env bash
# Set everything up, then run the main job: several local ranks over real sockets.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/asyncreduce run -n "${NPROCS:-4}" examples/hello.py
