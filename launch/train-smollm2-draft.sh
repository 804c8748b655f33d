#!/usr/bin/env bash
# Train (or resume training) the SmolLM2-135M-Instruct DFlash draft that the demo ships.
# Every phase resumes: re-run this same command after an interruption.
#   work files (responses, feature cache, optimizer state): $SGLANG_DFLASH_HOME/train/smollm2
#   the draft, in the published format:                    launch/drafts/SmolLM2-135M-Instruct-DFlash
# Extra arguments go to `sglang-dflash train` (e.g. --stop-at 1000 to pause after step 1000).
# Data: the first 597 gsm8k_train prompts (as many responses as the first session's
# regeneration produced; the run of 2026-11-29 overfits them after ~2,500 steps, see
# benchmarks/README.md: more data is the next step).
# On the project's 2-core CPU machine run nothing else heavy meanwhile: two busy SGLang
# servers or a server and this trainer slow each other down by an order of magnitude.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOME_DIR="${SGLANG_DFLASH_HOME:-$HOME/.cache/sglang-dflash}"
bash "$ROOT/launch/setup.sh"
target="$("$ROOT/.venv/bin/sglang-dflash" prepare-target smollm2 --out "$HOME_DIR/fixtures/smollm2")"
exec "$ROOT/.venv/bin/sglang-dflash" train \
  --target "$target" \
  --prompts "${SHARED_DATA:-$ROOT/../shared/data}/gsm8k_train.jsonl" --num-prompts 597 --max-new-tokens 256 \
  --generator sglang --gen-dtype float32 --gen-concurrency 48 --feature-dtype float32 \
  --mask-token-id 16 --num-layers 3 --block-size 16 --init target \
  --steps 6000 --lr 5e-4 --warmup 100 --seqs-per-step 4 --blocks-per-seq 32 --gamma 7 --kl-weight 1.0 \
  --heldout 32 --eval-every 250 --save-every 250 --keep-best false \
  --out "$ROOT/launch/drafts/SmolLM2-135M-Instruct-DFlash" --work "$HOME_DIR/train/smollm2" "$@"
