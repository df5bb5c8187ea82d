#!/usr/bin/env bash
# The README's two commands as a new user runs them: a fresh virtual environment (nothing
# but pip in it), a clean clone of this repository's HEAD in a folder with no `shared`
# beside it, then command 1 (install, generate) and command 2 (install the test extra, run
# the suite), each timed. Writes the log to docs/fresh-machine.log (FRESH_LOG overrides).
#   bash .ci/fresh-machine.sh            # clone into /tmp/solo, venv in /tmp/venv-fresh
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CLONE=${FRESH_CLONE:-/tmp/solo}
VENV=${FRESH_VENV:-/tmp/venv-fresh}
LOG=${FRESH_LOG:-$REPO/docs/fresh-machine.log}

if [ -e "$(dirname "$CLONE")/shared" ]; then
    echo "$(dirname "$CLONE")/shared exists: pick a FRESH_CLONE whose parent has no shared folder" >&2
    exit 2
fi
rm -rf "$CLONE" "$VENV"

step() {   # step NAME CMD...: run CMD in the clone with the venv active, print its time and status
    local name=$1; shift
    echo "\$ $*"
    local t0=$SECONDS
    # ALPHA_MODELS: a new user has no real models in ~/.cache (this machine's .ci/run fetched them)
    (cd "$CLONE" && source "$VENV/bin/activate" && env -u ALPHA_SHARED -u PYTHONPATH ALPHA_MODELS="$VENV/no-models" bash -c "$*")
    local rc=$?
    echo "== $name: exit $rc in $(( SECONDS - t0 )) s"
    return $rc
}

main() {
echo "== fresh machine: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, $(python3 --version), GPU: $(nvidia-smi -L 2>/dev/null | head -1 | grep . || echo none)"
python3 -m venv "$VENV"
git clone -q "$REPO" "$CLONE"
echo "== clone of $(git -C "$CLONE" log -1 --format='%h %s' | cut -c1-90) in $CLONE; $(dirname "$CLONE")/shared absent"

rc=0
step "command 1" 'pip install torch==2.13.0 -e . && alphallama run -p "def is_palindrome(s):" -n 64' || rc=1
step "triton absent after command 1" 'python -c "import importlib.util as u; assert u.find_spec(\"triton\") is None, \"triton is installed\""' || rc=1
step "command 2" "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q -n 2 --dist loadfile" || rc=1
echo "== done: $( [ $rc = 0 ] && echo both commands succeeded || echo FAILED )"
return $rc
}

main 2>&1 | tee "$LOG"   # pip's lines and pytest's dots included: what the user sees
exit "${PIPESTATUS[0]}"
