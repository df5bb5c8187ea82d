#!/usr/bin/env bash
# A real GGUF onto the device machine in parts: each `run` call carries at most 64 MiB (the
# working tree included), so a 491 MB Qwen2.5-Coder-0.5B goes over in ~9 calls made while the
# machine stays warm (30 s between calls), each copying one part to /tmp/stage; the last
# call joins them (bench/gpu_spec_session.sh qwen-suite checks the sha256).
#
#   bash bench/stage_model.sh split MODEL.gguf     # here: parts into .devcarry/, the embedded
#                                                  # model set aside, the run commands printed
#   bash bench/stage_model.sh restore              # here, after the last call: the embedded model back
#
# The embedded model (src/alphallama/data/*.gguf, ~34 MB, tracked) travels with every call
# unless it is set aside; with it in /tmp/embsave a part can be 55 MiB.
set -eu
cd "$(dirname "$0")/.."
SAVE=/tmp/embsave
case "${1:-}" in
split)
  M=$2
  [ -f "$M" ] || { echo "no such model: $M"; exit 2; }
  mkdir -p .devcarry "$SAVE"
  rm -f .devcarry/qwen.part*
  for f in src/alphallama/data/alphallama-embedded*.gguf; do [ -f "$f" ] && mv "$f" "$SAVE/"; done
  split -b 55M -d -a 2 "$M" .devcarry/qwen.part
  SHA=$(sha256sum "$M" | cut -d' ' -f1)
  n=$(ls .devcarry/qwen.part* | wc -l)
  echo "model $M: $n parts, sha256 $SHA; embedded model set aside in $SAVE (restore after)"
  i=0
  for p in .devcarry/qwen.part*; do
    i=$((i + 1))
    cmd="mkdir -p /tmp/stage && cp $p /tmp/stage/"
    [ $i -eq "$n" ] && cmd="$cmd && <prefix> bash bench/gpu_spec_session.sh qwen-suite $SHA"
    echo "run $i/$n: carry [\"$p\", \".whl\"]  command: $cmd"
  done
  ;;
restore)
  for f in "$SAVE"/alphallama-embedded*.gguf; do [ -f "$f" ] && mv "$f" src/alphallama/data/; done
  rm -f .devcarry/qwen.part*
  git status --short src/alphallama/data
  ;;
*)
  echo "usage: $0 split MODEL.gguf | restore"; exit 2
  ;;
esac
