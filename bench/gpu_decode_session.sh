#!/usr/bin/env bash
# The next device session's first calls for issue 7, each inside one 10-minute call
# (repo root, .whl carried and installed to /tmp/site as in the other device scripts; GIT_COMMIT set).
#   bash bench/gpu_decode_session.sh tests     # the GPU tests of the kernels and the runtime
#   bash bench/gpu_decode_session.sh prefill   # 30B-A3B prefill: grouped expert GEMMs (+graphs) against the loop and the graphs
#   bash bench/gpu_decode_session.sh profile   # device time per kernel in the decode graphs, PDL off
#   bash bench/gpu_decode_session.sh arms      # both shapes at the defaults
#   bash bench/gpu_decode_session.sh route1-capture   # the MoE prefill capture failure with routing at 1 warp, in full
#   bash bench/gpu_decode_session.sh ncu       # Nsight Compute on the decode GEMV (8B matrices, W = 1, 4)
#   bash bench/gpu_decode_session.sh tiles     # the GEMV tile sweep at MAX_BW 4 (8B matrices, the 30B-A3B attention)
#   bash bench/gpu_decode_session.sh barrier   # grid-wide barriers in one persistent kernel against a PDL chain
#   bash bench/gpu_decode_session.sh final     # both shapes at the defaults, with their last flips' controls
#   bash bench/gpu_decode_session.sh mma       # the tensor-core GEMV (qgemv_mma_k, Q4_K) against dp4a at W 1-16, its GPU tests
#   bash bench/gpu_decode_session.sh mma-arms  # 8B rounds: Q4_K on qgemv_q8k (W <= 4 or 1) and the mma wider
#   bash bench/gpu_decode_session.sh mma-arms2 # 8B rounds: Q4_K on qgemv_q8k at every W; everything on the mma
#   bash bench/gpu_decode_session.sh q8k       # qgemv_q8k's tile at W 1-4, then 8B rounds: the mma from W = 5 or 3
#   bash bench/gpu_decode_session.sh ablate    # both shapes: the round against its dense GEMVs alone, the experts, the rest
#   bash bench/gpu_decode_session.sh mma-g2    # qgemv_mma_k with two row groups a warp (one activation fetch) against one, W 1-16
#   bash bench/gpu_decode_session.sh fast      # fast mode's hybrid (dp4a narrow, the mma wider) against the default, both shapes
#   bash bench/gpu_decode_session.sh rows      # session 27: whole Q4_K rows loaded before the PDL wait (chain probe, tiles, 8B rounds)
#   bash bench/gpu_decode_session.sh probes    # a weight stream by load form (registers, TMA, persistent); the PDL boundary's timeline
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
mma-arms)
  # whole 8B rounds at every width, the defaults against engine.gemv_mma: mma-wide (Q4_K through
  # qgemv_q8k at W <= 4 and the mma wider, one set of bits: exact), mma-wide1 (qgemv_q8k at W = 1
  # only). Their GPU tests: the mma case. mma-arms2: the rest (the Q6_K arm: slower, removed 20261201)
  W="1 2 3 4 5 6 7 8 12 16 32 64"
  timeout 570 python3 bench/gpu_decode_arms.py --preset qwen3-8b --arms default default/mma-wide default/mma-wide1 \
      --widths $W 2>&1 | grep -v "_warn_once\|UserWarning" | tail -4
  ;;
mma-arms2)
  # default/q8k: Q4_K through qgemv_q8k at every width (dp4a on q8_K activations, no tensor
  # cores); default/mma-k: the Q4_K weights on the mma at every width (with Q6_K and the head
  # too: measured 20261201-184043)
  W="1 2 3 4 5 6 7 8 12 16 32 64"
  timeout 560 python3 bench/gpu_decode_arms.py --preset qwen3-8b --arms default default/q8k default/mma-k \
      --widths $W 2>&1 | grep -v "_warn_once\|UserWarning" | tail -4
  [ "${MMA_30B:-0}" = 1 ] && timeout 300 python3 bench/gpu_decode_arms.py --preset qwen3-30b-a3b --arms default \
      default/mma-wide --widths $W 2>&1 | grep -v "_warn_once\|UserWarning" | tail -3
  ;;
q8k)
  # qgemv_q8k (the mma's dp4a partner) at the widths mma-wide gives it, its [rows, run halves, slots]
  # tile (session 24, untimed: the rule's tile first, then rows x warps) against dp4a; the 8B rounds
  # with the mma from W = 5 (mma-wide) or W = 3 (mma-wide2); then where mma-wide's W = 1 time goes
  timeout 240 python3 bench/gpu_q8k_tiles.py --shapes qkv o gate_up down_q4 --widths 1 2 4 2>&1 \
      | grep -v "_warn_once\|UserWarning"
  timeout 220 python3 bench/gpu_decode_arms.py --preset qwen3-8b --arms default default/mma-wide default/mma-wide2 \
      --widths 1 2 4 5 8 16 2>&1 | grep -v "_warn_once\|UserWarning" | tail -4
  timeout 120 python3 bench/gpu_decode_profile.py --preset qwen3-8b --no-pdl --mma-control \
      --commit "${GIT_COMMIT:-unknown}" 2>&1 | grep -v "_warn_once\|UserWarning"
  ;;
mma-g2)
  # session 25's untimed build: at W = 8 the mma kernel's activation loads are 9 of a warp's 23
  # a super-block; two row groups a warp share them (172-243 registers on sm_90 against 128-153)
  timeout 330 python3 bench/gpu_qgemv_mma.py --shapes gate_up qkv o down_q4 --widths 1 8 16 2>&1 \
      | grep -v "_warn_once\|UserWarning"
  # whole 8B rounds: the exact-mode mma family with one and two row groups a warp (the same bits)
  timeout 240 python3 bench/gpu_decode_arms.py --preset qwen3-8b --arms default default/mma-wide2 \
      default/mma-wide2-g2 --widths 1 2 4 5 8 16 2>&1 | grep -v "_warn_once\|UserWarning" | tail -4
  ;;
