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
    return kernels.accept_greedy(draft_tokens, target_logits.argmax(-1))


def rejection_tables(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor):
    """The deterministic half of speculative rejection sampling.

    draft_tokens [b, B-1], sampled from draft_probs q [b, B-1, V]; target_probs p [b, B, V]
    (after the request's temperature / top-k / top-p / min-p).
    -> accept_prob [b, B-1]: d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i));
       stop_dist [b, B, V]: where the next token is drawn from when the first i drafts were
       accepted and d_{i+1} rejected, normalize(max(0, p_{i+1} - q_{i+1})), and, for i = B-1
       (every draft accepted), p_B.
    """
    q_full = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # [b, B, V]; q_B = 0
    return accept_probs(draft_tokens, draft_probs, target_probs), stop_distribution(target_probs, q_full)


def accept_probs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """[b, B-1]: min(1, p_i(d_i) / q_i(d_i)), the probability of accepting each draft token."""
    idx = draft_tokens[..., None]
    p_d = target_probs[:, :-1].gather(-1, idx).squeeze(-1)  # [b, B-1]
    q_d = draft_probs.gather(-1, idx).squeeze(-1)
    return accept_prob(p_d, q_d)


def accept_prob(p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) elementwise; 0 where q(d) = 0 (a token the draft cannot propose)."""
    return torch.where(q_d > 0, (p_d / q_d.clamp_min(torch.finfo(q_d.dtype).tiny)).clamp(max=1), 0)


def stop_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) over the last dimension; p where that is empty (p == q, where a
    rejection has probability 0)."""
    residual = (p - q).clamp_min(0)
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    return residual / residual.sum(-1, keepdim=True)


def accept_sampled(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   generator: torch.Generator | None = None, seeds: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None):
    """Speculative rejection sampling with every target distribution given, p [b, B, V]."""
    return accept_sampled_rows(draft_tokens, draft_probs, lambda j, rows: target_probs[rows, j], generator, seeds,
                               positions)


def accept_sampled_rows(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, p_row,
                        generator: torch.Generator | None = None, seeds: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None):
    """Speculative rejection sampling: the committed tokens are distributed exactly as the target's.

    draft_tokens [b, B-1] sampled from draft_probs q [b, B-1, V]; p_row(j, rows) -> [len(rows), V]
    is the target's distribution (after temperature / top-k / top-p / min-p) at block row j for the
    requests rows. Accept d_1, d_2, … while u_i < min(1, p_i(d_i) / q_i(d_i)); at the first rejection
    (or after the last draft) draw the next token from that row's stop distribution (rejection_tables).
    Row j's p is formed only for the requests that accepted every draft before it: with V in the tens
    of thousands that is most of the work, and most blocks stop early.
    The uniforms come from generator (or torch's global one), or, for seeded requests, from
    seeded_uniform(seeds [b], positions [b, B] of the block): the same seed gives the same tokens
    whatever batch the request is in.
    """
    b, n = draft_tokens.shape
    V, device = draft_probs.shape[-1], draft_tokens.device
    if seeds is None:
        u = torch.rand(b, n, generator=generator, device=device, dtype=draft_probs.dtype)
    else:
        u = seeded_uniform(seeds, positions[:, 1:], SALT_ACCEPT)  # keyed by the position d_i would take
    accept_len = torch.full((b,), n, dtype=torch.long, device=device)
    stop = torch.empty(b, V, dtype=draft_probs.dtype, device=device)  # each request's stop distribution
    active = torch.arange(b, device=device)  # the requests that accepted every draft so far
    for j in range(n + 1):
        if active.numel() == 0:
            break
        p = p_row(j, active).to(stop.dtype)  # [m, V]
        if j == n:  # every draft accepted: the next token comes from p_B
            stop[active] = p / p.sum(-1, keepdim=True)
            break
        d = draft_tokens[active, j, None].long()
        q = draft_probs[active, j]
        ok = u[active, j] < accept_prob(p.gather(1, d).squeeze(1), q.gather(1, d).squeeze(1))
        rejected = active[~ok]
        accept_len[rejected] = j
        stop[rejected] = stop_distribution(p[~ok], q[~ok])
        active = active[ok]
    if seeds is None:
        next_token = draw(stop, generator)
    else:  # keyed by the position the drawn token takes
        next_token = sample_inverse_cdf(stop, seeded_uniform(seeds, positions.gather(1, accept_len[:, None]) + 1,
                                                              SALT_STOP).squeeze(1))
    return accept_len, next_token


SORT_HEAD = 1024


def _sorted_head(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor):
    """probs [N, V] in descending order with their ids, cut to the SORT_HEAD largest when that drops
    nothing top-k / top-p would keep: in every row top_k <= SORT_HEAD, or the head's mass exceeds
    top_p (so the nucleus ends inside it). A top-k of 1024 costs far less than sorting 8,000 × 49k."""
    V = probs.shape[-1]
    if SORT_HEAD < V:
        vals, idx = probs.topk(SORT_HEAD, dim=-1)
        if bool(((top_ks.view(-1) <= SORT_HEAD) | (vals.sum(-1) > top_ps.view(-1))).all()):
            return vals, idx
    return probs.sort(dim=-1, descending=True)


# ---- seeded requests --------------------------------------------------------------------------
# A uniform per (request seed, token position, purpose). Within one step every decision reads a
# different (position, purpose); across steps a position's uniforms are read again only for
# positions past the last one decided, which no earlier decision looked at. So the draws are
# independent of the history, as rejection sampling needs, and reproducible.
SALT_DRAFT, SALT_ACCEPT, SALT_STOP, SALT_TREE = 0x5EED01, 0x5EED02, 0x5EED03, 0x5EED04
_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """seeds [b] (int), positions [b, n] -> [b, n] float64 uniforms in (0, 1), a hash of (seed, position, salt)."""
    s = seeds.long().view(-1, 1)
    h = _fmix32(((positions.long() & _M32) * 0x9E3779B1 + salt) & _M32)
    h = _fmix32(h ^ (s & _M32))
    h = _fmix32(h ^ ((s >> 32) & _M32) ^ 0x68E31DA4)
    return (h.double() + 0.5) / 2.0 ** 32


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [..., V] (rows need not sum to 1), u [...] in (0, 1] -> [...] the token where the
    cumulative mass first reaches u × the row's total (never a zero-probability token)."""
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1)).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


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
        probs_sort, probs_idx = _sorted_head(probs, top_ks, top_ps)
        cum_before = probs_sort.cumsum(-1) - probs_sort
        ranks = torch.arange(probs_sort.shape[-1], device=probs.device)[None]
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


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs [..., V] (rows need not sum to 1) -> [...] one token per row, drawn as torch.multinomial(row, 1)
    draws it, by inverse CDF from a uniform of generator (or torch's global one). On this project's 2-core CPU,
    over SmolLM2's 49,152 tokens, torch.multinomial took 408 ms for 384 rows (a window-4 step of 128 requests'
    drafts) and 16 ms for 16; this takes 111 and 4.7."""
    u = 1 - torch.rand(probs.shape[:-1], generator=generator, device=probs.device, dtype=torch.float64)  # (0, 1]
    return sample_inverse_cdf(probs, u)
