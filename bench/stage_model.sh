#!/usr/bin/env bash
# Stage a real GGUF onto the device machine over several calls (a call carries at most 64 MiB
# of tree + carry; ../shared does not travel). Here, in the repo root:
#
#   bash bench/stage_model.sh split ~/.cache/alphallama/models/gemma-3-270m-q4_k_m.gguf gemma
#       -> .stage/gemma.p0/ .. .stage/gemma.pN/ (git-ignored), each sized to ride beside the
#          slim tree (FIRST_MB for p0, default 43: it also carries .whl and .devcarry)
#   bash bench/stage_model.sh aside     # the tree's big tracked files into .stage/aside (tree ~8.5 MB)
#   ... one `run` a part, carry [".stage/gemma.pK"], command: bash bench/stage_model.sh receive gemma.pK
#   ... the last:  bash bench/stage_model.sh join gemma /tmp/models/gemma-3-270m-q4_k_m.gguf SHA256
#   bash bench/stage_model.sh back      # before anything else here: never commit while aside
#
# On the device the parts collect in /tmp/models (outside the repo: kept while the machine stays
# warm, 30 s after each call), so the calls must follow one another at once.
set -euo pipefail
STAGE=.stage
BIG="src/alphallama/data/alphallama-embedded.gguf src/alphallama/data/alphallama-embedded.mtp.gguf bench/results"
LIMIT=67108864

tree_bytes() { git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}'; }

case "${1:-}" in
split)   # split MODEL NAME: parts that fit a call beside the slim tree
  model=$2 name=$3; mkdir -p "$STAGE"
  slim=$(tree_bytes); for f in $BIG; do slim=$((slim - $(du -sb "$f" | cut -f1))); done
  part=$((LIMIT - slim - 500000)); first=$(( ${FIRST_MB:-43} * 1000000 ))
  rm -rf "$STAGE/$name".p*; mkdir -p "$STAGE/$name.p0"
  head -c "$first" "$model" > "$STAGE/$name.p0/part"
  tail -c +$((first + 1)) "$model" | split -b "$part" -d -a 2 - "$STAGE/$name.rest."
  i=1; for f in "$STAGE/$name".rest.*; do mkdir -p "$STAGE/$name.p$i"; mv "$f" "$STAGE/$name.p$i/part"; i=$((i + 1)); done
  echo "$name: $i parts (p0 $first bytes, then $part); sha256 $(sha256sum "$model" | cut -d' ' -f1)" ;;
aside)
  [ -e "$STAGE/aside" ] && { echo "already aside: bash $0 back" >&2; exit 2; }
  for f in $BIG; do mkdir -p "$STAGE/aside/$(dirname "$f")"; mv "$f" "$STAGE/aside/$f"; done
  echo "tree now $(tree_bytes) bytes of tracked files; bring them back with: bash $0 back" ;;
back)
  for f in $BIG; do [ -e "$STAGE/aside/$f" ] && mv "$STAGE/aside/$f" "$f"; done
  rm -rf "$STAGE/aside"; git status --short | grep '^ D' && { echo "still missing (above)" >&2; exit 1; } || true ;;
receive)   # on the device: receive NAME.pK
  mkdir -p /tmp/models; cp "$STAGE/$2/part" "/tmp/models/$2"; ls -la /tmp/models ;;
join)      # on the device: join NAME OUT SHA256
  name=$2 out=$3 sum=$4
  ls /tmp/models/"$name".p* | sort -V | xargs cat > "$out.partial"
  echo "$sum  $out.partial" | sha256sum -c --status || { echo "sha256 mismatch: $out" >&2; exit 1; }
  mv "$out.partial" "$out"; rm -f /tmp/models/"$name".p*; echo "$out" ;;
*) echo "usage: $0 split MODEL NAME | aside | back | receive NAME.pK | join NAME OUT SHA256" >&2; exit 2 ;;
esac
