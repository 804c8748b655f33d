#!/usr/bin/env bash
# The tests: set up, then run pytest (extra arguments go to pytest).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest -v --timeout 1800 --durations=15 "$@"
