#!/usr/bin/env bash
# Data for the general SmolLM2 draft (issue 28): SmolLM2-135M-Instruct's own greedy responses (float32,
# up to 256 new tokens) to a mix of 60,000 training prompts: ShareGPT's human turns (0.7), gsm8k_train
# (0.15) and a number variant of each gsm8k_train prompt (0.15), decontaminated against every evaluation set.
#
#   bash launch/train-smollm2-general.sh regenerate MINUTES   regenerate for MINUTES (the CPU alone), then pack
#   bash launch/train-smollm2-general.sh pack                 pack the work folder's new responses as a shard
#
# The responses are kept in git as shards, data/smollm2-general/responses-NNN.jsonl.gz (about 1 byte per
# token, gzip), because regenerating them takes hours of this CPU (~150 tok/s) and a work folder does not
# outlive its machine: `regenerate` first loads every committed shard into the work folder, so a run goes
# on where the last one stopped, in the mix's order (every prefix of the mix keeps its proportions).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOME_DIR="${SGLANG_DFLASH_HOME:-$HOME/.cache/sglang-dflash}"
SHARED="${SHARED_DATA:-$ROOT/../shared/data}"
WORK="$HOME_DIR/train/smollm2-general"
SHARDS="$ROOT/data/smollm2-general"
TARGET="$HOME_DIR/fixtures/smollm2"
PY="$ROOT/.venv/bin/python"

pack() {  # the responses in the work folder that no shard holds -> the next shard
  "$PY" -m sglang_dflash.train.shards pack "$SHARDS" "$WORK/responses.jsonl"
}

regenerate() {
  local minutes="$1"
  mkdir -p "$WORK"
  [ -d "$TARGET" ] || "$ROOT/.venv/bin/sglang-dflash" prepare-target smollm2 --out "$TARGET"
  variants="$WORK/gsm8k_train-variants-seed1.jsonl"  # the name is part of the mix's seed: keep it
  [ -f "$variants" ] || "$ROOT/.venv/bin/sglang-dflash" prompt-variants --prompts "$SHARED/gsm8k_train.jsonl" \
    --copies 1 --seed 1 --out "$variants"
  # the committed shards first: the recipe skips every prompt that has a response
  "$PY" -m sglang_dflash.train.shards load "$SHARDS" "$WORK/responses.jsonl"
  local rc=0
  # stopped after MINUTES with SIGTERM (SIGINT is ignored by a background job): the batch in flight is lost,
  # every finished one is in the work folder
  timeout "${minutes}m" "$ROOT/.venv/bin/sglang-dflash" train --target "$TARGET" \
    --prompts sharegpt=0.7 "$SHARED/gsm8k_train.jsonl=0.15" "$variants=0.15" --num-prompts 60000 \
    --until regenerate --max-new-tokens 256 --mask-token-id 16 --num-layers 3 --block-size 16 \
    --generator hf --gen-dtype float32 --gen-concurrency 128 --feature-dtype float32 \
    --out "$WORK-draft" --work "$WORK" || rc=$?
  [ "$rc" = 0 ] || [ "$rc" = 124 ] || exit "$rc"  # 124: stopped by the time limit
  pack
}

case "${1:-}" in
  regenerate) regenerate "${2:?regenerate MINUTES}" ;;
  pack) pack ;;
  *) echo "usage: $0 regenerate MINUTES | pack" >&2; exit 2 ;;
esac
