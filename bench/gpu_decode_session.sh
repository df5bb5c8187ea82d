#!/usr/bin/env bash
# The next device session's first calls for issue 7, each inside one 10-minute call
# (repo root, .whl carried and installed to /tmp/site as in the other device scripts; GIT_COMMIT set).
#   bash bench/gpu_decode_session.sh arms      # MoE PDL and engine.fuse_combine, both shapes, with bit checks
#   bash bench/gpu_decode_session.sh prefill   # 30B-A3B prefill: batched experts (dequant) against the decode graphs
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
case "$1" in
arms)
  timeout 330 python3 bench/gpu_decode_arms.py --preset qwen3-30b-a3b \
      --arms i8+fuse+moe_i8 i8+fuse+moe_i8+pdl i8+fuse+moe_i8+pdl+combine 2>&1 | tail -4
  timeout 230 python3 bench/gpu_decode_arms.py --preset qwen3-8b --arms i8+fuse+pdl i8+fuse+pdl+combine 2>&1 | tail -3
  ;;
prefill)
  timeout 560 python3 bench/gpu_engine.py --preset qwen3-30b-a3b --prefill 128 512 --gemv --no-decode \
      --commit "${GIT_COMMIT:-unknown}" 2>&1 | tail -30
  ;;
*)
  echo "usage: $0 arms|prefill"; exit 2
  ;;
esac
ls -l "$OUT"
