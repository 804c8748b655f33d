"""`sglang-dflash demo`: speculative generation on SmolLM2-135M-Instruct, on this machine.

For now the Transformers backend with a RANDOM (untrained) draft: it shows the
mechanism and that the output equals the target's own greedy output, not a
speedup (a random draft accepts almost nothing; τ stays near 1).
"""

from __future__ import annotations

import time

import torch


def run_demo(args) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_dflash.config import draft_config_for_target
    from sglang_dflash.cpu.runtime import cache_dir
    from sglang_dflash.generate import spec_generate
    from sglang_dflash.models.reference import DFlashDraftModel
    from sglang_dflash.targets import prepare_target

    path = prepare_target("smollm2", args.out or cache_dir() / "fixtures" / "smollm2")
    tok = AutoTokenizer.from_pretrained(str(path))
    target = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    cfg = draft_config_for_target(target.config, num_layers=2, block_size=16, mask_token_id=16)
    draft = DFlashDraftModel.random(cfg, seed=0)
    eos = target.generation_config.eos_token_id
    prompt = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " \
             "How many clips did Natalia sell altogether in April and May?"
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    print(f"target  {path} (SmolLM2-135M-Instruct, float32, CPU)")
    print(f"draft   RANDOM, UNTRAINED: {cfg.num_hidden_layers} layers, block {cfg.block_size}, "
          f"target layers {cfg.target_layer_ids}\n")

    t0 = time.perf_counter()
    ref = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos,
                          pad_token_id=eos)[0, ids.shape[1]:].tolist()
    base_s = time.perf_counter() - t0
    out = spec_generate(target, draft, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=[eos])

    print(f"prompt: {prompt}\n")
    print(f"DFlash output:\n{tok.decode(out.tokens, skip_special_tokens=True)}\n")
    print(f"tokens          {len(out.tokens)}")
    print(f"verify steps    {len(out.accept_lengths)}")
    print(f"tau             {out.tau:.2f} tokens per step (block size {cfg.block_size})")
    print(f"DFlash          {len(out.tokens) / out.seconds:.1f} tok/s")
    print(f"no speculation  {len(ref) / base_s:.1f} tok/s (HF generate, same target)")
    print(f"identical       {'yes' if out.tokens == ref else 'NO'} (greedy, token for token)")
    print("\nThe draft is untrained, so τ stays near 1 and speculation costs more than it saves. "
          "A trained draft and the SGLang server demo come with the training and benchmark issues.")
    return 0 if out.tokens == ref else 1
