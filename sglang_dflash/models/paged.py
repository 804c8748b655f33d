"""The serving form of the draft: the reference model plus a paged context K/V store.

The store is indexed by the target's KV slot ids (SGLang's req_to_token maps a
request's positions to slots), so the draft context of a token lives in the
same slot as the target's K/V of that token. Whatever SGLang shares between
requests through the radix cache is therefore right for the draft too. A block's
attention reads the store in place (ops/draft_attention.py: a Triton kernel on
CUDA, its torch twin elsewhere).
"""

from __future__ import annotations

import dataclasses

import torch

from sglang_dflash.models.reference import DFlashDraftModel
from sglang_dflash.ops.draft_attention import draft_attention


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
                      req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                      max_prefix: int | None = None) -> torch.Tensor:
        """Block embeddings [bs, B, H] at positions [bs, B], each request attending over its
        committed context (prefix_lens[i] tokens) and its whole block -> hidden [bs, B, H].
        max_prefix: prefix_lens.max(), when the caller has it on the host."""
        context = PagedContext(self, req_to_token, req_pool_indices, prefix_lens,
                               int(prefix_lens.max()) if max_prefix is None else max_prefix)
        return self.model(embeds.to(self.k.dtype), positions, context)


@dataclasses.dataclass
class PagedContext:
    """The context of a batch's blocks, read from the paged store (the `attend` of a draft forward)."""
    store: PagedDraft
    req_to_token: torch.Tensor  # [R, L] the target's slots of each request's positions
    req_pool_indices: torch.Tensor  # [bs]
    prefix_lens: torch.Tensor  # [bs] committed tokens of each request
    max_prefix: int

    def attend(self, layer: int, q, k_blk, v_blk, mask=None):
        """q [bs, h, B, d], k_blk/v_blk [bs, kvh, B, d] -> [bs, h, B, d], non-causal over context + block."""
        assert mask is None, "a paged context is attended non-causally, whole"
        return draft_attention(q, k_blk, v_blk, self.store.k[layer], self.store.v[layer], self.req_to_token,
                               self.req_pool_indices, self.prefix_lens, q.shape[-1] ** -0.5, self.max_prefix)
