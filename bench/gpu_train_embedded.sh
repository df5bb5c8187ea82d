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
# manifest.tsv.gz, before.json, step_ab.json (the step's time, old recipe against new, on this
# card, timed while the CPU evaluates), the logs). Here, afterwards:
#   python -m alphallama.train join OUT/alphallama-embedded.gguf.sha256 -o alphallama-embedded.gguf
# If eval.json is missing (cut off), evaluate here from the bundle:
#   python -m alphallama.train.evaluate NEW.gguf --baseline-json before.json --heldout heldout.jsonl.gz -o eval.json
#
# Two calls, twice the tokens (the machine kept warm between them, the second issued at once):
#   PART=1 GIT_COMMIT=<commit> bash bench/gpu_train_embedded.sh    # data, ~7 min of training, the
#                                                                  # before-model's evaluation; $OUT: train.json
#   PART=2 GIT_COMMIT=<commit> bash bench/gpu_train_embedded.sh    # resumes: ~7.5 min more, export, evaluation
# The learning rate's schedule spans TOTAL_S trained seconds over both (880 by default:
# part 1 passes --continue-later, so its deadline only stops it); the work folder is
# /tmp/alphallama-train-2call (0700, made afresh by part 1).
#
# A coder model's answers (docs/decisions/embedded-model.md, "The next run's design"): with
# TEACHER=/tmp/models/qwen.gguf (staged: bench/stage_model.sh), part 1 (or the single call) first
# runs `python -m alphallama.train.teach` on the GPU until TEACH_S (150) seconds from its start
# (TEACH_REQUESTS requests, 16384; TEACH_ARGS more flags, e.g. "--batch 512 --max-new 320"), on
# the corpus the trainer reads (the --root / --corpus-mb / --seed of the flags below), then trains
# with --teacher-answers (part 2 passes part 1's file again: the data cache's key holds its
# sha256). The trainer's deadline and TOTAL_S (880 - TEACH_S - 30 by default) give up the
# teacher's seconds. It stops unless at least TEACH_MIN_KEPT (1) answers were kept. Part 1's
# $OUT adds answers.jsonl.gz and answers.summary.json (kept / answered / why the rest were
# dropped, a few samples, tokens/s); part 2's and the single call's bundle.tgz hold them:
#   PART=1 TEACHER=/tmp/models/qwen.gguf GIT_COMMIT=<commit> bash bench/gpu_train_embedded.sh
#   PART=2 TEACHER=/tmp/models/qwen.gguf GIT_COMMIT=<commit> bash bench/gpu_train_embedded.sh
# Or ANSWERS=/tmp/teach/answers.jsonl.gz: a file teach already wrote on this machine (e.g. in the
# last staging call, its summary beside it): part 1 / the single call trains with it at once, with
# the full TOTAL_S.
#
# CPU smoke (a tiny model, a few steps; every stage runs, ~2 min), from the repo root:
#   mkdir -p /tmp/smoke-src && for f in $(python3 -c "import sysconfig;print(sysconfig.get_paths()['stdlib'])")/*.py; do
#     [ $(stat -c %s $f) -lt 40000 ] && cp $f /tmp/smoke-src/; done
#   OUT=/tmp/smoke-out DEVICE=cpu LIMIT_S=900 BEFORE_JOBS=1 EVAL_JOBS=2 \
#   EVAL_ARGS="--per-kind 1 --windows 2 --continuations 2 --max-tokens 8" bash bench/gpu_train_embedded.sh \
#     --root lib=/tmp/smoke-src --corpus-mb 2 --tokenizer-sample-mb 1 --instruct-examples 32 --vocab-size 400 \
#     --ctx 256 --d-model 32 --layers 1 --heads 2 --kv-heads 1 --head-dim 16 --experts 2 --experts-used 1 \
#     --expert-ffn 32 --mtp-ffn 32 --batch-size 2 --max-steps 3 --workers 1 --warmup-steps 1 --split-mib 0.02
# ... and with a teacher (the embedded model stands in for the coder model; it keeps few or no
# answers, hence TEACH_MIN_KEPT=0), the same flags after:
#   TEACHER=src/alphallama/data/alphallama-embedded.gguf TEACH_S=120 TEACH_REQUESTS=8 TEACH_MIN_KEPT=0 \
#   TEACH_ARGS="--max-new 32 --workers 1" OUT=/tmp/smoke-out DEVICE=cpu LIMIT_S=900 BEFORE_JOBS=1 EVAL_JOBS=2 \
#   EVAL_ARGS="--per-kind 1 --windows 2 --continuations 2 --max-tokens 8" bash bench/gpu_train_embedded.sh ...
set -uo pipefail
OUT=${OUT:-/tmp/train-out}
mkdir -p "$OUT"
DEADLINE_S=${DEADLINE_S:-530}
LIMIT_S=${LIMIT_S:-585}
BEFORE_JOBS=${BEFORE_JOBS:-6}
EVAL_JOBS=${EVAL_JOBS:-13}
DEVICE=${DEVICE:-auto}
BEFORE=${BEFORE:-src/alphallama/data/alphallama-embedded.gguf}
EVAL_ARGS=${EVAL_ARGS:-}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
if ! python3 -c "import gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "gpu_train_embedded: wheels failed" >&2; exit 2; }
fi
export PYTHONPATH=/tmp/site:$PWD/src
PART=${PART:-}                                      # "": one call; 1 / 2: the first / second of two
TEACHER=${TEACHER:-}                                # a coder model's GGUF: its answers in the chat data
TEACH_S=${TEACH_S:-150}
TEACH_REQUESTS=${TEACH_REQUESTS:-16384}
TEACH_ARGS=${TEACH_ARGS:-}
TEACH_MIN_KEPT=${TEACH_MIN_KEPT:-1}
if [ -n "$TEACHER" ]; then TOTAL_S=${TOTAL_S:-$((880 - TEACH_S - 30))}; else TOTAL_S=${TOTAL_S:-880}; fi
if [ -z "$PART" ]; then
    WORK=$(mktemp -d /tmp/alphallama-train.XXXXXX)  # fresh (0700): no stale checkpoint resumes
    TRAIN_ARGS=(--time-budget-s 100000 --checkpoint-every-s 100000)
