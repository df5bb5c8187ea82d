#!/usr/bin/env bash
# Issue 30 (the house) on the device: the refactor changes no bits and costs no time.
# Repo root of the AFTER tree, with main at the branch's base carried as .before/src and the
# wheels in .whl; one stage a device call (each fits its 10 minutes), or `all` (~9 min,
# the stages' timeouts add up to 540 s):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl
#   bash bench/gpu_house_check.sh golden   # tests/runtime/test_golden.py::test_gpu_golden (plan + bits, W = 1..64)
#   bash bench/gpu_house_check.sh tests    # the GPU tests of tests/kernels and tests/runtime (golden excluded)
#   bash bench/gpu_house_check.sh timing   # the round at W = 1 / 8, before and after, same run, alternating
# Writes $OUT/house-golden.log, $OUT/house-tests.log, $OUT/house-timing.jsonl (+ .log).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
AFTER=/tmp/site:$PWD/src
BEFORE=/tmp/site:$PWD/.before/src
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
stage=${1:-all}

golden() {
  PYTHONPATH=$AFTER timeout 200 python3 -m pytest -q -p no:cacheprovider \
      "tests/runtime/test_golden.py::test_gpu_golden" 2>&1 | tail -15 | tee "$OUT/house-golden.log"
}
tests() {
  PYTHONPATH=$AFTER timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/kernels tests/runtime \
      --deselect tests/runtime/test_golden.py::test_gpu_golden 2>&1 | tail -15 | tee "$OUT/house-tests.log"
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
case "$stage" in
  golden) golden ;;
  tests) tests ;;
  timing) timing ;;
  all) golden; tests; timing ;;
  *) echo "stage: golden | tests | timing | all"; exit 2 ;;
esac
