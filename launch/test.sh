#!/usr/bin/env bash
# The tests: set up, then run pytest. See --help.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TIERS="unit process train server stats"

case "${1:-}" in
  -h|--help)
    cat <<'EOF'
usage: bash launch/test.sh [TIER] [pytest arguments]

Sets everything up (launch/setup.sh), then runs the suite with pytest. Without a tier it runs every
tier, in this order (what CI runs):

  unit     in-process tests: no server, no training loop, no child process (under 3 minutes)
  process  child processes without a server: TP ranks over gloo, Triton's interpreter
  train    runs of the training recipe and the HF-backend generation loops
  server   real SGLang servers on this machine (the shared ones are started once per run)
  stats    the statistical tier: thousands of samples tested against the target's exact distribution

A tier name as the first argument runs that tier only (the same as -m TIER); anything else goes to
pytest, e.g. `bash launch/test.sh unit -x`, `bash launch/test.sh -m "unit or process"`,
`bash launch/test.sh tests/test_decode_step.py`.
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
exec "$ROOT/.venv/bin/python" -m pytest -v --timeout 1800 --durations=30 "${tier[@]}" "$@"