fast)
  # fast mode's hybrid (--fast): dp4a up to engine.fast_mma_narrow rows, the mma family wider; W = 1 must
  # stay the default's, W = 8 equal mma-wide2's bits; both shapes
  timeout 300 python3 bench/gpu_decode_arms.py --preset qwen3-8b --arms default default/mma-wide2 default/fast \
      --widths 1 2 3 4 5 6 8 12 16 2>&1 | grep -v "_warn_once\|UserWarning" | tail -4
  timeout 260 python3 bench/gpu_decode_arms.py --preset qwen3-30b-a3b --arms default default/fast \
      --widths 1 4 5 8 16 2>&1 | grep -v "_warn_once\|UserWarning" | tail -3
  ;;
probes)
  # what bounds a decode kernel apart from our kernels (session 25): bytes by load form, and
  # a PDL boundary's timeline (%globaltimer in every program)
  timeout 330 python3 bench/gpu_stream_probe.py --shapes o qkv down_q4 gate_up 2>&1 | grep -v "_warn_once\|UserWarning"
  timeout 60 python3 bench/gpu_pdl_overlap.py 2>&1 | grep -v "_warn_once\|UserWarning"
  ;;
rows)
  # session 27: the megakernel probe's chain with a Q4_K row's dp4a work; the real GEMV with whole
  # rows loaded before the PDL wait, behind a 2 us kernel; then whole 8B rounds with one-step rows
  timeout 60 python3 bench/gpu_megakernel_probe.py --spin-scale 0 1 2>&1 | grep -v "_warn_once\|UserWarning" | tail -3
  timeout 230 python3 bench/gpu_gemv_chain.py 2>&1 | grep -v "_warn_once\|UserWarning"
  timeout 270 python3 bench/gpu_decode_arms.py --preset qwen3-8b --arms default default/row128 default/row128-bn8w4 \
      --widths 1 2 4 8 2>&1 | grep -v "_warn_once\|UserWarning" | tail -5
  ;;
rows3)
  # session 27's one-step rows as the default: the GEMV and runtime GPU tests, then both shapes
  # against the looped tiles (the control)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_qgemv_i8.py tests/kernels/test_moe_i8.py \
      tests/runtime 2>&1 | tail -3
  timeout 150 python3 bench/gpu_decode_arms.py --preset qwen3-8b --arms default default/looped \
      --widths 1 2 4 8 16 2>&1 | grep -v "_warn_once\|UserWarning" | tail -3
  timeout 200 python3 bench/gpu_decode_arms.py --preset qwen3-30b-a3b --arms default default/looped \
      --widths 1 2 4 8 16 2>&1 | grep -v "_warn_once\|UserWarning" | tail -3
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
final)
  # the defaults (norm_router and early_kv on since 20261130) against their controls, and 64-key attention tiles
  timeout 200 python3 bench/gpu_decode_arms.py --preset qwen3-8b --arms default default/no-early-kv \
      default/attn-bn64 2>&1 | grep -v "_warn_once\|UserWarning" | tail -4
  timeout 260 python3 bench/gpu_decode_arms.py --preset qwen3-30b-a3b --arms default default/no-norm-router \
      default/no-early-kv default/attn-bn64 2>&1 | grep -v "_warn_once\|UserWarning" | tail -5
  ;;
barrier)
  # what a persistent per-layer kernel would pay: S stages as a PDL chain of kernels against
  # one persistent kernel with grid-wide barriers (and loading the next stage before the spin)
  timeout 300 python3 bench/gpu_grid_barrier.py --stages 12 --mb 0 1 4 16 2>&1 | grep -v "_warn_once\|UserWarning"
  ;;
ncu)
  # what bounds the decode GEMV (8B matrices, W = 1 and 4): throughput, occupancy, stalls
  timeout 500 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis -k regex:qgemv_i8 \
      python3 bench/ncu_qgemv_i8.py > "$OUT/ncu-qgemv-i8-$(date +%Y%m%d).txt" 2>&1
  grep -E "qgemv_i8_kernel|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Stall" "$OUT"/ncu-qgemv-i8-*.txt | head -80
  ;;
route1-capture)
  # why routing at 1 warp breaks the MoE prefill chunk's graph capture (docs/decisions/launch-cuts-kept.md):
  # the prefill tests with moe.ROUTE_WARPS = 1, launches blocking, the first error in full
  CUDA_LAUNCH_BLOCKING=1 timeout 200 python3 -c "import alphallama.kernels.moe as m; m.ROUTE_WARPS = 1
import pytest, sys; sys.exit(pytest.main(['-x', '-q', '-p', 'no:cacheprovider', '--tb=long',
    'tests/runtime/test_gpu_prefill.py', 'tests/runtime/test_gpu_moe.py']))" 2>&1 | grep -v "CUDAGraph.cpp" | head -150
  ;;
profile)
  # where a round's time goes, both shapes, launched without PDL (kernel times then add up)
  timeout 300 python3 bench/gpu_decode_profile.py --no-pdl --commit "${GIT_COMMIT:-unknown}" 2>&1 \
      | grep -v "_warn_once\|UserWarning"
  ;;
*)
  echo "usage: $0 tests|prefill|profile|arms|route1-capture|ncu|tiles|barrier|final|mma|mma-arms|mma-arms2|ablate|q8k|probes|mma-g2|fast|rows|rows3"; exit 2
  ;;
esac
ls -l "$OUT"
