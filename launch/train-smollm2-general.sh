#!/usr/bin/env bash
# Data for the general SmolLM2 draft (issue 28): SmolLM2-135M-Instruct's own greedy responses (float32,
# up to 256 new tokens) to a mix of 60,000 training prompts: ShareGPT's human turns (0.7), gsm8k_train
# (0.15) and a number variant of each gsm8k_train prompt (0.15), decontaminated against every evaluation set.
#
#   bash launch/train-smollm2-general.sh regenerate MINUTES   regenerate for MINUTES (the CPU alone), then pack
#   bash launch/train-smollm2-general.sh pack                 pack the work folder's new responses as a shard
#   bash launch/train-smollm2-general.sh features              the feature cache of every response in the work folder
#   bash launch/train-smollm2-general.sh shape MINUTES        the draft's depth by measurement: 3 against 5 layers,
#                                                             side by side (a core each) for MINUTES, from the target
#   bash launch/train-smollm2-general.sh fit [ARGS]           the general draft, from the GSM8K-only stage-7 draft
#                                                             (resumes; ARGS go to `sglang-dflash train`, e.g. --stop-at N)
#   bash launch/train-smollm2-general.sh evaluate JSON DRAFT [DRAFT …]  eval-draft on 64 prompts of each evaluation
#                                                             set (several drafts: replayed over the same continuations)
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

# the training mix: its prompts, in the order the regeneration takes them, and the settings its responses and
# features were made with; every phase below passes the same (the variants file's name is part of the mix's seed)
VARIANTS="$WORK/gsm8k_train-variants-seed1.jsonl"
mix=(--target "$TARGET" --prompts sharegpt=0.7 "$SHARED/gsm8k_train.jsonl=0.15" "$VARIANTS=0.15"
  --num-prompts 60000 --max-new-tokens 256 --mask-token-id 16 --block-size 16 --feature-dtype float32)

pack() {  # the responses in the work folder that no shard holds -> the next shard
  "$PY" -m sglang_dflash.train.shards pack "$SHARDS" "$WORK/responses.jsonl"
}

regenerate() {
  local minutes="$1"
  mkdir -p "$WORK"
  [ -d "$TARGET" ] || "$ROOT/.venv/bin/sglang-dflash" prepare-target smollm2 --out "$TARGET"
  [ -f "$VARIANTS" ] || "$ROOT/.venv/bin/sglang-dflash" prompt-variants --prompts "$SHARED/gsm8k_train.jsonl" \
    --copies 1 --seed 1 --out "$VARIANTS"
  # the committed shards first: the recipe skips every prompt that has a response
  "$PY" -m sglang_dflash.train.shards load "$SHARDS" "$WORK/responses.jsonl"
  local rc=0
  # stopped after MINUTES with SIGTERM (SIGINT is ignored by a background job): the batch in flight is lost,
  # every finished one is in the work folder
  timeout "${minutes}m" "$ROOT/.venv/bin/sglang-dflash" train "${mix[@]}" --until regenerate --num-layers 3 \
    --generator hf --gen-dtype float32 --gen-concurrency 128 --out "$WORK-draft" --work "$WORK" || rc=$?
  [ "$rc" = 0 ] || [ "$rc" = 124 ] || exit "$rc"  # 124: stopped by the time limit
  pack
}

# the mix's prompts answered by the responses already in the work folder: no new ones
trained_on_responses=("${mix[@]}" --no-regenerate)

features() {  # the target's states at layers 1, 14, 27 for every response (captured ones are taken as they are)
  "$ROOT/.venv/bin/sglang-dflash" train "${trained_on_responses[@]}" --num-layers 3 --until features \
    --out "$WORK-draft" --work "$WORK"
}

