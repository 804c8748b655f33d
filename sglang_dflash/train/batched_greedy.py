"""Batched greedy generation with a Transformers decoder, fast on a CPU.

Transformers' generate() on a CPU spends most of a decode step outside the model's
products (measured for SmolLM2-135M in bf16, 64 prompts, on the project's 2-core machine:
565 ms per step, of which 167 ms in the CPU flash-attention kernel with one query row and
45 ms growing the cache by concatenation, against ~55 ms of matrix products). This loop runs
the model's own decoder layers (so any Llama / Qwen-style architecture, q/k norms included)
with two replacements:

    cache      preallocated [bs, kv_heads, prompt_width + max_new, head_dim] per layer, written
               in place (KVBuffer, passed as the layers' past_key_values)
    attention  for one query row, a grouped batched product against the cache; for the
               prompt, torch's SDPA with an explicit mask

Prompts are left-padded to one width per batch; a row's positions start at 0 at its first
real token, and its padding columns are masked out of every attention. Rows that finished
(a stop token or max_new tokens) are dropped from the batch once a quarter of it has finished
and their last token has been through the model.

    greedy_batch(model, prompts [token-id lists], max_new_tokens, stops, pad) -> each prompt's output ids

With `capture` (the draft's target layer ids) it also returns, per prompt, the features the
training recipe caches (train/features.py) for prompt + output: the states after those layers,
concatenated [T, F], and the state after the final norm [T, H], taken from the same forwards
that generate (so the recipe needs no second pass of the target over its responses). The last
output token goes through the model once more for this, in a forward that generates nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ATTENTION = "dflash_batched_greedy"


class KVBuffer:
    """What the decoder layers see as past_key_values: update() writes the new K/V at the current
    column and returns every column written so far."""

    def __init__(self, layers: int, bs: int, kv_heads: int, width: int, head_dim: int, dtype, device):
        shape = (bs, kv_heads, width, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.length = 0  # columns written by the previous forwards

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int, *args, **kwargs):
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def keep(self, rows: torch.Tensor) -> None:
        self.k = [k[rows] for k in self.k]
        self.v = [v[rows] for v in self.v]


def attention(module, q, k, v, mask, scaling, dropout=0.0, **kwargs):
    """q [bs, h, n, d], k/v [bs, kvh, L, d], mask [bs, 1, n, L] (True: attend) -> [bs, n, h, d]."""
    bs, h, n, d = q.shape
    kvh = k.shape[1]
    if n > 1:  # the prompt
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=kvh != h)
        return out.transpose(1, 2), None
    g = h // kvh
    scores = torch.matmul(q.view(bs, kvh, g, d), k.transpose(-1, -2)).float() * scaling  # [bs, kvh, g, L]
    scores.masked_fill_(~mask.view(bs, 1, 1, -1), float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(v.dtype), v)  # [bs, kvh, g, d]
    return out.view(bs, 1, h, d), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)


def _forward(model, ids, positions, mask, cache: KVBuffer, capture: tuple[int, ...] = ()):
    """ids/positions [bs, n], mask [bs, 1, n, L] -> the last row's logits [bs, V] (float32), and with capture
    (layer indices) the states of every row: (after those layers, concatenated [bs, n, F]; final norm [bs, n, H])."""
    inner = model.model
    x = inner.embed_tokens(ids)
    cos_sin = inner.rotary_emb(x, positions)
    states = []
    for i, layer in enumerate(inner.layers):
        out = layer(x, attention_mask=mask, position_ids=positions, past_key_values=cache, position_embeddings=cos_sin)
        x = out[0] if isinstance(out, tuple) else out
        if i in capture:
            states.append(x)
    cache.length += ids.shape[1]
    if not capture:
        return model.lm_head(inner.norm(x[:, -1])).float(), None
    final = inner.norm(x)
    return model.lm_head(final[:, -1]).float(), (torch.cat(states, dim=-1), final)


@torch.no_grad()
def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, stops: list[int], pad: int,
                 capture: list[int] | None = None):
    """One left-padded batch -> each prompt's greedy continuation, through its first stop token; with capture,
    (continuations, [(context [T, F], final [T, H]) per prompt, bf16 on the CPU]) for T = prompt + continuation."""
    _register()
    device = next(model.parameters()).device
    cfg = model.config
    layers = tuple(capture or ())
    bs, width = len(prompts), max(map(len, prompts))
    pads = torch.tensor([width - len(p) for p in prompts], device=device)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    total = width + max_new_tokens  # the last output token is forwarded only when capturing
    cols = torch.arange(total, device=device)
    valid = cols[None] >= pads[:, None]  # [bs, total]: not a padding column
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = KVBuffer(cfg.num_hidden_layers, bs, cfg.num_key_value_heads, total, head_dim,
                     next(model.parameters()).dtype, device)
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(bs)]  # per prompt: ([n, F], [n, H]) pieces

    def keep_states(states, rows: list[int], columns: list[slice | None]):  # batch row j's columns[j] for prompt rows[j]
        if states is not None:
            ctx, fin = (t.to("cpu", torch.bfloat16) for t in states)
            for j, (r, c) in enumerate(zip(rows, columns)):
                if c is not None:
                    parts[r].append((ctx[j, c], fin[j, c]))

    old = cfg._attn_implementation
    cfg._attn_implementation = ATTENTION  # what the attention modules look up at every call
    try:
        positions = (cols[None, :width] - pads[:, None]).clamp(min=0)
        causal = cols[:width, None] >= cols[None, :width]  # [width, width]
        mask = (causal[None] & valid[:, None, :width])[:, None]  # [bs, 1, width, width]
        mask |= torch.eye(width, dtype=torch.bool, device=device)[None, None]  # padding rows attend to themselves
        logits, states = _forward(model, ids, positions, mask, cache, layers)
        token = logits.argmax(-1)  # [bs]
        keep_states(states, list(range(bs)), [slice(p, None) for p in pads.tolist()])  # the prompts' real columns
        rows = torch.arange(bs, device=device)  # which prompt each row of the batch is
        closed = torch.zeros(bs, dtype=torch.bool, device=device)  # rows whose output has ended
        outputs: list[list[int]] = [[] for _ in range(bs)]
        stop_set = torch.tensor(stops or [-1], device=device)
        for step in range(max_new_tokens):
            fresh = ~closed  # rows whose token of this step belongs to their output (its states are wanted)
            for r, t, c in zip(rows.tolist(), token.tolist(), closed.tolist()):
                if not c:
                    outputs[r].append(t)
            closed |= torch.isin(token, stop_set)
            last = step + 1 == max_new_tokens or bool(closed.all())
            if last and not layers:
                break
            if not last and int((closed & ~fresh).sum()) * 4 >= len(rows):  # drop rows that ended before this step
                keep = fresh
                cache.keep(keep)
                rows, token, pads, valid, closed, fresh = rows[keep], token[keep], pads[keep], valid[keep], closed[keep], fresh[keep]
            col = cache.length
            mask = valid[:, None, None, : col + 1]  # [bs, 1, 1, col + 1]
            logits, states = _forward(model, token[:, None], (col - pads)[:, None], mask, cache, layers)
            keep_states(states, rows.tolist(), [slice(0, 1) if f else None for f in fresh.tolist()])
            if last:
                break
            token = logits.argmax(-1)
    finally:
        cfg._attn_implementation = old
    if not layers:
        return outputs
    features = []
    for r in range(bs):
        ctx, fin = torch.cat([c for c, _ in parts[r]]), torch.cat([f for _, f in parts[r]])
        assert ctx.shape[0] == len(prompts[r]) + len(outputs[r]), (ctx.shape, len(prompts[r]), len(outputs[r]))
        features.append((ctx, fin))
    return outputs, features
