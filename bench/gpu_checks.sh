#!/usr/bin/env bash
# The GPU checks of the CPU-proven work (the house refactor, the new formats, architectures
# and kernels): the golden record, the kernel and runtime tests on the real compiler, and
# the round's time before and after the house (issue 30). Repo root; the tree at 713498e
# (where the golden records were made, before the house) carried as .before/src for
# `timing` (`git archive 713498e src | tar -x -C .before`); the wheels in .whl. One stage a
# device call (each fits its 10 minutes):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl          # the gguf wheel (the device lacks it)
#   bash bench/gpu_checks.sh golden    # tests/runtime/test_golden.py::test_gpu_golden (plan + bits, W = 1..64)
#   bash bench/gpu_checks.sh kernels   # tests/kernels on the GPU (deltanet, quant types, windows, GELU among them)
#   bash bench/gpu_checks.sh runtime   # tests/runtime but the golden (gemma3, rope, shared expert, quant-type model)
#   bash bench/gpu_checks.sh timing    # the round at W = 1 / 8, before and after, same run, alternating
#   bash bench/gpu_checks.sh files tests/x.py ...   # those files (TESTS_S: their limit; TAG names the log), -rfE --tb=short
#   bash bench/gpu_checks.sh groups "a.py b.py" "c.py" ...   # each quoted group of files a pytest process
#                                      # (in parallel on one GPU), logs tarred in $OUT/groups.tgz: a call returns 8 files
#   bash bench/gpu_checks.sh all-tests # golden (records kept in $OUT/golden.tgz), kernels and runtime at
#                                      # once: three processes on one GPU, bits do not depend on company
# Writes $OUT/checks-<stage>.log (+ $OUT/house-timing.jsonl).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
AFTER=/tmp/site:$PWD/src
BEFORE=/tmp/site:$PWD/.before/src
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
stage=${1:-}

golden() {
  PYTHONPATH=$AFTER timeout 500 python3 -m pytest -q -p no:cacheprovider \
      "tests/runtime/test_golden.py::test_gpu_golden" 2>&1 | tail -15 | tee "$OUT/checks-golden.log"
}
kernels() {
  PYTHONPATH=$AFTER timeout 540 python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -25 \
      | tee "$OUT/checks-kernels.log"
}
runtime() {
  PYTHONPATH=$AFTER timeout 540 python3 -m pytest -q -p no:cacheprovider tests/runtime \
      --deselect tests/runtime/test_golden.py::test_gpu_golden 2>&1 | tail -25 | tee "$OUT/checks-runtime.log"
}
timing() {
  [ -d .before/src ] || { echo "no .before/src: carry main's src there"; return 1; }
  for preset in qwen3-8b qwen3-30b-a3b; do
    g=/tmp/house-$preset.gguf
    PYTHONPATH=$AFTER python3 -c "from alphallama.gguf.writer import PRESETS, write_synthetic; \
write_synthetic(PRESETS['$preset'](), '$g')" || return 1
    for rep in 1 2; do        # alternating processes: drift hits both sides alike
      for side in before after; do
        pp=$([ $side = before ] && echo $BEFORE || echo $AFTER)
        PYTHONPATH=$pp timeout 70 python3 bench/gpu_house_timing.py --gguf $g --label $side --out "$OUT/house-timing.jsonl" \
            2>&1 | grep -v "_warn_once\|UserWarning" | tail -2
      done
    done
    rm -f $g
  done 2>&1 | tee "$OUT/house-timing.log"
}
golden_records() {   # the records made now, compared byte for byte with the committed ones
  PYTHONPATH=$AFTER timeout 540 python3 -m alphallama.runtime.gpu_golden --device cuda --out /tmp/g \
      > "$OUT/checks-golden.log" 2>&1
  PYTHONPATH=$AFTER python3 - >> "$OUT/checks-golden.log" 2>&1 <<'PY'
import json, pathlib, sys
sys.path.insert(0, "tests/runtime")
from alphallama.runtime import gpu_golden as golden
from test_golden import _contracts
bad = 0
for got_p in sorted(pathlib.Path("/tmp/g").glob("gpu-*.json")):
    want = json.loads((golden.GOLDEN_DIR / got_p.name).read_text())
    got = json.loads(got_p.read_text())
    diff = golden.first_difference(want, got)
    same = got_p.read_bytes() == (golden.GOLDEN_DIR / got_p.name).read_bytes()
    _contracts(got)
    bad += not same
    print(f"{got_p.name}: {'identical bytes' if same else f'DIFFERS at {diff}'}; contracts hold")
print("golden:", "PASS" if bad == 0 else f"FAIL ({bad} differ)")
PY
  tar -czf "$OUT/golden.tgz" -C /tmp g
}
files() {    # the test files named after the stage, failures with their short tracebacks
  shift
  PYTHONPATH=$AFTER timeout ${TESTS_S:-400} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short "$@" \
      > "$OUT/checks-files${TAG:+-$TAG}.log" 2>&1
  grep -E "passed|failed|error" "$OUT/checks-files${TAG:+-$TAG}.log" | tail -3
}
groups() {   # one process a group; the summary lines printed, the logs in one tar
  shift
  mkdir -p /tmp/groups; local i=0
  for g in "$@"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    (PYTHONPATH=$AFTER timeout ${TESTS_S:-400} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short $g \
        > /tmp/groups/group-$i.log 2>&1) &
  done
  wait
  for f in /tmp/groups/group-*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$f" | tail -6; done
  tar -czf "$OUT/groups.tgz" -C /tmp groups
}
all_tests() {
  golden_records & kernels > /dev/null & runtime > /dev/null & wait
  tail -8 "$OUT/checks-golden.log"; tail -4 "$OUT/checks-kernels.log" "$OUT/checks-runtime.log"
}
case "$stage" in
  golden) golden ;;
  kernels) kernels ;;
  runtime) runtime ;;
  timing) timing ;;
  all-tests) all_tests ;;
  files) files "$@" ;;
  groups) groups "$@" ;;
  *) echo "stage: golden | kernels | runtime | timing | all-tests | files F.py ... | groups \"F.py ...\" ..."; exit 2 ;;
esac
