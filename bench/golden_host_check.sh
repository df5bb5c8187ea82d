#!/usr/bin/env bash
# Do the CPU golden records (tests/data/golden/cpu-*.json) reproduce on this host under
# their pins? Makes each CPU record again here (python -m alphallama.runtime.gpu_golden
# --device cpu: a pinned child, the Triton interpreter, one thread a preset, the presets
# side by side), then compares them with the committed ones: the plan, the bits, the
# values, and the host's numerics fingerprint (with what differs, if it does). ~2-3 min.
# Device machine, repo root, .whl carried and installed as in the other device scripts:
#   bash bench/golden_host_check.sh          # last line: PASS or FAIL (GOLDEN_PRESETS="a b": some)
# Writes $OUT/golden/cpu-*.json and the logs.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/golden"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
echo "host: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) CPUs"
presets=${GOLDEN_PRESETS:-$(python3 -c "from alphallama.runtime import gpu_golden as g; print(*[n for n in g.CASES if n not in g.GPU_ONLY])")}
for p in $presets; do
    timeout 900 python3 -m alphallama.runtime.gpu_golden --device cpu --presets "$p" --out "$OUT/golden" \
        > "$OUT/golden/$p.log" 2>&1 &
done
wait
python3 - "$OUT/golden" $presets <<'EOF'
import json, sys
from pathlib import Path
from alphallama.runtime import gpu_golden as golden, gpu_golden_host as host
out, names, ok = Path(sys.argv[1]), sys.argv[2:], True
for n in names:
    made = out / f"cpu-{n}.json"
    if not made.exists():
        print(f"{n}: no record made: {(out / f'{n}.log').read_text()[-2000:]}")
        ok = False
        continue
    want, got = json.loads((golden.GOLDEN_DIR / made.name).read_text()), json.loads(made.read_text())
    fp = "same" if want["host"]["fingerprint"] == got["host"]["fingerprint"] else \
        f"differs ({host.host_difference(want['host'], got['host'])})"
    parts = {k: golden.first_difference({k: want.get(k)}, {k: got.get(k)}) for k in ("plan", "bits", "values", "fast")}
    same = all(d is None for d in parts.values())
    ok &= same
    print(f"{n}: fingerprint {fp}; " + "; ".join(f"{k} {'same' if d is None else 'DIFFERS at ' + d}"
                                                  for k, d in parts.items()))
print("PASS: the CPU records reproduce on this host" if ok else "FAIL")
sys.exit(0 if ok else 1)
EOF
