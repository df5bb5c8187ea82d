#!/usr/bin/env bash
# Our decode and prefill against llama-bench on the same synthetic files, same machine, same
# session (issues 31 and 32), in two device calls made back to back (the machine keeps /tmp and
# the llama.cpp build while warm). Repo root; carry [".whl", ".devcarry"]; GIT_COMMIT=<commit>.
#   bash bench/gpu_vs_llamacpp.sh prepare   # llama.cpp's CUDA build (resumable) while the files are
#                                           # written and the GPU tests of the hybrids and the store run
#   bash bench/gpu_vs_llamacpp.sh time      # llama-bench, then ours, file by file inside LIMIT_S
#   BUILD_S=400 TESTS_S=240 bash bench/gpu_vs_llamacpp.sh all   # both in one call, as far as its limit goes
# Files (/tmp/m): the Qwen3-8B shape in Q4_K_M (the control), Q3_K_M, IQ4_XS and IQ3_XXS
# (llama-quantize's mixes: gguf/synth_mixes.py); the Qwen3.6-35B-A3B-like hybrid (40 layers,
# attention every 4th) cut to 32 routed experts (the same bytes a token reads: 8 used + shared).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/m
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
MIXES=${MIXES:-"Q4_K_M Q3_K_M IQ4_XS IQ3_XXS"}
HYBRID=/tmp/m/qwen36-35b-a3b-40L-32E.gguf
case "${1:-}" in
prepare)
  (timeout ${BUILD_S:-560} bash bench/gpu_llamacpp.sh build > "$OUT/build.txt" 2>&1; echo "build rc $?" >> "$OUT/build.txt") &
  for q in $MIXES; do
    [ -f /tmp/m/qwen3-8b-$q.gguf ] || nice -n 10 python3 -m alphallama synth --preset qwen3-8b --quant $q -o /tmp/m/qwen3-8b-$q.gguf \
        > "$OUT/synth-$q.log" 2>&1 &
  done
  [ -f $HYBRID ] || nice -n 10 python3 -c "
from alphallama.gguf.writer import PRESETS, write_synthetic
write_synthetic(PRESETS['qwen36-35b-a3b'](n_layers=40, n_experts=32), '$HYBRID')" > "$OUT/synth-hybrid.log" 2>&1 &
  # (the writers and tests niced: the build has the CPU first)
  [ "${TESTS_S:-540}" = 0 ] || timeout ${TESTS_S:-540} nice -n 5 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_hybrid.py \
      tests/runtime/test_gpu_hybrid_mtp.py tests/gguf/test_writer.py \
      -k "not llama_cpp_loads" > "$OUT/tests-hybrid.txt" 2>&1 &
  # the store on the GPU (its tier kernel learned the mapped tier); test_store / test_mapped_store run on the CPU device
  [ "${TESTS_S:-540}" = 0 ] || timeout ${TESTS_S:-540} nice -n 5 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_gpt_oss.py \
      tests/kernels/test_attention_sinks.py tests/kernels/test_moe_oai.py tests/offload/test_cpu_tier.py tests/offload/test_plan_host.py \
      tests/offload/test_mapped_native.py tests/runtime/test_gpu_quant_types_iq_model.py > "$OUT/tests-offload.txt" 2>&1 &
  wait
  ls -la /tmp/m; tail -2 "$OUT/build.txt"; tail -3 "$OUT"/tests-*.txt
  ;;
time|all)
  # each file timed by llama-bench and by us in turn, the hybrid first (all: after prepare's
  # build, files and tests in the same call); whatever finishes inside LIMIT_S comes back
  LIMIT_S=${LIMIT_S:-585}; t0=$(date +%s)
  left() { echo $(( LIMIT_S - ($(date +%s) - t0) )); }
  [ "$1" = all ] && bash "$0" prepare
  for f in $HYBRID $(for q in $MIXES; do echo /tmp/m/qwen3-8b-$q.gguf; done); do
    [ "$(left)" -gt 40 ] || break
    timeout $(( $(left) - 10 )) bash bench/gpu_llamacpp.sh bench "$f"
    [ "$(left)" -gt 40 ] || break
    if [ "$f" = "$HYBRID" ]; then
      timeout $(( $(left) - 10 )) python3 bench/gpu_hybrid.py --layers 40 --experts 32 --file $HYBRID \
          --widths 2,4,8,16 --reps 10 > "$OUT/gpu_hybrid.txt" 2>&1; tail -4 "$OUT/gpu_hybrid.txt"
    else
      q=$(basename "$f" .gguf); q=${q#qwen3-8b-}
      timeout $(( $(left) - 10 )) python3 bench/gpu_decode_arms.py --preset qwen3-8b --quant $q --file "$f" \
          --arms default --widths 1 2 4 8 16 --reps 30 2>&1 | grep -v "^\s*$" | tail -2
    fi
  done
  nvidia-smi --query-gpu=name,driver_version,clocks.max.mem --format=csv,noheader > "$OUT/gpu.txt"
  ;;
*)
  echo "stage: prepare | time | all"; exit 2 ;;
esac