else
    WORK=/tmp/alphallama-train-2call
    case "$PART" in
    1) rm -rf "$WORK" && mkdir -m 700 "$WORK" || exit 2
       TRAIN_ARGS=(--time-budget-s "$TOTAL_S" --checkpoint-every-s 60 --continue-later) ;;
    2) [ -f "$WORK/cache/ckpt.pt" ] || { echo "gpu_train_embedded: PART=2 needs part 1's $WORK/cache/ckpt.pt (the same warm machine)" >&2; exit 2; }
       TRAIN_ARGS=(--time-budget-s "$TOTAL_S" --checkpoint-every-s 60) ;;
    *) echo "gpu_train_embedded: PART is 1 or 2, not $PART" >&2; exit 2 ;;
    esac
fi
RUN=$WORK/run
AFTER=$WORK/after
mkdir -p "$RUN" "$AFTER"
[ "$PART" = 2 ] && mv "$RUN/train.log" "$RUN/train.part1.log"   # part 2 logs afresh, part 1's kept beside
[ -f "$BEFORE" ] || { echo "gpu_train_embedded: $BEFORE: no such model" >&2; exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

ANSWERS_IN=${ANSWERS:-}
if [ -n "$TEACHER" ] || [ -n "$ANSWERS_IN" ]; then
    ANSWERS=$RUN/answers.jsonl.gz
    CORPUS_ARGS=()                                  # the teacher asks of the trainer's corpus
    prev=
    for a in "$@"; do
        case "$prev" in --root|--corpus-mb|--seed) CORPUS_ARGS+=("$prev" "$a") ;; esac
        case "$a" in --root=*|--corpus-mb=*|--seed=*) CORPUS_ARGS+=("$a") ;; esac
        prev=$a
    done
    if [ "$PART" = 2 ]; then
        [ -f "$ANSWERS" ] || { echo "gpu_train_embedded: PART=2 with TEACHER or ANSWERS needs part 1's $ANSWERS" >&2; exit 2; }
    elif [ -n "$ANSWERS_IN" ]; then
        [ -f "$ANSWERS_IN" ] || { echo "gpu_train_embedded: ANSWERS $ANSWERS_IN: no such file" >&2; exit 2; }
        cp "$ANSWERS_IN" "$ANSWERS" || exit 2
        cp "${ANSWERS_IN%.jsonl.gz}.summary.json" "$RUN/answers.summary.json" 2>/dev/null
        echo "[$SECONDS s] the teacher's answers: $ANSWERS_IN"
    else
        [ -f "$TEACHER" ] || { echo "gpu_train_embedded: TEACHER $TEACHER: no such file (bench/stage_model.sh)" >&2; exit 2; }
        echo "[$SECONDS s] the teacher answers $TEACH_REQUESTS requests until ${TEACH_S} s: $TEACHER"
        timeout "$((TEACH_S + 120))" python3 -m alphallama.train.teach "$TEACHER" -o "$ANSWERS" \
            --requests "$TEACH_REQUESTS" --deadline-s "$TEACH_S" --device "$DEVICE" ${CORPUS_ARGS[@]+"${CORPUS_ARGS[@]}"} \
            $TEACH_ARGS > "$RUN/teach.log" 2>&1
        echo "[$SECONDS s] teach exited $?"
        tail -n 4 "$RUN/teach.log"
        kept=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['kept'])" "$RUN/answers.summary.json" 2>/dev/null)
        if [ "${kept:-0}" -lt "$TEACH_MIN_KEPT" ]; then
            echo "gpu_train_embedded: the teacher's answers kept: ${kept:-none} (< TEACH_MIN_KEPT $TEACH_MIN_KEPT)" >&2
            cp "$RUN/teach.log" "$RUN/answers.summary.json" "$OUT/" 2>/dev/null
            exit 2
        fi
        DEADLINE_S=$((DEADLINE_S - SECONDS))        # the trainer's deadline counts from its own start
    fi
    TRAIN_ARGS+=(--teacher-answers "$ANSWERS")
