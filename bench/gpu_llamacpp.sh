#!/usr/bin/env bash
# llama.cpp on the device machine, in the same session as our figures (the README's and the
# issues' comparisons "same run"). The source comes from `bash bench/llamacpp_source.sh`
# (.devcarry/llama.cpp-src.tar.gz, carried: `carry: [".devcarry"]`); the build stays in
# /tmp/llama.cpp while the machine is warm, so build once, then bench in later calls.
#   bash bench/gpu_llamacpp.sh build                  # CUDA build of llama-bench + llama-server (sm_90)
#   bash bench/gpu_llamacpp.sh bench F.gguf [...]     # llama-bench pp512 / tg128, all layers on the GPU, FA on
#   bash bench/gpu_llamacpp.sh server F.gguf [ARGS]   # llama-server on :8090 in the background (setsid)
# Writes $OUT/llamacpp-build.log, $OUT/llama-bench-<stem>.json.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SRC=/tmp/llama.cpp
BIN=$SRC/build/bin
case "${1:-}" in
build)
  # a build cut off by a call's limit resumes where it stopped (ninja) in the next call
  t0=$(date +%s)
  if [ ! -f "$SRC/build/build.ninja" ]; then
    rm -rf "$SRC" && mkdir -p "$SRC" && tar -xzf .devcarry/llama.cpp-src.tar.gz -C "$SRC" || exit 1
    cmake -S "$SRC" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF > "$OUT/llamacpp-build.log" 2>&1 || exit 1
  fi
  cmake --build "$SRC/build" -j "$(nproc)" --target llama-bench llama-server >> "$OUT/llamacpp-build.log" 2>&1
  rc=$?
  echo "llama.cpp build rc=$rc in $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/llamacpp-build.log"
  exit $rc
  ;;
bench)
  shift
  for f in "$@"; do
    stem=$(basename "$f" .gguf)
    "$BIN/llama-bench" -m "$f" -p 512 -n 128 -ngl 99 -fa 1 -r 3 -o json > "$OUT/llama-bench-$stem.json" \
        2> "$OUT/llama-bench-$stem.log" || { echo "llama-bench failed on $f"; tail -5 "$OUT/llama-bench-$stem.log"; continue; }
    python3 - "$OUT/llama-bench-$stem.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    kind = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
    print(f"{r['model_filename'].split('/')[-1]:40s} {kind:6s} {r['avg_ts']:10.1f} tok/s (+- {r['stddev_ts']:.1f})")
PY
  done
  ;;
server)
  shift; f=$1; shift
  setsid "$BIN/llama-server" -m "$f" --host 127.0.0.1 --port 8090 -ngl 99 -fa on "$@" \
      > /tmp/llama-server.log 2>&1 < /dev/null &
  echo "llama-server pid $! on :8090 (log /tmp/llama-server.log)"
  ;;
*)
  echo "stage: build | bench F.gguf ... | server F.gguf [ARGS]"; exit 2 ;;
esac
