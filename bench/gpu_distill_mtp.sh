#!/usr/bin/env bash
# Distil the MTP sidecar of Qwen2.5-Coder-0.5B-Instruct on the device (one H200).
#
# The lead stages the model as /tmp/models/qwen.gguf, then (repo root, .whl carried):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit
#   export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 GIT_COMMIT=<commit>
#   bash bench/gpu_distill_mtp.sh [MODEL] [TRAIN_SECONDS] [extra distill_mtp flags...]
#
# Writes to $OUT: <name>.partNN + <name>.sha256 (the sidecar, <= 15 MiB a part),
# distill_curves.json (curves, held-out evaluation, host), distill.log.
# Join here: python -m alphallama.train join DIR/<name>.sha256 -o <model dir>/<name>
set -euo pipefail
MODEL=${1:-/tmp/models/qwen.gguf}
BUDGET=${2:-240}
shift $(( $# < 2 ? $# : 2 ))
OUT=${OUT:-/tmp/distill-out}
NAME=${SIDECAR_NAME:-qwen2.5-coder-0.5b-instruct.mtp.gguf}
mkdir -p "$OUT"
if [ ! -f "$MODEL" ]; then
    echo "gpu_distill_mtp: $MODEL: no such file (stage the model first)" | tee "$OUT/distill.log" >&2
    exit 2
fi
python3 -m alphallama.train.distill_mtp -m "$MODEL" --out "$OUT" --sidecar-name "$NAME" \
    --time-budget-s "$BUDGET" "$@" 2>&1 | tee "$OUT/distill.log"
ls -l "$OUT"
