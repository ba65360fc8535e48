#!/usr/bin/env bash
# Set everything up, then run the main job: local ranks train a model with asyncreduce.torch in
# blocking, backward, forward and double_buffer modes and print the throughput of each.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/asyncreduce run -n "${NPROCS:-2}" examples/train_demo.py "$@"
