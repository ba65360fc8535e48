#!/usr/bin/env bash
# The GPU check, from a source tree, on a machine that cannot install anything (docs/gpu.md):
#   scripts/gpu_check.sh OUTDIR        probe, build, CUDA tests, bench gpu; JSON into OUTDIR
#   scripts/gpu_check.sh --build-only  build the C helpers in place, then stop (any machine)
# It runs the system python3 (or $PYTHON) with PYTHONPATH=src: no venv, no pip. Steps, each
# under `timeout`, at most 8 minutes in all:
#   1. probe  (30 s)  what torch sees; no CUDA GPU: say why, exit 3
#   2. build  (60 s)  cythonize -i the C helpers (samehost/_mailbox_core, samehost/_named_core,
#                     transport/_stream_core) with pyproject's flags; where that fails the
#                     package runs without them (numpy)
#   3. tests (150 s)  tests/test_torch_cuda.py, test_engines_cuda.py, test_torch_amp.py (those
#                     present), junit XML in OUTDIR/pytest_cuda.xml, output in pytest_cuda.txt
#   4. bench (235 s)  asyncreduce bench gpu: OUTDIR/bench_gpu.json (+ .png with matplotlib)
# OUTDIR/gpu_check.json holds each step's exit code and seconds. Budgets: GPU_CHECK_PROBE_S,
# GPU_CHECK_BUILD_S, GPU_CHECK_TESTS_S, GPU_CHECK_BENCH_S; GPU_CHECK_TOTAL_S (480) caps them.
# Without pytest-timeout (or with GPU_CHECK_NO_PYTEST_TIMEOUT=1) its markers become no-ops.
# Exit code: 3 without a CUDA GPU; else 1 if the tests or the bench failed, 0 if not (a failed
# build is reported, and the run goes on without the C helpers).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
TOTAL=${GPU_CHECK_TOTAL_S:-480}
START=$(date +%s)

say() { echo "gpu_check: $*"; }
left() { echo $((TOTAL - ($(date +%s) - START))); }
budget() {  # the smaller of a step's budget and what is left of the total (at least 1 s)
  local want=$1 rest
  rest=$(left)
  ((rest < want)) && want=$rest
  ((want < 1)) && want=1
  echo "$want"
}

step() {  # step NAME SECONDS SIGNAL CMD...: CMD under timeout, then "NAME rc seconds" noted
  local name=$1 limit=$2 sig=$3 t0 rc
  shift 3
  echo "== $name (at most ${limit} s)"
  t0=$(date +%s)
  timeout -s "$sig" -k 10 "$limit" "$@"
  rc=$?
  ((rc == 124 || rc == 137)) && say "$name TIMED OUT after ${limit} s"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >>"$STEPS"
  return "$rc"
}

# the C helpers, built in place with the flags pyproject.toml gives setuptools
BUILD=(env "CFLAGS=-O3 -fwrapv -ffp-contract=off ${CFLAGS:-}" "$PY" -m Cython.Build.Cythonize
  -i -q src/asyncreduce/samehost/_mailbox_core.pyx src/asyncreduce/samehost/_named_core.pyx
  src/asyncreduce/transport/_stream_core.pyx)

if [ "${1:-}" = "--build-only" ]; then
  STEPS=/dev/null
  step build "$(budget "${GPU_CHECK_BUILD_S:-60}")" TERM "${BUILD[@]}"
  exit $?
fi
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR   (or --build-only)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
STEPS=$OUT/.steps
: >"$STEPS"

