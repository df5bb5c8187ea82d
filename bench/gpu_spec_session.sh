#!/usr/bin/env bash
# The lead's device calls for issue 6's GPU figures (repo root, .whl carried, gguf installed to
# /tmp/site as in the other device scripts; GIT_COMMIT set).
#   bash bench/gpu_spec_session.sh qwen <qwen sha256> [TRAIN_S] [DEADLINE_S]
#       join the staged Qwen2.5-Coder-0.5B parts (bench/stage_model.sh: /tmp/models/qwen.pK, checked by sha256), distil its
#       MTP sidecar (bench/gpu_distill_mtp.sh, time-boxed), then the public suite through the engine,
#       arms none / ngram / mtp / mtp,ngram, on Qwen + the new sidecar.
#   bash bench/gpu_spec_session.sh qwen-suite <qwen sha256>
#       the suite only, with a sidecar carried as models/qwen2.5-coder-0.5b-instruct.mtp.gguf.
#   bash bench/gpu_spec_session.sh embedded
#       the same suite on the embedded model (carried as models/embedded/alphallama-embedded{,.mtp}.gguf).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/models
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
case "$1" in
qwen)
  SHA=$2; TRAIN_S=${3:-130}; DEADLINE_S=${4:-270}
  Q=/tmp/models/qwen.gguf
  [ -f $Q ] || bash bench/stage_model.sh join qwen $Q "$SHA" || exit 2
  D=/tmp/distill; mkdir -p $D
  OUT=$D timeout $((DEADLINE_S + 45)) bash bench/gpu_distill_mtp.sh $Q "$TRAIN_S" --gen-budget-s 40 \
      --deadline-s "$DEADLINE_S" > $D/stdout.txt 2>&1
  tail -20 $D/stdout.txt
  N=qwen2.5-coder-0.5b-instruct.mtp.gguf
  cp $D/$N.part* $D/$N.sha256 $D/distill_curves.json "$OUT"/
  python3 -m alphallama.train join $D/$N.sha256 -o /tmp/models/qwen.mtp.gguf || exit 3
  timeout 230 python3 bench/spec_suite.py -m $Q --draft-head /tmp/models/qwen.mtp.gguf --device cuda \
      --out "$OUT" --tag h200 2>&1 | tail -40
  ;;
qwen-suite)
  Q=/tmp/models/qwen.gguf
  [ -f $Q ] || bash bench/stage_model.sh join qwen $Q "$2" || exit 2
  H=models/qwen2.5-coder-0.5b-instruct.mtp.gguf   # the distilled MTP sidecar, if carried (models/ is ignored)
  ARMS=$( [ -f $H ] && echo "--draft-head $H" || echo "--arms none ngram" )   # without it: plain and n-gram
  timeout 230 python3 bench/spec_suite.py -m $Q $ARMS --device cuda --out "$OUT" --tag h200 2>&1 | tail -40
  ;;
embedded)
  timeout 150 python3 bench/spec_suite.py -m models/embedded/alphallama-embedded.gguf --device cuda \
      --max-tokens 256 --out "$OUT" --tag h200 2>&1 | tail -40
  ;;
esac
ls -l "$OUT"
