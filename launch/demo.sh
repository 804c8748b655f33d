#!/usr/bin/env bash
# The main job: set up, then run the demo.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup.sh"
exec "$ROOT/.venv/bin/sglang-dflash" demo "$@"
