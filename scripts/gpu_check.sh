#!/usr/bin/env bash
# Run the CUDA tests (tests/test_torch_cuda.py) on a machine with a GPU and print the result.
# Uses ./.venv; only if it is missing, creates it with `pip install -e .[dev,torch]` (nothing else).
#   GPU_CHECK_TIMEOUT   seconds for the whole pytest run (default 420)
# Exit code: pytest's, or 3 when PyTorch sees no CUDA GPU (the CUDA tests would only skip).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv: pip install -e .[dev,torch]"
  python3 -m venv .venv || exit 1
  .venv/bin/python -m pip install -q -e ".[dev,torch]" || exit 1
fi

echo "== what PyTorch sees"
.venv/bin/python - <<'PY' || exit 1
import torch
print("torch", torch.__version__, "| cuda build", torch.version.cuda,
      "| available", torch.cuda.is_available(), "| devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i}", torch.cuda.get_device_name(i))
PY
if ! .venv/bin/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: NOT VERIFIED: PyTorch sees no CUDA GPU (a CPU-only build, or no driver)"
  exit 3
fi

echo "== pytest tests/test_torch_cuda.py tests/test_engines_cuda.py (timeout ${GPU_CHECK_TIMEOUT:-420} s)"
timeout -k 10 "${GPU_CHECK_TIMEOUT:-420}" \
  .venv/bin/python -m pytest tests/test_torch_cuda.py tests/test_engines_cuda.py -v -rs -p no:cacheprovider
rc=$?
case $rc in
  0) echo "gpu_check: PASSED (every CUDA test ran; skips, if any, are listed above)" ;;
  124|137) echo "gpu_check: TIMED OUT after ${GPU_CHECK_TIMEOUT:-420} s" ;;
  *) echo "gpu_check: FAILED (pytest exit code $rc)" ;;
esac
exit $rc
