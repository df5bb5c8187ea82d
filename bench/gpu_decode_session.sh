#!/usr/bin/env bash
# Device calls for the decode engine, each inside one 10-minute call (repo root, .whl carried and
# installed to /tmp/site as in the other device scripts; GIT_COMMIT set). The cases that produce
# figures the README and docs/decisions cite; the probes of lost experiments are in git history
# (before f56c13c) and docs/decisions/lost-experiments.md.
#   bash bench/gpu_decode_session.sh tests     # the GPU tests of the kernels and the runtime
#   bash bench/gpu_decode_session.sh prefill   # 30B-A3B prefill: grouped expert GEMMs (+graphs) against the loop and the graphs
#   bash bench/gpu_decode_session.sh profile   # device time per kernel in the decode graphs, PDL off
#   bash bench/gpu_decode_session.sh arms      # both shapes at the defaults
#   bash bench/gpu_decode_session.sh ablate    # both shapes: the round against its dense GEMVs alone, the experts, the rest
#   bash bench/gpu_decode_session.sh fast      # fast mode's hybrid (dp4a narrow, the mma wider) against the default, both shapes
#   bash bench/gpu_decode_session.sh mma       # the tensor-core GEMV (qgemv_mma_k, Q4_K) against dp4a at W 1-16, its GPU tests
#   bash bench/gpu_decode_session.sh tiles     # the GEMV tile sweep (8B matrices, the 30B-A3B attention)
#   bash bench/gpu_decode_session.sh ncu       # Nsight Compute on the decode GEMV (8B matrices, W = 1, 4)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
case "$1" in
tests)
  timeout 560 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/runtime 2>&1 | tail -15
  ;;
prefill)
  timeout 560 python3 bench/gpu_prefill_moe.py --preset qwen3-30b-a3b --commit "${GIT_COMMIT:-unknown}" 2>&1 \
      | grep -v "_warn_once\|UserWarning"
  ;;
arms)
  # both shapes at the defaults (moe-emit and route-in-norm: slower, removed 20261201);
  # ARMS_EXTRA_8B / ARMS_EXTRA: the arms to set against them
  timeout 150 python3 bench/gpu_decode_arms.py --preset qwen3-8b --arms default ${ARMS_EXTRA_8B:-} 2>&1 \
      | grep -v "_warn_once\|UserWarning" | tail -4
  timeout 300 python3 bench/gpu_decode_arms.py --preset qwen3-30b-a3b --arms default \
      ${ARMS_EXTRA:-} 2>&1 | grep -v "_warn_once\|UserWarning" | tail -5
  ;;
mma)
  # do the kernels' GPU tests pass (the PTX, not the emulation), and what do the tensor-core
  # GEMVs and their dp4a partner (qgemv_q8k: the same bits) cost against dp4a
  # (bench/gpu_mma_probe.py: how Triton lays out the fragments, run on its own)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qgemv_mma.py tests/kernels/test_qgemv_q8k.py \
      tests/runtime/test_gpu_model.py -k "mma or tensor_cores or q8k or fragment or bit or width or narrow or exact" 2>&1 | tail -3
  timeout 360 python3 bench/gpu_qgemv_mma.py 2>&1 | grep -v "_warn_once\|UserWarning"
  ;;
fast)
  # fast mode's hybrid (--fast): dp4a up to engine.fast_mma_narrow rows, the mma family wider; W = 1 must
  # stay the default's, W = 8 equal mma-wide2's bits; both shapes
  timeout 300 python3 bench/gpu_decode_arms.py --preset qwen3-8b --arms default default/mma-wide2 default/fast \
      --widths 1 2 3 4 5 6 8 12 16 2>&1 | grep -v "_warn_once\|UserWarning" | tail -4
  timeout 260 python3 bench/gpu_decode_arms.py --preset qwen3-30b-a3b --arms default default/fast \
      --widths 1 4 5 8 16 2>&1 | grep -v "_warn_once\|UserWarning" | tail -3
  ;;
ablate)
  # where a round goes with PDL on: captured graphs of the calls one round made (values garbage, times real)
  for p in qwen3-8b qwen3-30b-a3b; do
    timeout 280 python3 bench/gpu_decode_ablate.py --preset $p --widths 1 4 8 2>&1 | grep -v "_warn_once\|UserWarning" | tail -4
  done
  ;;
tiles)
  # the GEMV tile per weight again, now that programs hold at most 4 x rows (qgemv_i8.MAX_BW)
  timeout 560 python3 bench/gpu_qgemv_tiles.py --shapes gate_up down_q6 down_q4 qkv o qkv_30b o_30b 2>&1 \
      | grep -v "_warn_once\|UserWarning"
  ;;
ncu)
  # what bounds the decode GEMV (8B matrices, W = 1 and 4): throughput, occupancy, stalls
  timeout 500 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis -k regex:qgemv_i8 \
      python3 bench/ncu_qgemv_i8.py > "$OUT/ncu-qgemv-i8-$(date +%Y%m%d).txt" 2>&1
  grep -E "qgemv_i8_kernel|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Stall" "$OUT"/ncu-qgemv-i8-*.txt | head -80
  ;;
profile)
  # where a round's time goes, both shapes, launched without PDL (kernel times then add up)
  timeout 300 python3 bench/gpu_decode_profile.py --no-pdl --commit "${GIT_COMMIT:-unknown}" 2>&1 \
      | grep -v "_warn_once\|UserWarning"
  ;;
*)
  echo "usage: $0 tests|prefill|profile|arms|ablate|fast|mma|tiles|ncu"; exit 2
  ;;
esac
ls -l "$OUT"
