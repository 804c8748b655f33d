"""Acceptance rules for one verified block, shared by every backend.

Shapes: b requests, B block size; a block is [bonus, d_1 … d_{B-1}], so there are
B-1 draft tokens and B target distributions (one per block position; the last
one predicts the token after d_{B-1}).
Both rules return (accept_len [b], next_token [b]): the first accept_len draft
tokens are kept and next_token (the target's own token) follows them, so a
step commits accept_len + 1 tokens.
"""

from __future__ import annotations

import torch

from sglang_dflash.ops import kernels


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor):
    """Longest prefix where d_i equals the target's argmax at i-1, plus the target's next token.

    draft_tokens [b, B-1] int; target_logits [b, B, V]. (ops.kernels.accept_greedy: one CUDA launch.)
    """
    accept_len, next_token, _ = kernels.accept_greedy(draft_tokens, target_logits.argmax(-1))
    return accept_len, next_token


def rejection_tables(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor):
    """The deterministic half of speculative rejection sampling.

    draft_tokens [b, B-1], sampled from draft_probs q [b, B-1, V]; target_probs p [b, B, V]
    (after the request's temperature / top-k / top-p / min-p).
    -> accept_prob [b, B-1]: d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i));
       stop_dist [b, B, V]: where the next token is drawn from when the first i drafts were
       accepted and d_{i+1} rejected, normalize(max(0, p_{i+1} - q_{i+1})), and, for i = B-1
       (every draft accepted), p_B.
    """
    idx = draft_tokens[..., None]
    p_d = target_probs[:, :-1].gather(-1, idx).squeeze(-1)  # [b, B-1]
    q_d = draft_probs.gather(-1, idx).squeeze(-1)
    accept_prob = torch.where(q_d > 0, (p_d / q_d.clamp_min(torch.finfo(q_d.dtype).tiny)).clamp(max=1), 0)
    q_full = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # [b, B, V]; q_B = 0
    residual = (target_probs - q_full).clamp_min(0)
    # A residual that sums to zero means p == q there, where rejection has probability 0; use p.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs, residual)
    return accept_prob, residual / residual.sum(-1, keepdim=True)


def accept_sampled(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   generator: torch.Generator | None = None):
    """Speculative rejection sampling: the committed tokens are distributed exactly as the target's.

    Shapes as in rejection_tables. Accept d_1, d_2, … while u_i < min(1, p_i(d_i) / q_i(d_i)); at
    the first rejection (or after the last draft) draw the next token from that position's stop_dist.
    """
    b, n = draft_tokens.shape
    accept_prob, stop_dist = rejection_tables(draft_tokens, draft_probs, target_probs)
    u = torch.rand(b, n, generator=generator, device=draft_tokens.device, dtype=accept_prob.dtype)
    accept_len = (u < accept_prob).int().cumprod(-1).sum(-1)  # [b]
    pick = accept_len[:, None, None].expand(-1, 1, stop_dist.shape[-1])
    next_token = torch.multinomial(stop_dist.gather(1, pick).squeeze(1), 1, generator=generator).squeeze(1)
    return accept_len, next_token


def filtered_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                   min_ps: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution a request samples from, as SGLang's sampler forms it: softmax(logits / T),
    then keep the top_k most likely tokens, then the smallest head whose mass reaches top_p, then
    drop tokens below min_p × the most likely one; renormalised.

    logits [N, V]; temperatures, top_ks, top_ps, min_ps [N] (one row per distribution).
    Only top_p needs the vocabulary sorted; without it top_k is a threshold at the k-th
    largest probability (tokens tied with it are kept) and min_p needs only the maximum.
    """
    probs = torch.softmax(logits.float() / temperatures.float().view(-1, 1), dim=-1)
    V = probs.shape[-1]
    need_k = bool((top_ks < V).any())
    need_p = bool((top_ps < 1).any())
    need_min = min_ps is not None and bool((min_ps > 0).any())
    if not (need_k or need_p or need_min):
        return probs
    if need_p:
        probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
        cum_before = probs_sort.cumsum(-1) - probs_sort
        ranks = torch.arange(V, device=probs.device)[None]
        drop = (ranks >= top_ks.view(-1, 1)) | (cum_before > top_ps.view(-1, 1))
        if need_min:
            drop |= probs_sort < (probs_sort[:, :1] * min_ps.view(-1, 1))
        out = torch.zeros_like(probs).scatter_(-1, probs_idx, probs_sort.masked_fill(drop, 0.0))
    else:
        drop = torch.zeros_like(probs, dtype=torch.bool)
        if need_k:
            k = top_ks.clamp(1, V).long().view(-1, 1)
            top = probs.topk(int(k.max()), dim=-1).values  # [N, max k], descending
            drop |= probs < top.gather(1, k - 1)
        if need_min:
            drop |= probs < probs.amax(-1, keepdim=True) * min_ps.view(-1, 1)
        out = probs.masked_fill(drop, 0.0)
    return out / out.sum(-1, keepdim=True)
