"""Attention of a block of queries over a paged KV cache, in plain torch.

Used for the target's TARGET_VERIFY forward on SGLang's torch_native backend
(causal) and for the draft's block forward (non-causal). Only the block's
queries are computed: each request attends over its prefix plus its own
block, never over padding.

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


def block_attention_mask(prefix_lens: torch.Tensor, n: int, max_len: int, causal: bool) -> torch.Tensor:
    """[bs, 1, n, L] bool: query i of a request (at position prefix + i) sees key j when
    j < prefix + n (its own rows) and, if causal, j <= prefix + i."""
    cols = torch.arange(max_len, device=prefix_lens.device)
    rows = torch.arange(n, device=prefix_lens.device)
    limit = prefix_lens[:, None] + (rows[None, :] + 1 if causal else n)  # [bs, n], exclusive
    return (cols[None, None, :] < limit[:, :, None])[:, None]


def paged_block_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                          req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, n: int, scaling: float,
                          causal: bool) -> torch.Tensor:
    """q [bs*n, h, d] of block tokens whose K/V are already in the pool -> out [bs*n, h, d].

    The block of request r sits at req_to_token[r, prefix : prefix + n].
    """
    bs = prefix_lens.shape[0]
    h, d = q.shape[1], q.shape[2]
    prefix_lens = prefix_lens.long()
    max_len = int(prefix_lens.max()) + n
    k, _ = gather_kv(k_buf, req_to_token, req_pool_indices, prefix_lens + n, max_len)
    v, _ = gather_kv(v_buf, req_to_token, req_pool_indices, prefix_lens + n, max_len)
    mask = block_attention_mask(prefix_lens, n, max_len, causal)
    qb = q.view(bs, n, h, d).transpose(1, 2)  # [bs, h, n, d]
    out = F.scaled_dot_product_attention(qb, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scaling,
                                         enable_gqa=h != k.shape[1])
    return out.transpose(1, 2).reshape(bs * n, h, d)