summary() {  # OUTDIR/gpu_check.json from the steps' lines; $1: the exit code, $2: a note
  "$PY" - "$STEPS" "$OUT" "$1" "$2" "$(($(date +%s) - START))" <<'PY' || say "no gpu_check.json: $PY failed"
import json, sys
from pathlib import Path
steps_file, out, code, note, total = sys.argv[1:6]
steps = [dict(zip(("name", "rc", "seconds"), line.split("\t"))) for line in
         Path(steps_file).read_text().splitlines() if line]
for s in steps:
    s["rc"], s["seconds"] = int(s["rc"]), int(s["seconds"])
doc = {"exit_code": int(code), "note": note, "total_s": int(total), "steps": steps,
       "python": sys.executable, "files": sorted(p.name for p in Path(out).iterdir()
                                                  if not p.name.startswith("."))}
junit = Path(out, "pytest_cuda.xml")
if junit.exists():
    import xml.etree.ElementTree as ET
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    doc["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
Path(out, "gpu_check.json").write_text(json.dumps(doc, indent=2) + "\n")
print(json.dumps({k: v for k, v in doc.items() if k != "files"}, indent=2))
PY
}

# ---- 1. probe: what torch sees ------------------------------------------------------------------
read -r -d '' PROBE <<'PY'
import sys
try:
    import torch
except ImportError as exc:
    print(f"gpu_check: no torch for {sys.executable}: {exc}")
    sys.exit(3)
print("python", sys.version.split()[0], "|", sys.executable)
print("torch", torch.__version__, "| cuda build", torch.version.cuda,
      "| available", torch.cuda.is_available(), "| devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB")
if not torch.cuda.is_available():
    why = "a CPU-only build of torch" if torch.version.cuda is None else "no usable driver or device"
    print(f"gpu_check: NOT VERIFIED: torch sees no CUDA GPU ({why})")
    sys.exit(3)
PY
command -v nvidia-smi >/dev/null && timeout 15 nvidia-smi -L
step probe "$(budget "${GPU_CHECK_PROBE_S:-30}")" TERM "$PY" -c "$PROBE"
rc=$?
if ((rc != 0)); then
  summary 3 "no CUDA GPU (probe exit code $rc): nothing else was run"
  exit 3
fi

# ---- 2. build the C helpers in place ----------------------------------------------------------
build_note="C helpers built in place"
if ! step build "$(budget "${GPU_CHECK_BUILD_S:-60}")" TERM "${BUILD[@]}"; then
  build_note="C helpers NOT built: the package runs without them (numpy mailbox, Python frames)"
  say "$build_note"
fi

# ---- 3. the CUDA tests --------------------------------------------------------------------------
tests=()
for t in tests/test_torch_cuda.py tests/test_engines_cuda.py tests/test_torch_amp.py; do
  [ -f "$t" ] && tests+=("$t")
done
plugins=()
if [ -n "${GPU_CHECK_NO_PYTEST_TIMEOUT:-}" ] || ! "$PY" -c "import pytest_timeout" 2>/dev/null
then
  # without pytest-timeout, pyproject's `timeout` option and @pytest.mark.timeout are unknown,
  # which its filterwarnings=error and --strict-markers make errors: declare both, as no-ops
  mkdir -p "$OUT/.plugin"
  printf '%s\n' 'def pytest_addoption(parser):' \
    '    parser.addini("timeout", "pytest-timeout is not installed: ignored")' \
    'def pytest_configure(config):' \
    '    config.addinivalue_line("markers", "timeout(s): pytest-timeout is not installed")' \
    >"$OUT/.plugin/gpu_check_markers.py"
  plugins=(-p no:timeout -p gpu_check_markers)
  say "no pytest-timeout: the tests run with no per-test timeout (the step's budget holds)"
  export PYTHONPATH="$PYTHONPATH:$OUT/.plugin"
fi
# SIGINT at the budget: pytest stops, and still writes its summary and the junit XML
step tests "$(budget "${GPU_CHECK_TESTS_S:-150}")" INT "$PY" -m pytest "${tests[@]}" -v -rs \
  -p no:cacheprovider ${plugins[@]+"${plugins[@]}"} --junitxml="$OUT/pytest_cuda.xml" 2>&1 |
  tee "$OUT/pytest_cuda.txt"
tests_rc=${PIPESTATUS[0]}

# ---- 4. bench gpu ---------------------------------------------------------------------------------
limit=$(budget "${GPU_CHECK_BENCH_S:-235}")
plot=()
if "$PY" -c "import matplotlib" 2>/dev/null; then
  plot=(--plot "$OUT/bench_gpu.png")
else
  say "no matplotlib: bench gpu writes no plot"
fi
# its own --limit ends it 20 s before the budget, with what it measured by then
step bench "$limit" TERM "$PY" -m asyncreduce bench gpu --json "$OUT/bench_gpu.json" \
  ${plot[@]+"${plot[@]}"} --limit "$((limit > 40 ? limit - 20 : limit / 2))" 2>&1 | tee "$OUT/bench_gpu.txt"
bench_rc=${PIPESTATUS[0]}

code=0
((tests_rc != 0 || bench_rc != 0)) && code=1
summary "$code" "$build_note; tests exit code $tests_rc; bench exit code $bench_rc"
if ((code == 0)); then say "PASSED"; else say "FAILED (tests $tests_rc, bench $bench_rc)"; fi
exit "$code"
