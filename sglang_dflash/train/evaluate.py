"""eval-draft: a draft's acceptance on a prompt set, measured by real speculative decoding
(the Transformers backend, float32 by default; greedy, or rejection sampling at a temperature),
not teacher forcing.

τ = generated tokens after the first / verify steps; the acceptance rate at block row k
is the fraction of verify steps that accepted at least k drafts.
"""

from __future__ import annotations

import torch

from sglang_dflash.generate import spec_generate
from sglang_dflash.train.data import chat_ids


def eval_draft(target, tok, draft, prompts: list[dict], max_new_tokens: int = 256, progress: bool = True,
               temperature: float = 0.0, seed: int = 0) -> dict:
    stops = target.generation_config.eos_token_id
    stops = [stops] if isinstance(stops, int) else list(stops or [])
    B = draft.config.block_size
    steps: list[int] = []
    per_prompt = []
    items = prompts
    if progress:
        from tqdm import tqdm

        items = tqdm(prompts, desc="eval-draft", dynamic_ncols=True)
    seconds = 0.0
    device = next(target.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    for p in items:
        out = spec_generate(target, draft, torch.tensor(chat_ids(tok, p["prompt"]), device=device), max_new_tokens,
                            temperature=temperature, stop_token_ids=stops, generator=generator)
        steps += out.accept_lengths
        seconds += out.seconds
        per_prompt.append({"id": p["id"], "tokens": len(out.tokens), "steps": len(out.accept_lengths),
                           "tau": out.tau})
        if progress:
            items.set_postfix(tau=f"{sum(steps) / max(len(steps), 1):.2f}")
    accepted = torch.tensor(steps) - 1  # drafts accepted per verify step
    return {
        "prompts": len(prompts),
        "temperature": temperature,
        "verify_steps": len(steps),
        "tau": sum(steps) / max(len(steps), 1),
        "accept_rate_by_row": [round((accepted >= k).float().mean().item(), 4) for k in range(1, B)],
        "tokens_per_second": sum(r["tokens"] for r in per_prompt) / max(seconds, 1e-9),
        "per_prompt": per_prompt,
    }