fi
echo "[$SECONDS s] training (deadline ${DEADLINE_S} s), before-model $BEFORE"

python3 -m alphallama.train run --out "$RUN" --work-dir "$WORK/cache" --deadline-s "$DEADLINE_S" \
    "${TRAIN_ARGS[@]}" --device "$DEVICE" --commit "${GIT_COMMIT:-unknown}" \
    "$@" > "$RUN/train.log" 2>&1 &
TRAIN=$!

# the before-model's evaluation needs only the held-out files: start it once the data stage is done
while [ ! -f "$WORK/cache/data.pt" ] && kill -0 "$TRAIN" 2>/dev/null; do sleep 2; done
BEFORE_PID=
if [ -f "$RUN/before.json" ]; then
    echo "[$SECONDS s] the before-model's record is part 1's"
elif [ -f "$WORK/cache/heldout.jsonl.gz" ]; then
    echo "[$SECONDS s] data ready; evaluating the before-model on the CPU (${BEFORE_JOBS} jobs)"
    timeout "$((LIMIT_S - SECONDS - 60))" \
    python3 -m alphallama.train.evaluate "$BEFORE" --heldout "$WORK/cache/heldout.jsonl.gz" --jobs "$BEFORE_JOBS" \
        $EVAL_ARGS -o "$RUN/before.json" > "$RUN/before.log" 2>&1 &
    BEFORE_PID=$!
