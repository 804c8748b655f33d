"""Attention of a block of queries over a paged KV cache, in plain torch.

Used for the target's TARGET_VERIFY forward on SGLang's torch_native backend
(causal: plugin.py's hook). Only the block's queries are computed: each request
attends over its prefix plus its own block, never over padding. A 1-row step (the
adaptive window's plain decode) attends one request at a time where padding the
batch would cost more (PAD_FILL). (The draft's
non-causal block attention over its own paged context is ops/draft_attention.py,
which shares gather_kv; `causal=False` here is its plain reference in tests.)

Shapes: bs requests, n block tokens per request, h / kvh query / key-value
heads, d head dim, P pool slots, L = max over requests of (prefix + n).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(buf: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
              kv_lens: torch.Tensor, max_len: int):
    """buf [P, kvh, d] -> [bs, kvh, L, d] (rows past a request's kv_len are zeros) and valid [bs, L] bool."""
    cols = torch.arange(max_len, device=buf.device)
    valid = cols[None, :] < kv_lens[:, None]  # [bs, L]
    slots = req_to_token[req_pool_indices[:, None], cols[None, :].clamp(max=req_to_token.shape[1] - 1)]
    slots = torch.where(valid, slots, torch.zeros_like(slots)).long()
    return buf[slots].transpose(1, 2), valid  # [bs, L, kvh, d] -> [bs, kvh, L, d]


def paged_block_mask(prefix_lens: torch.Tensor, n: int, max_len: int, causal: bool,
                     block_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mask of a block over a paged KV cache (verify: causal; draft: not) -> [bs, 1, n, L] bool: query i of
    a request (at position prefix + i) sees key j when j < prefix + n (its own rows) and, if causal,
    j <= prefix + i. With block_mask [bs, n, n] (a tree's verify: tree.ancestor_mask) query i sees the
    whole prefix and block key m where block_mask[i, m], in place of the causal rule."""
    cols = torch.arange(max_len, device=prefix_lens.device)
    rows = torch.arange(n, device=prefix_lens.device)
    if block_mask is not None:
        prefix = prefix_lens.long()[:, None, None]  # [bs, 1, 1]
        m = cols[None, None, :] - prefix  # [bs, 1, L]: the block row a key column holds
        inside = (m >= 0) & (m < n)
        sees = block_mask.gather(2, m.clamp(0, n - 1).expand(-1, n, -1)) & inside  # [bs, n, L]
        return ((cols[None, None, :] < prefix) | sees)[:, None]
    limit = prefix_lens[:, None] + (rows[None, :] + 1 if causal else n)  # [bs, n], exclusive
    return (cols[None, None, :] < limit[:, :, None])[:, None]


# Below this fill (keys over padded keys) one row per request is attended one request at a time, unpadded and
# unmasked, as SGLang's own torch_native decode does; above it the batch is padded and masked. Measured on the
# 2-core CPU (SmolLM2's heads, 30 layers, one row): 64 requests of 20-1,200 keys (fill 0.5) 1,376 ms a step
# one at a time against 1,849 padded in bfloat16 (938 / 1,548 in float32); 400-600 keys (fill 0.8) 1,160
# against 891 (856 / 583). One request (fill 1) unmasked: SDPA's fused path, 15 against 22 ms at 600 keys.
PAD_FILL = 0.6


def one_row_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                      req_pool_indices: torch.Tensor, kv_lens: list[int], scaling: float) -> torch.Tensor:
    """q [bs, h, d], one row per request seeing its kv_lens[i] keys -> out [bs, h, dv] (dv: v_buf's head dim), a
    request at a time."""
    h, d = q.shape[1], q.shape[2]
    out = q.new_empty(q.shape[0], h, v_buf.shape[-1])
    for i, m in enumerate(kv_lens):
        slots = req_to_token[req_pool_indices[i], :m].long()
        k, v = k_buf[slots].transpose(0, 1)[None], v_buf[slots].transpose(0, 1)[None]  # [1, kvh, m, d]
        out[i] = F.scaled_dot_product_attention(q[i].view(1, h, 1, d), k.to(q.dtype), v.to(q.dtype), scale=scaling,
                                                enable_gqa=h != k.shape[1]).view(h, -1)
    return out


def paged_block_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                          req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, n: int, scaling: float,
                          causal: bool, block_mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [bs*n, h, d] of block tokens whose K/V are already in the pool -> out [bs*n, h, dv] (dv: v_buf's head dim).

    The block of request r sits at req_to_token[r, prefix : prefix + n]; block_mask [bs, n, n]: which block
    rows each row sees (a tree), in place of the causal rule (paged_block_mask).
    """
    bs = prefix_lens.shape[0]
    h, d = q.shape[1], q.shape[2]
    prefix_lens = prefix_lens.long()
    max_len = int(prefix_lens.max()) + n
    if n == 1 and block_mask is None:  # a plain decode step: each row sees its request's every key
        kv_lens = (prefix_lens + 1).tolist()
        if bs == 1 or sum(kv_lens) < PAD_FILL * bs * max_len:  # no padding to batch, or mostly padding
            return one_row_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, kv_lens, scaling)
    k, _ = gather_kv(k_buf, req_to_token, req_pool_indices, prefix_lens + n, max_len)
    v, _ = gather_kv(v_buf, req_to_token, req_pool_indices, prefix_lens + n, max_len)
    mask = paged_block_mask(prefix_lens, n, max_len, causal, block_mask)
    qb = q.view(bs, n, h, d).transpose(1, 2)  # [bs, h, n, d]
    out = F.scaled_dot_product_attention(qb, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scaling,
                                         enable_gqa=h != k.shape[1])
    return out.transpose(1, 2).reshape(bs * n, h, -1)
