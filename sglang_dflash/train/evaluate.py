"""eval-draft: a draft's acceptance on a prompt set, measured on the path of real speculative
decoding (the Transformers backend, float32 by default), not on teacher-forced random anchors.

Two methods, the same figures:
  decode  real speculative decoding, one prompt at a time (generate.spec_generate): greedy, or
          rejection sampling at a temperature.
  replay  greedy only, faster (the target decodes many prompts at once, and their walks below run in
          lockstep: replay_walks). Greedy speculative
          decoding outputs the target's own greedy continuation, so its steps can be replayed
          from that continuation: the target's greedy tokens (batched, train/batched_greedy.py,
          B - 1 tokens past the end so that the last block is judged as decoding judges it), one
          target forward for the features, then the same walk as decoding: a block [token at
          start, MASK, ...] over the context before start, its drafts accepted while they equal
          the continuation, start advances by accepted + 1. The draft sees what it sees in
          decoding up to float rounding (features of one forward against those of incremental
          verify forwards), so the two methods agree step for step except at a near tie of the
          draft's or the target's logits (test_train checks them against each other).

τ = generated tokens after the first / verify steps; the acceptance rate at block row k
is the fraction of verify steps that accepted at least k drafts.
"""

from __future__ import annotations

import torch

from sglang_dflash.block import accepted_counts, accepted_prefix, acceptance_by_row, make_block
from sglang_dflash.cpu import gemm
from sglang_dflash.generate import spec_generate, target_features
from sglang_dflash.models.reference import ContextCache
from sglang_dflash.train.batched_greedy import greedy_batch
from sglang_dflash.train.data import chat_ids, stop_and_pad_ids


def eval_drafts(target, tok, drafts: list, prompts: list[dict], max_new_tokens: int = 256, progress: bool = True,
                temperature: float = 0.0, seed: int = 0, method: str = "decode") -> list[dict]:
    """eval_draft for each of several drafts of one target; replayed, they walk the same greedy continuations,
    made once (replay_greedy_drafts)."""
    if method == "replay" and temperature == 0:
        return replay_greedy_drafts(target, tok, drafts, prompts, max_new_tokens, progress)
    return [eval_draft(target, tok, d, prompts, max_new_tokens, progress, temperature, seed, method) for d in drafts]


def eval_draft(target, tok, draft, prompts: list[dict], max_new_tokens: int = 256, progress: bool = True,
               temperature: float = 0.0, seed: int = 0, method: str = "decode") -> dict:
    if method == "replay":
        if temperature != 0:
            raise ValueError("eval-draft --method replay measures greedy acceptance only: use --method decode "
                             "for a temperature above 0")
        return replay_greedy(target, tok, draft, prompts, max_new_tokens, progress)
    if method != "decode":
        raise ValueError(f"unknown eval-draft method {method!r} (decode or replay)")
    stops = stop_and_pad_ids(target, tok)[0]
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
    report = summary(steps, per_prompt, B, "decode", temperature)
    report["tokens_per_second"] = sum(r["tokens"] for r in per_prompt) / max(seconds, 1e-9)
    return report


def summary(steps: list[int], per_prompt: list[dict], block_size: int, method: str, temperature: float = 0.0) -> dict:
    accepted = torch.tensor(steps) - 1  # drafts accepted per verify step
    return {
        "prompts": len(per_prompt),
        "method": method,
        "temperature": temperature,
        "verify_steps": len(steps),
        "tau": sum(steps) / max(len(steps), 1),
        "accept_rate_by_row": [None if r is None else round(r, 4)
                               for r in acceptance_by_row(accepted_counts(accepted, block_size))],
        "per_prompt": per_prompt,
    }


@torch.no_grad()
def replay_steps(target, draft, seq: torch.Tensor, prompt_len: int, length: int) -> list[int]:
    """The tokens committed by each verify step of greedy speculative decoding whose output is
    seq[prompt_len : prompt_len + length]; seq [T] continues the target's greedy tokens at least
    block_size - 1 past that (the drafts of the last block are judged against them)."""
    return replay_walks(draft, target.get_input_embeddings(), target.get_output_embeddings().weight, [seq],
                        [sequence_features(target, seq, draft.config.target_layer_ids)], [prompt_len], [length])[0]


