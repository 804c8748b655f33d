"""The serving form of the draft: the reference model plus a paged context K/V store.

The store is indexed by the target's KV slot ids (SGLang's req_to_token maps a
request's positions to slots), so the draft context of a token lives in the
same slot as the target's K/V of that token. Whatever SGLang shares between
requests through the radix cache is therefore right for the draft too.
"""

from __future__ import annotations

import torch

from sglang_dflash.models.reference import ContextCache, DFlashDraftModel
from sglang_dflash.ops.attention import gather_kv


class PagedDraft:
    def __init__(self, model: DFlashDraftModel, num_slots: int, device, dtype):
        cfg = model.config
        self.model = model
        self.block_size = cfg.block_size
        # this rank's kv heads (all of them unless the model is sharded: models/sharded.py)
        shape = (len(model.layers), num_slots, model.layers[0].self_attn.kvh, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @torch.no_grad()
    def write_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Context K/V of committed tokens: features [N, F] at positions [N] into slots [N]."""
        if features.shape[0] == 0:
            return
        ctx = self.model.project_context(features[None].to(self.k.dtype))  # [1, N, H]
        cos, sin = self.model.rope(positions[None], ctx.dtype)
        for i, layer in enumerate(self.model.layers):
            k, v = layer.self_attn.kv(ctx, cos, sin)  # [1, kvh, N, d]
            self.k[i, slots] = k[0].transpose(0, 1)
            self.v[i, slots] = v[0].transpose(0, 1)

    @torch.no_grad()
    def forward_block(self, embeds: torch.Tensor, positions: torch.Tensor, req_to_token: torch.Tensor,
                      req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
        """Block embeddings [bs, B, H] at positions [bs, B], each request attending over its
        committed context (prefix_lens[i] tokens) and its whole block -> hidden [bs, B, H]."""
        bs, B, _ = embeds.shape
        max_len = int(prefix_lens.max())
        keys, values, valid = [], [], None
        for i in range(len(self.model.layers)):
            k, valid = gather_kv(self.k[i], req_to_token, req_pool_indices, prefix_lens, max_len)
            v, _ = gather_kv(self.v[i], req_to_token, req_pool_indices, prefix_lens, max_len)
            keys.append(k)
            values.append(v)
        mask = torch.cat([valid[:, None, None, :].expand(bs, 1, B, max_len),
                          torch.ones(bs, 1, B, B, dtype=torch.bool, device=embeds.device)], dim=-1)
        return self.model(embeds.to(self.k.dtype), positions, ContextCache(keys, values), mask)
