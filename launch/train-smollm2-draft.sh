#!/usr/bin/env bash
# Train (or resume training) the SmolLM2-135M-Instruct DFlash draft that the demo ships, in seven stages
# (see launch/drafts/SmolLM2-135M-Instruct-DFlash/README.md for what each reached and how long it took).
# Every phase of each stage resumes: re-run this same command after an interruption.
#   stage 1: 597 gsm8k_train prompts, from copies of the target's last 3 layers, stopped at step 4,250
#            work: $SGLANG_DFLASH_HOME/train/smollm2          draft: $SGLANG_DFLASH_HOME/train/smollm2-stage1
#   stage 2: 1,536 gsm8k_train prompts (the first 597 among them), continuing from stage 1's draft
#            work: $SGLANG_DFLASH_HOME/train/smollm2-stage2   draft: $SGLANG_DFLASH_HOME/train/smollm2-stage2-draft
#   stage 3: 3,584 gsm8k_train prompts (stage 2's 1,536 first: their responses and features are reused),
#            continuing from stage 2's draft
#            work: $SGLANG_DFLASH_HOME/train/smollm2-stage3   draft: $SGLANG_DFLASH_HOME/train/smollm2-stage3-draft
#   stage 4: 6,016 gsm8k_train prompts (stage 3's 3,584 first, reused likewise), continuing from stage 3's draft
#            work: $SGLANG_DFLASH_HOME/train/smollm2-stage4   draft: $SGLANG_DFLASH_HOME/train/smollm2-stage4-draft
#   stage 5: prompts no stage before saw: gsm8k_train's last 1,457 and a number variant of each gsm8k_train
#            prompt (prompt-variants --copies 1 --seed 1: 7,284), continuing from stage 4's draft; generated
#            and trained in bf16 (a CPU with AVX512-BF16; where bf16 is emulated this stage is ~3x slower)
#            work: $SGLANG_DFLASH_HOME/train/smollm2-stage5   draft: $SGLANG_DFLASH_HOME/train/smollm2-stage5-draft
#   stage 6: stage 5's data again (reused), continuing from stage 5's draft at a lower learning rate
#            work: $SGLANG_DFLASH_HOME/train/smollm2-stage6   draft: $SGLANG_DFLASH_HOME/train/smollm2-stage6-draft
#   stage 7: new prompts again: another number variant of each gsm8k_train prompt (prompt-variants --copies 1
#            --seed 2: 7,284), continuing from stage 6's draft
#            work: $SGLANG_DFLASH_HOME/train/smollm2-stage7   draft: launch/drafts/SmolLM2-135M-Instruct-DFlash
# A stage is skipped when its draft has finished its run. Extra arguments go to stage 7's
# `sglang-dflash train` (e.g. --stop-at 500 to pause after step 500).
# On the project's 2-core CPU machine run nothing else heavy meanwhile: two busy processes (a server,
# this trainer) slow each other down by an order of magnitude.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOME_DIR="${SGLANG_DFLASH_HOME:-$HOME/.cache/sglang-dflash}"
PROMPTS="${SHARED_DATA:-$ROOT/../shared/data}/gsm8k_train.jsonl"
bash "$ROOT/launch/setup.sh"
target="$("$ROOT/.venv/bin/sglang-dflash" prepare-target smollm2 --out "$HOME_DIR/fixtures/smollm2")"
common=(--target "$target" --max-new-tokens 256 --mask-token-id 16 --num-layers 3
        --block-size 16 --lr 5e-4 --warmup 100 --seqs-per-step 4 --blocks-per-seq 32 --kl-weight 1.0 --heldout 32)

# a stage's work folder starts with the stage before's responses and feature shards (hard links)
seed_work() {  # seed_work EARLIER_WORK WORK
  if [ ! -e "$2/responses.jsonl" ]; then
    mkdir -p "$2/features"
    cp "$1/responses.jsonl" "$2/"
    cp -al "$1/features/." "$2/features/"
  fi
}

last_step() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["step"])' "$1/training_state.json" 2>/dev/null || true; }

stage1="$HOME_DIR/train/smollm2-stage1"
if [ "$(last_step "$stage1")" != 4250 ]; then
  "$ROOT/.venv/bin/sglang-dflash" train "${common[@]}" --prompts "$PROMPTS" --num-prompts 597 \
    --generator sglang --gen-dtype float32 --gen-concurrency 48 --feature-dtype float32 --init target \
    --steps 6000 --stop-at 4250 --gamma 7 --autocast on --eval-every 250 --save-every 250 --keep-best false \
    --out "$stage1" --work "$HOME_DIR/train/smollm2"
fi

