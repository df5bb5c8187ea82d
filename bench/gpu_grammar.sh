#!/usr/bin/env bash
# Grammar-constrained decoding on the GPU (issue 33): tests/test_grammar.py on CUDA (outputs
# validate; ngram and MTP drafts under a grammar equal plain constrained greedy), then
# bench/grammar_decode_cost.py (tok/s with and without a JSON-schema grammar, embedded model,
# plain and ngram). Needs in .whl/: llguidance and jsonschema with its dependencies, e.g.
#   pip download llguidance==1.9.1 jsonschema --only-binary :all: -d .whl
# Run from the repo root on the device: bash bench/gpu_grammar.sh  (JSON to $OUT)
set -euo pipefail
pip install --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null
export PYTHONPATH=/tmp/site:$PWD/src
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_grammar.py 2>&1 | tail -5
for spec in none ngram; do
  timeout 120 python3 bench/grammar_decode_cost.py --device cuda --spec-type "$spec" -n 200 \
    --out "$OUT/grammar-decode-cost-embedded-$spec-h200.json" 2>&1 | tail -6
done
