#!/usr/bin/env bash
# A session's device calls for the open comparisons against llama.cpp (issues 32, 33, 34), laid
# out as sessions 45-46 found works: long CPU jobs (the llama.cpp build, the synthetic files) start
# in the background with `setsid nice` (a setsid process outlives its call while the machine stays
# warm) under another call's GPU work, and the next call, issued at once (the machine goes back
# 30 s after a call), waits for them. Repo root; carry [".whl", ".devcarry"]
# (.devcarry/llama.cpp-src.tar.gz from `bash bench/llamacpp_source.sh`):
#
#   bash bench/gpu_session.sh bg; GIT_COMMIT=<c> bash bench/gpu_train_embedded.sh   # build under the retrain
#   GIT_COMMIT=<c> bash bench/gpu_session.sh compare   # IQ4_XS, then the -np servers (~9 min)
#   GIT_COMMIT=<c> bash bench/gpu_session.sh offload   # offload v2 + llama.cpp's --n-cpu-moe, same call (~9 min)
#   GIT_COMMIT=<c> bash bench/gpu_session.sh start     # bg + offload v2 in one call (when no retrain runs)
#
# The servers' file has a real vocabulary (the embedded model's): the synthetic default, 258
# tokens padded with UNUSED [PAD] tokens, makes both servers stream no text. Writes the scripts'
# JSON to $OUT and the logs in one tar (a call returns at most 8 files).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/m /tmp/logs
LIMIT=${LIMIT:-570}
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -1   # once a machine: a background stage may be importing from it
export PYTHONPATH=/tmp/site:$PWD/src TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
VOCAB=${VOCAB:-src/alphallama/data/alphallama-embedded.gguf}   # or its tokenizer keys alone (a staging call)

synth() {   # synth OUT ARGS...: one file, written under a temporary name (a cut write leaves no file)
  local out=$1; shift
  [ -f "$out" ] && return 0
  python3 -m alphallama synth "$@" -o "$out.tmp" > "/tmp/logs/synth-$(basename "$out").log" 2>&1 && mv "$out.tmp" "$out"
}
files() {   # the 8B files: IQ4_XS (llama-bench and ours), servers (real vocab); one at a time
  synth /tmp/m/qwen3-8b-IQ4_XS.gguf --preset qwen3-8b --quant IQ4_XS
  synth /tmp/m/qwen3-8b-np.gguf --preset qwen3-8b --vocab-from $VOCAB
}

finish() { cp /tmp/build.out /tmp/logs/ 2>/dev/null; mv "$OUT"/*.log /tmp/logs/ 2>/dev/null
           tar -czf "$OUT/logs-$1.tgz" -C /tmp logs; ls "$OUT"; }

offload_v2() {   # offload_v2 RESERVE_S: leave RESERVE_S of the call for what follows
  timeout $((LIMIT - $1 - SECONDS)) python3 bench/gpu_offload_v2.py --layers 12 --fractions 1.0 0.5 0.25 0.1 \
      > /tmp/logs/offload_v2.log 2>&1
  grep -E '"config"' /tmp/logs/offload_v2.log | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(f\"{r['config'][:64]:64s} {r['tok_s']:8.1f} tok/s {r['ms_per_round']:7.3f} ms hit {r.get('hit_rate') or 1:.2f}\")"
}
offload_llamacpp() {   # llama.cpp's --n-cpu-moe at offload v2's budgets, when its file and the build are there
  [ -f /tmp/offload-v2-synth.gguf ] && [ -x /tmp/llama.cpp/build/bin/llama-bench ] && [ $((LIMIT - SECONDS)) -gt 60 ] \
    && timeout $((LIMIT - SECONDS)) python3 bench/gpu_offload_llamacpp.py --gguf /tmp/offload-v2-synth.gguf 2>&1 | tail -12
}
background() {
  setsid nice -n 19 bash bench/gpu_llamacpp.sh build > /tmp/build.out 2>&1 < /dev/null &
  setsid nice -n 19 bash "$0" files > /dev/null 2>&1 < /dev/null &
}

case "${1:-}" in
bg) background ;;
start)
  background
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/kernels/test_moe_oai.py 2>&1 | tail -3
  offload_v2 0
  tail -2 /tmp/build.out; ls /tmp/m
  finish start ;;
files) files ;;
compare)   # issue 32's IQ4_XS first, then 33's -np servers, then 34's llama.cpp offload in what is left
  wait_for() { while [ ! -e "$1" ] && pgrep -f "$2" > /dev/null; do sleep 3; [ $SECONDS -gt $3 ] && break; done; }
  wait_for /nonexistent "cmake --build" 300                       # the build: both programs
  wait_for /tmp/m/qwen3-8b-IQ4_XS.gguf "gpu_session.sh files" 300
  echo "build and IQ4_XS file at $SECONDS s"; ls /tmp/m /tmp/llama.cpp/build/bin/llama-bench
  bash bench/gpu_llamacpp.sh bench /tmp/m/qwen3-8b-IQ4_XS.gguf
  timeout 180 python3 bench/gpu_decode_arms.py --preset qwen3-8b --quant IQ4_XS \
      --file /tmp/m/qwen3-8b-IQ4_XS.gguf --arms default f32 --reps 30 > /tmp/logs/arms-IQ4_XS.log 2>&1
  tail -3 /tmp/logs/arms-IQ4_XS.log
  wait_for /tmp/m/qwen3-8b-np.gguf "gpu_session.sh files" $((LIMIT - 120))
  left=$((LIMIT - SECONDS - 15)); [ $left -gt 260 ] && left=260
  [ $left -gt 60 ] && timeout $left python3 bench/gpu_np_servers.py --gguf /tmp/m/qwen3-8b-np.gguf --ns 1 2 4 \
      --tokens 128 --prompt-tokens 512 --ctx-per-slot 2048 --timeout 120 --stop-timeout 10 2>&1 | tail -12
  offload_llamacpp
  finish compare ;;
offload)
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/kernels/test_moe_oai.py 2>&1 | tail -3
  offload_v2 180
  offload_llamacpp
  finish offload ;;
*) echo "stage: bg | start | compare | offload"; exit 2 ;;
esac
