#!/usr/bin/env bash
# The tests: set up, then run pytest. See --help.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TIERS="unit process train server stats"

case "${1:-}" in
  -h|--help)
    cat <<'EOF'
usage: bash launch/test.sh [TIER] [pytest arguments]

Sets everything up (launch/setup.sh), then runs the suite with pytest. Without arguments it runs every
tier, in this order (what CI runs):

  unit     in-process tests: no server, no training loop, no child process (under 3 minutes)
  process  child processes without a server: TP ranks over gloo, Triton's interpreter
  train    runs of the training recipe and the HF-backend generation loops
  server   real SGLang servers on this machine (the shared ones are started once per run)
  stats    the statistical tier: thousands of samples tested against the target's exact distribution

Without arguments the unit and process tiers run first, on every core; then train, server and stats run
as two halves at once (pytest --shard 1/2 and 2/2, tests/conftest.py), each process and its servers on one
thread (OMP_NUM_THREADS=1), their lines prefixed [1] and [2]. On a 2-core machine a server test on one
core took 1.24-1.31 times its time on two (two tests at once, one core each), so the halves at once finish
well before the two one after the other would.

A tier name as the first argument runs that tier only (the same as -m TIER), one pytest on every core;
anything else goes to pytest the same way, e.g. `bash launch/test.sh unit -x`,
`bash launch/test.sh -m "unit or process"`, `bash launch/test.sh tests/test_decode_step.py`.
EOF
    exit 0 ;;
esac
tier=()
if [ -n "${1:-}" ] && [[ " $TIERS " == *" $1 "* ]]; then
  tier=(-m "$1")
  shift
fi
bash "$ROOT/launch/setup.sh"
cd "$ROOT"
PYTEST=("$ROOT/.venv/bin/python" -m pytest -v --timeout 1800 --durations=30)
if [ ${#tier[@]} -gt 0 ] || [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "${tier[@]}" "$@"
fi

# The whole suite (CI): every test runs, and every failure is reported before the exit status says so.
half() {  # the I-th half of the train, server and stats tiers, its lines prefixed [I]
  OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 "${PYTEST[@]}" -m "not (unit or process)" --shard "$1/2" 2>&1 | sed -u "s/^/[$1] /"
}
rc=0
"${PYTEST[@]}" -m "unit or process" || rc=1
half 1 & first=$!
half 2 & second=$!
wait "$first" || rc=1
wait "$second" || rc=1
exit "$rc"
