#!/usr/bin/env bash
# Set up everything asyncreduce needs in ./.venv (idempotent).
#   scripts/setup.sh            library + test tools + PyTorch (CPU) + matplotlib
#   scripts/setup.sh --mpi      also Open MPI (Debian packages, needs root) and mpi4py, for benchmarks
set -euo pipefail
cd "$(dirname "$0")/.."

want_mpi=0
[ "${1:-}" = "--mpi" ] && want_mpi=1

if [ "$want_mpi" = 1 ] && ! command -v mpirun >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing Open MPI from Debian's packages"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
  else
    echo "== Open MPI not found and cannot install it (not root or no apt-get): MPI benchmarks will be skipped"
  fi
fi

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
extras="dev,torch,plot,integrations"
if [ "$want_mpi" = 1 ] && command -v mpirun >/dev/null 2>&1; then
  extras="$extras,mpi"
fi
echo "== installing asyncreduce[$extras] into .venv, with torch==2.13.0 (the CPU build)"
# first the CPU build, which the [torch] extra's range then accepts as it is (left to itself,
# pip would take the newest release in the range: a CUDA build of several GB)
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[$extras]"
