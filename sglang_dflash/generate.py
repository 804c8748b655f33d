"""The Transformers backend: DFlash speculative generation for a Hugging Face target.

One request (batch 1), the step of the design in five functions:
    build_block -> draft_block -> verify_block -> accept -> commit
The target keeps its own KV cache (cropped to the committed length after every
verify); the draft keeps the per-layer K/V of the committed context.
Output equals the target's own greedy decoding (float32) or is distributed as
its sampling (temperature > 0, by rejection sampling with the draft's q).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable

import torch
from transformers import DynamicCache

from sglang_dflash.accept import accept_greedy, accept_sampled, draw
from sglang_dflash.block import make_block


@dataclasses.dataclass
class SpecOutput:
    tokens: list[int]  # generated token ids, prompt excluded
    accept_lengths: list[int]  # tokens committed by each verify step (1 … block size)
    seconds: float

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step (the prefill's token is not a verify step's)."""
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)


def target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """HF hidden_states (embeddings, after layer 0, …) -> [b, T, len(ids) * H]: the state after each layer id."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def sample(logits: torch.Tensor, temperature: float, generator=None) -> torch.Tensor:
    """logits [..., V] -> tokens [...]: argmax at temperature 0, else a draw from softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    return draw(torch.softmax(logits.float() / temperature, dim=-1), generator)


def build_block(bonus: int, start: int, block_size: int, mask_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[bonus, MASK, …, MASK] at positions start … start + B - 1, both [1, B] (block.make_block)."""
    return make_block(torch.tensor([bonus], device=device), torch.tensor([start], device=device), block_size,
                      mask_token_id)


@torch.no_grad()
def draft_block(draft, target, block_ids, positions, context, temperature: float, generator=None):
    """One non-causal draft forward -> draft tokens [1, B-1] and their distributions q [1, B-1, V] (None if greedy)."""
    embeds = target.get_input_embeddings()(block_ids)
    hidden = draft(embeds, positions, context)
    logits = target.get_output_embeddings()(hidden[:, 1:]).float()  # [1, B-1, V]
    if temperature == 0:
        return logits.argmax(-1), None
    q = torch.softmax(logits / temperature, dim=-1)
    return draw(q, generator), q


@torch.no_grad()
def verify_block(target, cache, block_tokens, layer_ids):
    """One target forward over [bonus, d_1 … d_{B-1}] -> logits [1, B, V], features [1, B, F]."""
    out = target(input_ids=block_tokens, past_key_values=cache, use_cache=True, output_hidden_states=True)
    return out.logits.float(), target_features(out.hidden_states, layer_ids)


def accept(draft_tokens, draft_probs, target_logits, temperature: float, generator=None):
    if temperature == 0:
        return accept_greedy(draft_tokens, target_logits)
    p = torch.softmax(target_logits / temperature, dim=-1)
    return accept_sampled(draft_tokens, draft_probs, p, generator)


def commit(draft, cache, context, features, start: int, n: int) -> None:
    """Keep n tokens of the verified block: crop the target's cache, add their context K/V to the draft's."""
    cache.crop(-(cache.get_seq_length() - (start + n)))  # drop the rejected tail
    positions = torch.arange(start, start + n, device=features.device)[None]
    draft.commit_context(context, features[:, :n], positions)


@torch.no_grad()
def spec_generate(target, draft, input_ids, max_new_tokens: int = 128, temperature: float = 0.0,
                  stop_token_ids: Iterable[int] = (), generator: torch.Generator | None = None) -> SpecOutput:
    """Generate up to max_new_tokens after input_ids ([T] or [1, T]) with DFlash speculation.

    Stops after the first token in stop_token_ids (which is included, as HF generate does).
    """
    t0 = time.perf_counter()
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    input_ids = torch.as_tensor(input_ids).view(1, -1)
    device = input_ids.device
    cfg = draft.config
    B, layer_ids, stops = cfg.block_size, cfg.target_layer_ids, set(stop_token_ids)
    dtype = next(draft.parameters()).dtype

    # Prefill: the target over the prompt; every prompt token's context K/V into the draft cache.
    cache = DynamicCache(config=target.config)
    out = target(input_ids=input_ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
    context = draft.new_cache(1, device, dtype)
    T = input_ids.shape[1]
    draft.commit_context(context, target_features(out.hidden_states, layer_ids).to(dtype),
                         torch.arange(T, device=device)[None])
    bonus = int(sample(out.logits[:, -1].float(), temperature, generator))
    tokens, steps, start = [bonus], [], T
    finished = bonus in stops or len(tokens) >= max_new_tokens

    while not finished:
        block_ids, positions = build_block(bonus, start, B, cfg.mask_token_id, device)
        draft_tokens, q = draft_block(draft, target, block_ids, positions, context, temperature, generator)
        block_ids[:, 1:] = draft_tokens
        logits, features = verify_block(target, cache, block_ids, layer_ids)
        accept_len, next_token = accept(draft_tokens, q, logits, temperature, generator)
        n = int(accept_len) + 1  # bonus + accepted drafts enter the context; next_token is the new bonus
        commit(draft, cache, context, features.to(dtype), start, n)
        steps.append(n)
        start, bonus = start + n, int(next_token)
        for t in draft_tokens[0, :n - 1].tolist() + [bonus]:
            tokens.append(t)
            finished = t in stops or len(tokens) >= max_new_tokens
            if finished:
                break
    return SpecOutput(tokens, steps, time.perf_counter() - t0)