# stages 2 to 4 in float32: they ran on a CPU without AVX-512 (bf16 products 5x slower than float32 there)
stage2="$HOME_DIR/train/smollm2-stage2-draft"
if [ ! -e "$stage2/TRAINING.json" ]; then  # written when a run of `train` has finished
  "$ROOT/.venv/bin/sglang-dflash" train "${common[@]}" --prompts "$PROMPTS" --num-prompts 1536 \
    --generator hf --gen-dtype float32 --gen-concurrency 128 --feature-dtype float32 --init "$stage1" \
    --steps 1750 --gamma 4 --autocast false --eval-every 500 --save-every 250 \
    --out "$stage2" --work "$HOME_DIR/train/smollm2-stage2"
fi

work3="$HOME_DIR/train/smollm2-stage3"
seed_work "$HOME_DIR/train/smollm2-stage2" "$work3"  # stage 2's 1,536 responses come first
stage3="$HOME_DIR/train/smollm2-stage3-draft"
if [ ! -e "$stage3/TRAINING.json" ]; then
  "$ROOT/.venv/bin/sglang-dflash" train "${common[@]}" --prompts "$PROMPTS" --num-prompts 3584 \
    --generator hf --gen-dtype float32 --gen-concurrency 128 --feature-dtype float32 --init "$stage2" \
    --steps 1250 --lr 4e-4 --warmup 50 --gamma 4 --autocast false --eval-every 250 --save-every 250 \
    --out "$stage3" --work "$work3"
fi

work4="$HOME_DIR/train/smollm2-stage4"
seed_work "$work3" "$work4"  # stage 3's 3,584 come first
stage4="$HOME_DIR/train/smollm2-stage4-draft"
if [ ! -e "$stage4/TRAINING.json" ]; then
  "$ROOT/.venv/bin/sglang-dflash" train "${common[@]}" --prompts "$PROMPTS" --num-prompts 6016 \
    --generator hf --gen-dtype float32 --gen-concurrency 128 --feature-dtype float32 --init "$stage3" \
    --steps 1250 --lr 4e-4 --warmup 50 --gamma 4 --autocast false --eval-every 250 --save-every 250 \
    --out "$stage4" --work "$work4"
fi

work5="$HOME_DIR/train/smollm2-stage5"
mkdir -p "$work5"
tail -n +6017 "$PROMPTS" > "$work5/gsm8k_train-6017-7473.jsonl"  # the 1,457 prompts stage 4 did not have
"$ROOT/.venv/bin/sglang-dflash" prompt-variants --prompts "$PROMPTS" --copies 1 --seed 1 --out "$work5/variants-seed1.jsonl"
# stage 5's data, which stage 6 reuses: the same prompts and the same regeneration settings
stage5_data=(--prompts "$work5/variants-seed1.jsonl" "$work5/gsm8k_train-6017-7473.jsonl"
             --generator hf --gen-dtype bfloat16 --gen-concurrency 256 --feature-dtype bfloat16)
stage5="$HOME_DIR/train/smollm2-stage5-draft"
if [ ! -e "$stage5/TRAINING.json" ]; then
  "$ROOT/.venv/bin/sglang-dflash" train "${common[@]}" "${stage5_data[@]}" --init "$stage4" \
    --steps 3000 --lr 4e-4 --warmup 50 --gamma 4 --autocast auto --eval-every 500 --save-every 250 --heldout-decode 16 \
    --workers 2 --out "$stage5" --work "$work5"
fi

work6="$HOME_DIR/train/smollm2-stage6"
seed_work "$work5" "$work6"  # all of stage 5's responses and features, nothing new
stage6="$HOME_DIR/train/smollm2-stage6-draft"
if [ ! -e "$stage6/TRAINING.json" ]; then
  "$ROOT/.venv/bin/sglang-dflash" train "${common[@]}" "${stage5_data[@]}" --init "$stage5" \
    --steps 1200 --lr 1.5e-4 --warmup 50 --gamma 4 --autocast auto --eval-every 300 --save-every 300 --heldout-decode 16 \
    --workers 2 --out "$stage6" --work "$work6"
fi

work7="$HOME_DIR/train/smollm2-stage7"
mkdir -p "$work7"
"$ROOT/.venv/bin/sglang-dflash" prompt-variants --prompts "$PROMPTS" --copies 1 --seed 2 --out "$work7/variants-seed2.jsonl"
exec "$ROOT/.venv/bin/sglang-dflash" train "${common[@]}" --prompts "$work7/variants-seed2.jsonl" \
  --generator hf --gen-dtype bfloat16 --gen-concurrency 256 --feature-dtype bfloat16 --init "$stage6" \
  --steps 1200 --lr 3e-4 --warmup 50 --gamma 4 --autocast auto --eval-every 300 --save-every 300 --heldout-decode 16 \
  --workers 2 --out "$ROOT/launch/drafts/SmolLM2-135M-Instruct-DFlash" --work "$work7" "$@"
