#!/usr/bin/env bash
# A real GGUF onto the device machine in parts: each `run` call carries at most 64 MiB (the
# working tree included), so a 491 MB Qwen2.5-Coder-0.5B goes over in 11 calls made while
# the machine stays warm (30 s between calls), each copying one 48 MiB part to /tmp/stage;
# a last call carries .whl and joins them (bench/gpu_spec_session.sh qwen-suite checks the
# sha256).
#
#   bash bench/stage_model.sh split MODEL.gguf     # here: parts into .devcarry/, the embedded
#                                                  # model set aside, the run commands printed
#   bash bench/stage_model.sh restore              # here, after the last call: the embedded model back
#
# The embedded model (src/alphallama/data/*.gguf, ~34 MB, tracked) travels with every call
# unless it is set aside; with it in /tmp/embsave a part can be 48 MiB beside the ~10 MB tree.
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
  split -b 48M -d -a 2 "$M" .devcarry/qwen.part
  SHA=$(sha256sum "$M" | cut -d' ' -f1)
  n=$(ls .devcarry/qwen.part* | wc -l)
  echo "model $M: $n parts, sha256 $SHA; embedded model set aside in $SAVE (restore after)"
  i=0
  for p in .devcarry/qwen.part*; do
    i=$((i + 1))
    echo "run $i/$((n + 1)): carry [\"$p\"]  command: mkdir -p /tmp/stage && cp $p /tmp/stage/"
  done
  echo "run $((n + 1))/$((n + 1)): carry [\".whl\"]  command: <the .whl install prefix>; bash bench/gpu_spec_session.sh qwen-suite $SHA"
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
