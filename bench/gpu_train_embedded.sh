#!/usr/bin/env bash
# Retrain the embedded model and evaluate it against the model the tree embeds now, in ONE
# device call of at most 10 minutes (issue 29; docs/decisions/embedded-model.md, "The next
# run's recipe"). Repo root, .whl carried (gguf; the device has torch and tokenizers):
#
#   GIT_COMMIT=<commit> bash bench/gpu_train_embedded.sh [extra `alphallama.train run` flags]
#
# Timeline (DEADLINE_S 530 from the trainer's start, LIMIT_S 585 for the whole script):
# wheels ~10 s; `python -m alphallama.train run`: data ~50 s, training until DEADLINE_S - 45 s
# (~7 min), export; the "before" model (src/alphallama/data/) is evaluated on the CPU while
# the GPU trains (BEFORE_JOBS processes, from the moment the data stage is cached); the new
# model is evaluated against that record afterwards (EVAL_JOBS processes), cut off at
# LIMIT_S: the model files are in $OUT before its evaluation starts.
#
# $OUT (7 files): alphallama-embedded.gguf.part00 / .part01 / .sha256 (<= 15.5 MiB a part),
# alphallama-embedded.mtp.gguf, train.json, eval.json (before / after side by side: held-out
# bits per byte, edits exact per kind, the 4 chats (function, plausible), the repeated share
# of 6-word windows on chats and on 8 held-out continuations), bundle.tgz (heldout.jsonl.gz,
# manifest.tsv.gz, before.json, the logs). Here, afterwards:
#   python -m alphallama.train join OUT/alphallama-embedded.gguf.sha256 -o alphallama-embedded.gguf
# If eval.json is missing (cut off), evaluate here from the bundle:
#   python -m alphallama.train.evaluate NEW.gguf --baseline-json before.json --heldout heldout.jsonl.gz -o eval.json
#
# CPU smoke (a tiny model, a few steps; every stage runs): see tests/train/test_gpu_train_script.py
#   DEVICE=cpu DEADLINE_S=300 LIMIT_S=900 BEFORE=<small.gguf> EVAL_ARGS="--per-kind 1 --windows 1 ..." \
#     bash bench/gpu_train_embedded.sh --max-steps 3 --ctx 256 --d-model 32 ...
set -uo pipefail
OUT=${OUT:-/tmp/train-out}
mkdir -p "$OUT"
DEADLINE_S=${DEADLINE_S:-530}
LIMIT_S=${LIMIT_S:-585}
BEFORE_JOBS=${BEFORE_JOBS:-6}
EVAL_JOBS=${EVAL_JOBS:-14}
DEVICE=${DEVICE:-auto}
BEFORE=${BEFORE:-src/alphallama/data/alphallama-embedded.gguf}
EVAL_ARGS=${EVAL_ARGS:-}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
if ! python3 -c "import gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "gpu_train_embedded: wheels failed" >&2; exit 2; }
fi
export PYTHONPATH=/tmp/site:$PWD/src
WORK=$(mktemp -d /tmp/alphallama-train.XXXXXX)     # fresh (0700): no stale checkpoint resumes
RUN=$WORK/run
AFTER=$WORK/after
mkdir -p "$RUN" "$AFTER"
[ -f "$BEFORE" ] || { echo "gpu_train_embedded: $BEFORE: no such model" >&2; exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "[$SECONDS s] training (deadline ${DEADLINE_S} s), before-model $BEFORE"

python3 -m alphallama.train run --out "$RUN" --work-dir "$WORK/cache" --deadline-s "$DEADLINE_S" \
    --time-budget-s 100000 --checkpoint-every-s 100000 --device "$DEVICE" --commit "${GIT_COMMIT:-unknown}" \
    "$@" > "$RUN/train.log" 2>&1 &
TRAIN=$!

# the before-model's evaluation needs only the held-out files: start it once the data stage is done
while [ ! -f "$WORK/cache/data.pt" ] && kill -0 "$TRAIN" 2>/dev/null; do sleep 2; done
BEFORE_PID=
if [ -f "$WORK/cache/heldout.jsonl.gz" ]; then
    echo "[$SECONDS s] data ready; evaluating the before-model on the CPU (${BEFORE_JOBS} jobs)"
    python3 -m alphallama.train.evaluate "$BEFORE" --heldout "$WORK/cache/heldout.jsonl.gz" --jobs "$BEFORE_JOBS" \
        $EVAL_ARGS -o "$RUN/before.json" > "$RUN/before.log" 2>&1 &
    BEFORE_PID=$!
fi
wait "$TRAIN"
rc=$?
tail -n 6 "$RUN/train.log"
echo "[$SECONDS s] training exited $rc"
for f in alphallama-embedded.gguf.part00 alphallama-embedded.gguf.part01 alphallama-embedded.gguf.sha256 \
         alphallama-embedded.mtp.gguf train.json; do
    [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/"
done
bundle() {
    (cd "$RUN" && tar czf "$OUT/bundle.tgz" --ignore-failed-read heldout.jsonl.gz manifest.tsv.gz before.json \
        train.log before.log eval.log 2>/dev/null)
    ls -l "$OUT"
}
if [ $rc -ne 0 ] || [ ! -f "$RUN/alphallama-embedded.gguf.sha256" ]; then
    echo "gpu_train_embedded: no model came out of training" >&2
    [ -n "$BEFORE_PID" ] && kill "$BEFORE_PID" 2>/dev/null
    bundle
    exit 1
fi
python3 -m alphallama.train join "$RUN/alphallama-embedded.gguf.sha256" -o "$AFTER/alphallama-embedded.gguf" || exit 1
cp "$RUN/alphallama-embedded.mtp.gguf" "$AFTER/"
if [ -n "$BEFORE_PID" ]; then
    wait "$BEFORE_PID"
    echo "[$SECONDS s] before-model evaluated (exit $?)"
fi
left=$((LIMIT_S - SECONDS))
echo "[$SECONDS s] evaluating the new model (${EVAL_JOBS} jobs, at most ${left} s)"
if [ -f "$RUN/before.json" ] && [ $left -gt 20 ]; then
    timeout "$left" python3 -m alphallama.train.evaluate "$AFTER/alphallama-embedded.gguf" \
        --baseline-json "$RUN/before.json" --heldout "$RUN/heldout.jsonl.gz" --jobs "$EVAL_JOBS" \
        $EVAL_ARGS --commit "${GIT_COMMIT:-unknown}" -o "$OUT/eval.json" > "$RUN/eval.log" 2>&1
    echo "[$SECONDS s] evaluation exited $?"
    cat "$RUN/eval.log" | grep -v "^[0-9]*/[0-9]* " | tail -n 20
else
    echo "gpu_train_embedded: no before-record or no time left: evaluate from bundle.tgz here" >&2
fi
bundle