def sequence_features(target, seq: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """The target's features of seq [T] at layer_ids, from one forward -> [T, F]."""
    out = target(input_ids=seq[None], output_hidden_states=True, logits_to_keep=1)
    return target_features(out.hidden_states, layer_ids)[0]


@torch.no_grad()
def replay_walks(draft, embed, head: torch.Tensor, seqs: list[torch.Tensor], features: list[torch.Tensor],
                 prompt_lens: list[int], lengths: list[int]) -> list[list[int]]:
    """The walks of greedy decoding over known continuations, one list of steps (tokens committed) per
    sequence: embed the target's embedding (ids -> [.., H]), head [V, H] its lm_head weight, seqs[i] [T_i]
    tokens, features[i] [T_i, F] the target's features of them; walk i covers
    seqs[i][prompt_lens[i] : prompt_lens[i] + lengths[i]].

    A step: the block [token at start, MASK, …] over the context before start, its drafts accepted while they
    equal the continuation, start advances by accepted + 1. The walks run in lockstep, one draft forward per
    step for every walk still going (together they cost as many forwards as the longest). Rows are padded to
    the longest sequence; a row's block attends to its own context before its start (mask), so a walk is the
    same alone or among others up to float rounding (test_train checks it)."""
    cfg = draft.config
    B, n, device, dtype = cfg.block_size, len(seqs), seqs[0].device, next(draft.parameters()).dtype
    T = max(s.numel() for s in seqs)
    tokens = torch.zeros(n, T + B, dtype=torch.long, device=device)  # [n, T + B]: past a row's end, padding
    feats = torch.zeros(n, T, features[0].shape[-1], dtype=dtype, device=device)  # [n, T, F]
    ends = torch.tensor([s.numel() for s in seqs], device=device)
    for i, (s, f) in enumerate(zip(seqs, features)):
        tokens[i, :s.numel()], feats[i, :s.numel()] = s, f.to(device, dtype)
    ctx = draft.context_kv(feats, torch.arange(T, device=device).expand(n, T))  # per layer [n, kvh, T, d]
    start = torch.tensor(prompt_lens, device=device)
    generated = torch.ones(n, dtype=torch.long, device=device)  # the prefill gives the first token
    todo = torch.tensor(lengths, device=device)
    steps: list[list[int]] = [[] for _ in range(n)]
    columns = torch.arange(T + B, device=device)
    while bool((generated < todo).any()):
        rows = (generated < todo).nonzero().flatten()  # [m] walks still going
        m, at = rows.numel(), start[rows]
        ids, positions = make_block(tokens[rows, at], at, B, cfg.mask_token_id)  # [m, B] each
        mask = (columns[None] < at[:, None]) | (columns[None] >= T)  # [m, T + B]: own context, then the block
        context = ContextCache([k[rows] for k in ctx.keys], [v[rows] for v in ctx.values])
        hidden = draft(embed(ids).to(dtype), positions, context, mask[:, None, None, :])[:, 1:]  # [m, B-1, H]
        drafts = gemm.linear(hidden.reshape(m * (B - 1), -1).to(head.dtype), head).argmax(-1).view(m, B - 1)
        where = positions[:, 1:]  # [m, B-1]: the tokens the drafts are judged against
        accepted = accepted_prefix((drafts == tokens[rows[:, None], where]) & (where < ends[rows, None])) + 1
        for r, a in zip(rows.tolist(), accepted.tolist()):  # accepted drafts + the target's own token
            steps[r].append(a)
        start[rows] += accepted
        generated[rows] += accepted
    return steps


def replay_greedy(target, tok, draft, prompts: list[dict], max_new_tokens: int = 256, progress: bool = True,
                  batch_size: int = 32) -> dict:
    return replay_greedy_drafts(target, tok, [draft], prompts, max_new_tokens, progress, batch_size)[0]


@torch.no_grad()
def replay_greedy_drafts(target, tok, drafts: list, prompts: list[dict], max_new_tokens: int = 256,
                         progress: bool = True, batch_size: int = 32) -> list[dict]:
    """replay_greedy for several drafts of one target at once -> a summary per draft: the target's greedy
    continuations (the costly part) are made once and every draft walks the same ones."""
    stops, pad = stop_and_pad_ids(target, tok)
    B = max(d.config.block_size for d in drafts)
    device = next(target.parameters()).device
    ids = [chat_ids(tok, p["prompt"]) for p in prompts]
    steps: list[list[int]] = [[] for _ in drafts]
    per_prompt: list[list[dict]] = [[] for _ in drafts]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc="eval-draft (replay)", dynamic_ncols=True)
    for i in range(0, len(prompts), batch_size):
        # past the stops: decoding's last block is verified against the target's tokens after them
        runs = greedy_batch(target, ids[i:i + batch_size], max_new_tokens + B - 1, [], pad)
        seqs = [torch.tensor(x + run, device=device) for x, run in zip(ids[i:i + batch_size], runs)]
        lengths = [next((j + 1 for j, t in enumerate(run[:max_new_tokens]) if t in stops), max_new_tokens)
                   for run in runs]
        features: dict[tuple, list[torch.Tensor]] = {}  # by the target layers a draft reads
        for d, draft in enumerate(drafts):
            layers = tuple(draft.config.target_layer_ids)
            if layers not in features:
                features[layers] = [sequence_features(target, s, list(layers)) for s in seqs]
            walks = replay_walks(draft, target.get_input_embeddings(), target.get_output_embeddings().weight, seqs,
                                 features[layers], [len(x) for x in ids[i:i + batch_size]], lengths)
            for p, length, s in zip(prompts[i:i + batch_size], lengths, walks):
                steps[d] += s
                per_prompt[d].append({"id": p["id"], "tokens": length, "steps": len(s), "tau": sum(s) / max(len(s), 1)})
        if bar:
            bar.update(len(seqs))
            bar.set_postfix(tau=" ".join(f"{sum(s) / max(len(s), 1):.2f}" for s in steps))
    if bar:
        bar.close()
    return [summary(s, rows, d.config.block_size, "replay") for s, rows, d in zip(steps, per_prompt, drafts)]