shape() {
  # Both drafts start from copies of the target's last layers, read the same context (target layers 1, 14,
  # 27: the cache's) and train on the same data at a learning rate held near 6e-4 (a 100,000-step cosine),
  # each on a core of its own for the same wall time. They are compared by held-out teacher-forced τ on the
  # work folder's last 64 responses, every 100 steps, against the seconds spent (log.jsonl of each).
  local minutes="$1" core=0
  features
  for layers in 3 5; do
    local arm="$WORK-shape-${layers}L"
    rm -rf "$arm" "$arm-draft"  # a fresh run: a resumed one would not have had the same wall time
    mkdir -p "$arm"
    ln -s "$WORK/features" "$arm/features"
    ln -s "$WORK/responses.jsonl" "$arm/responses.jsonl"
    OMP_NUM_THREADS=1 timeout "${minutes}m" taskset -c "$core" "$ROOT/.venv/bin/sglang-dflash" train \
      "${trained_on_responses[@]}" --num-layers "$layers" --target-layer-ids 1 14 27 --init target \
      --steps 100000 --lr 6e-4 --warmup 50 --gamma 4 --heldout 64 --heldout-decode 0 --eval-every 100 \
      --save-every 100 --keep-best false --out "$arm-draft" --work "$arm" > "$arm/train.log" 2>&1 &
    core=$((core + 1))
  done
  wait || true  # each arm ends at the time limit (124)
  "$PY" - "$WORK" <<'PY'
import json, sys
for layers in (3, 5):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}-shape-{layers}L/log.jsonl")]
    evals = [r for r in rows if "heldout_tau" in r and r["step"] % 100 == 0]
    print(f"{layers} layers: {rows[-1]['step']} steps in {rows[-1]['seconds']:.0f} s")
    for r in evals:
        rows_ = ", ".join(f"{a:.3f}" for a in r["heldout_accept"][:4])
        print(f"  step {r['step']:5d}  {r['seconds']:6.0f} s  loss {r['loss']:.3f}  teacher-forced tau "
              f"{r['heldout_tau']:.3f}  rows 1-4 {rows_}")
PY
}

fit() {
  # From the draft this repository shipped before (stage 7 of launch/train-smollm2-draft.sh, GSM8K only,
  # commit 6851253), taken out of git history: it reads target layers 1, 14, 27, as the cache holds them.
  local init="$WORK-init" file
  mkdir -p "$init"
  for file in config.json model.safetensors; do
    [ -s "$init/$file" ] || git -C "$ROOT" show "6851253:launch/drafts/SmolLM2-135M-Instruct-DFlash/$file" > "$init/$file"
  done
  features
  "$ROOT/.venv/bin/sglang-dflash" train "${trained_on_responses[@]}" --num-layers 3 --init "$init" \
    --steps 4000 --lr 4e-4 --warmup 50 --gamma 4 --heldout 64 --heldout-decode 16 --eval-every 250 \
    --save-every 100 --workers 2 --out "$WORK-draft" --work "$WORK" "$@"
}

evaluate() {  # greedy acceptance (replayed), float32, 256 new tokens, on prompts no training run saw
  local json="$1"
  shift
  "$ROOT/.venv/bin/sglang-dflash" eval-draft --target "$TARGET" --draft "$@" --prompts "$SHARED/gsm8k_test.jsonl" \
    "$SHARED/humaneval.jsonl" "$SHARED/mt_bench.jsonl" sharegpt-heldout --num-prompts 64 --max-new-tokens 256 \
    --json "$json"
}

case "${1:-}" in
  regenerate) regenerate "${2:?regenerate MINUTES}" ;;
  pack) pack ;;
  features) features ;;
  shape) shape "${2:?shape MINUTES}" ;;
  fit) shift; fit "$@" ;;
  evaluate) [ $# -ge 3 ] || { echo "usage: $0 evaluate JSON DRAFT [DRAFT …]" >&2; exit 2; }
            shift; evaluate "$@" ;;
  *) echo "usage: $0 regenerate MINUTES | pack | features | shape MINUTES | fit [ARGS] | evaluate JSON DRAFT [DRAFT …]" >&2
     exit 2 ;;
esac