fi
wait "$TRAIN"
rc=$?
tail -n 6 "$RUN/train.log"
echo "[$SECONDS s] training exited $rc"
if [ "$PART" = 1 ]; then                           # part 2 exports and evaluates
    [ -n "$BEFORE_PID" ] && wait "$BEFORE_PID" && echo "[$SECONDS s] before-model evaluated"
    cp "$RUN/train.json" "$RUN/train.log" "$OUT/" 2>/dev/null
    [ -f "$RUN/answers.jsonl.gz" ] && cp "$RUN/answers.jsonl.gz" "$RUN/answers.summary.json" "$OUT/" 2>/dev/null
    ls -l "$OUT" "$WORK/cache/ckpt.pt"
    exit $rc
fi
for f in "$RUN"/alphallama-embedded.gguf.part* "$RUN"/alphallama-embedded.gguf.sha256 \
         "$RUN"/alphallama-embedded.mtp.gguf "$RUN"/train.json; do
    [ -f "$f" ] && cp "$f" "$OUT/"
done
bundle() {
    (cd "$RUN" && tar czf "$OUT/bundle.tgz" --ignore-failed-read heldout.jsonl.gz manifest.tsv.gz before.json \
        step_ab.json train.log train.part1.log before.log eval.log step_ab.log \
        teach.log answers.jsonl.gz answers.summary.json 2>/dev/null)
    ls -l "$OUT"
}
if [ -f "$RUN/alphallama-embedded.gguf.sha256" ]; then     # split (the real model: 2 parts)
    python3 -m alphallama.train join "$RUN/alphallama-embedded.gguf.sha256" -o "$AFTER/alphallama-embedded.gguf"
elif [ -f "$RUN/alphallama-embedded.gguf" ]; then           # small enough to come back whole
    cp "$RUN/alphallama-embedded.gguf" "$OUT/"
    cp "$RUN/alphallama-embedded.gguf" "$AFTER/"
fi
if [ $rc -ne 0 ] || [ ! -f "$AFTER/alphallama-embedded.gguf" ]; then
    echo "gpu_train_embedded: no model came out of training" >&2
    [ -n "$BEFORE_PID" ] && wait "$BEFORE_PID"
    bundle
    exit 1
fi
cp "$RUN/alphallama-embedded.mtp.gguf" "$AFTER/"
if [ -n "$BEFORE_PID" ]; then
    wait "$BEFORE_PID"
    echo "[$SECONDS s] before-model evaluated (exit $?)"
fi
left=$((LIMIT_S - SECONDS))
# the GPU is idle while the CPU evaluates: time the step, old recipe against new, on this card
if [ "$DEVICE" = cpu ]; then AB_ARGS=${AB_ARGS:---device cpu --steps 1}; else AB_ARGS=${AB_ARGS:---device cuda --steps 8}; fi
timeout "$left" python3 bench/train_step_cost.py $AB_ARGS -o "$RUN/step_ab.json" > "$RUN/step_ab.log" 2>&1 &
AB=$!
echo "[$SECONDS s] evaluating the new model (${EVAL_JOBS} jobs, at most ${left} s); step A/B on the GPU meanwhile"
if [ -f "$RUN/before.json" ] && [ $left -gt 20 ]; then
    timeout "$left" python3 -m alphallama.train.evaluate "$AFTER/alphallama-embedded.gguf" \
        --baseline-json "$RUN/before.json" --heldout "$RUN/heldout.jsonl.gz" --jobs "$EVAL_JOBS" \
        $EVAL_ARGS --commit "${GIT_COMMIT:-unknown}" -o "$OUT/eval.json" > "$RUN/eval.log" 2>&1
    echo "[$SECONDS s] evaluation exited $?"
    cat "$RUN/eval.log" | grep -v "^[0-9]*/[0-9]* " | tail -n 20
else
    echo "gpu_train_embedded: no before-record or no time left: evaluate from bundle.tgz here" >&2
fi
wait "$AB"
echo "[$SECONDS s] step A/B exited $?"
tail -n 40 "$RUN/step_ab.log"
bundle
