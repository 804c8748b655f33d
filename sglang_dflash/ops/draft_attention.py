"""The draft's attention in serving: a block's queries over its paged context and over the block itself.

Each request r drafts a block of B tokens. Its B queries attend, non-causally, to

  - its committed context: prefix_lens[r] tokens whose K/V sit in the draft's paged store
    (models/paged.py) at the target's KV slots req_to_token[req_pool_indices[r], :prefix_lens[r]];
  - the block's own B keys/values, all of them.

Two implementations compute the same thing:

  draft_attention_torch    the twin: each request's context gathered into a padded [bs, kvh, L, d]
                           tensor, then one masked SDPA (what the CPU server runs);
  draft_attention_triton   one Triton program per (request, kv head, context split): the G query
                           heads that share a kv head and the B block rows form one [G·B, d] tile of
                           queries; the context is read slot by slot from the store, never copied,
                           with an online softmax; the last split also takes the block's own keys.
                           With several splits (long contexts, few programs) each writes its
                           partial output and log-sum-exp and `merge_splits` combines them.

`draft_attention` takes the Triton kernel for CUDA tensors when Triton imports, the twin otherwise (on
CUDA without Triton it says so once in the log).
tests/test_draft_attention.py checks the kernel against the twin through Triton's interpreter on
the CPU; benchmarks/kernels.py checks and times it on a GPU.

Shapes: bs requests, B block tokens, h / kvh query / kv heads (G = h / kvh), d head dim,
P store slots, S context splits.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from sglang_dflash.ops.attention import gather_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch without Triton: the twin serves
    triton = tl = None


def draft_attention_torch(q, k_blk, v_blk, k_store, v_store, req_to_token, req_pool_indices, prefix_lens,
                          scale: float, max_prefix: int | None = None):
    """q [bs, h, B, d]; k_blk, v_blk [bs, kvh, B, d]; k_store, v_store [P, kvh, d]; req_to_token [R, L];
    req_pool_indices, prefix_lens [bs] -> out [bs, h, B, d]."""
    bs, h, B, _ = q.shape
    prefix_lens = prefix_lens.long()
    max_len = int(prefix_lens.max()) if max_prefix is None else max_prefix
    k_ctx, valid = gather_kv(k_store, req_to_token, req_pool_indices, prefix_lens, max_len)  # [bs, kvh, L, d]
    v_ctx, _ = gather_kv(v_store, req_to_token, req_pool_indices, prefix_lens, max_len)
    mask = torch.cat([valid[:, None, None, :].expand(bs, 1, B, max_len),
                      torch.ones(bs, 1, B, B, dtype=torch.bool, device=q.device)], dim=-1)  # [bs, 1, B, L + B]
    k = torch.cat([k_ctx.to(q.dtype), k_blk], dim=2)
    v = torch.cat([v_ctx.to(q.dtype), v_blk], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=h != k.shape[1])


def merge_splits(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Partial attentions over disjoint key sets -> the attention over their union.
    out [S, ...rows, d] (each normalised over its own keys), lse [S, ...rows] (log-sum-exp of its scores;
    -inf where a split had no keys) -> [...rows, d]."""
    w = torch.exp(lse - lse.max(dim=0).values)  # [S, ...rows]: a split's share of the softmax mass
    return (w[..., None] * out).sum(0) / w.sum(0)[..., None]


if triton is not None:
    @triton.jit
    def _attend_tile(q, k, v, key_ok, m, l, acc, scale, IEEE: tl.constexpr):
        """One tile of keys k, v [N, d] (key_ok [N]) into the online softmax of the queries q [M, d]:
        running max m [M], running sum l [M] of exp(score - m), unnormalised output acc [M, d]."""
        if IEEE:  # float32 inputs: full-precision products (no TF32), as the twin computes
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv

    @triton.jit
    def _draft_attention_kernel(
            Q, KB, VB, KS, VS, REQ_TO_TOKEN, RPI, PREFIX, O, LSE,
            stride_qb, stride_qh, stride_qi,  # q [bs, h, B, d]
            stride_kbb, stride_kbh, stride_kbi,  # k_blk [bs, kvh, B, d]
            stride_vbb, stride_vbh, stride_vbi,  # v_blk
            stride_ksp, stride_ksh,  # k_store [P, kvh, d]
            stride_vsp, stride_vsh,  # v_store
            stride_rt,  # req_to_token [R, L]
            stride_os, stride_ob, stride_oh, stride_oi,  # out [S, bs, h, B, d]
            stride_ls, stride_lb, stride_lh,  # lse [S, bs, h, B]
            scale, B, G, D, chunk,
            BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
            NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr):
        r, kv, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = tl.arange(0, BLOCK_G * BLOCK_B)  # query row = (head in the kv head's group, block row)
        g, i = rows // BLOCK_B, rows % BLOCK_B
        row_ok = (g < G) & (i < B)
        head = kv * G + g
        dd = tl.arange(0, BLOCK_D)
        d_ok = dd < D
        q = tl.load(Q + r * stride_qb + head[:, None] * stride_qh + i[:, None] * stride_qi + dd[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m = tl.full([BLOCK_G * BLOCK_B], -1.0e30, tl.float32)
        l = tl.full([BLOCK_G * BLOCK_B], 0.0, tl.float32)
        acc = tl.full([BLOCK_G * BLOCK_B, BLOCK_D], 0.0, tl.float32)

        # the context: this split's share of positions [0, prefix), read from the store through req_to_token
        req = tl.load(RPI + r).to(tl.int64)
        prefix = tl.load(PREFIX + r)
        start = split * chunk
        end = tl.minimum(start + chunk, prefix)
        for n0 in range(start, end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < end
            slot = tl.load(REQ_TO_TOKEN + req * stride_rt + cols, mask=col_ok, other=0).to(tl.int64)
            kv_mask = col_ok[:, None] & d_ok[None, :]
            k = tl.load(KS + slot[:, None] * stride_ksp + kv * stride_ksh + dd[None, :], mask=kv_mask, other=0.0)
            v = tl.load(VS + slot[:, None] * stride_vsp + kv * stride_vsh + dd[None, :], mask=kv_mask, other=0.0)
            m, l, acc = _attend_tile(q, k.to(q.dtype), v.to(q.dtype), col_ok, m, l, acc, scale, IEEE)

        # the block's own B keys, each visible to every row (non-causal); the last split takes them
        if split == NUM_SPLITS - 1:
            j = tl.arange(0, BLOCK_B)
            j_ok = j < B
            kv_mask = j_ok[:, None] & d_ok[None, :]
            k = tl.load(KB + r * stride_kbb + kv * stride_kbh + j[:, None] * stride_kbi + dd[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(VB + r * stride_vbb + kv * stride_vbh + j[:, None] * stride_vbi + dd[None, :],
                        mask=kv_mask, other=0.0)
            m, l, acc = _attend_tile(q, k, v, j_ok, m, l, acc, scale, IEEE)

        has_keys = l > 0  # a split past a short request's context has none
        out = acc / tl.where(has_keys, l, 1.0)[:, None]
        o_ptr = O + split * stride_os + r * stride_ob + head[:, None] * stride_oh + i[:, None] * stride_oi + dd[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if NUM_SPLITS > 1:
            lse = tl.where(has_keys, m + tl.log(l), float("-inf"))
            tl.store(LSE + split * stride_ls + r * stride_lb + head * stride_lh + i, lse, mask=row_ok)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (int(n) - 1).bit_length())


def plan_splits(programs: int, max_prefix: int, block_n: int, target_programs: int) -> tuple[int, int]:
    """(number of context splits, positions per split): split long contexts until the grid has about
    target_programs programs, each split at least 4 tiles of block_n positions."""
    max_prefix = max(int(max_prefix), 1)
    by_grid = -(-target_programs // max(programs, 1))
    by_length = -(-max_prefix // (4 * block_n))
    splits = max(1, min(by_grid, by_length))
    chunk = -(-max_prefix // splits)
    chunk = -(-chunk // block_n) * block_n  # whole tiles
    return -(-max_prefix // chunk), chunk


def draft_attention_triton(q, k_blk, v_blk, k_store, v_store, req_to_token, req_pool_indices, prefix_lens,
                           scale: float, max_prefix: int | None = None, splits: int | None = None,
                           block_n: int = 32):
    """What draft_attention_torch computes, in one Triton kernel (plus a merge when the context is split).
    max_prefix: prefix_lens.max() when the caller knows it on the host (else one device sync);
    splits: force the number of context splits (tests)."""
    bs, h, B, d = q.shape
    kvh = k_blk.shape[1]
    G = h // kvh
    assert h == kvh * G and k_store.shape[1:] == (kvh, d) and k_blk.shape == (bs, kvh, B, d)
    assert q.stride(-1) == k_blk.stride(-1) == v_blk.stride(-1) == k_store.stride(-1) == v_store.stride(-1) == 1
    if max_prefix is None:
        max_prefix = int(prefix_lens.max())
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        splits, chunk = plan_splits(bs * kvh, max_prefix, block_n, 2 * sms)
    else:
        chunk = -(-max(max_prefix, 1) // splits)
    out_dtype = q.dtype if splits == 1 else torch.float32
    out = torch.empty((splits, bs, h, B, d), device=q.device, dtype=out_dtype)
    lse = torch.empty((splits, bs, h, B), device=q.device, dtype=torch.float32)
    prefix_lens = prefix_lens.to(torch.int32).contiguous()
    req_pool_indices = req_pool_indices.contiguous()
    assert req_to_token.stride(1) == 1
    _draft_attention_kernel[(bs, kvh, splits)](
        q, k_blk, v_blk, k_store, v_store, req_to_token, req_pool_indices, prefix_lens, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_blk.stride(0), k_blk.stride(1), k_blk.stride(2),
        v_blk.stride(0), v_blk.stride(1), v_blk.stride(2),
        k_store.stride(0), k_store.stride(1),
        v_store.stride(0), v_store.stride(1),
        req_to_token.stride(0),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        lse.stride(0), lse.stride(1), lse.stride(2),
        scale, B, G, d, chunk,
        BLOCK_B=_pow2(B), BLOCK_G=_pow2(G, 1), BLOCK_D=_pow2(d), BLOCK_N=block_n,
        NUM_SPLITS=splits, IEEE=q.dtype == torch.float32)
    if splits == 1:
        return out[0]
    return merge_splits(out, lse).to(q.dtype)


def triton_available() -> bool:
    return triton is not None


@functools.cache
def _say_twin_on_cuda() -> None:
    logging.getLogger(__name__).warning(
        "Triton does not import in this environment: the draft's attention on CUDA runs its plain-torch twin "
        "(correct, slower: it gathers each request's context into a padded tensor); install triton for the kernel")


def draft_attention(q, k_blk, v_blk, k_store, v_store, req_to_token, req_pool_indices, prefix_lens, scale: float,
                    max_prefix: int | None = None):
    """The Triton kernel for CUDA tensors (when Triton imports; if it does not, the twin, said once in the log),
    the torch twin otherwise."""
    if q.is_cuda and triton is not None:
        return draft_attention_triton(q, k_blk, v_blk, k_store, v_store, req_to_token, req_pool_indices,
                                      prefix_lens, scale, max_prefix)
    if q.is_cuda:
        _say_twin_on_cuda()
    return draft_attention_torch(q, k_blk, v_blk, k_store, v_store, req_to_token, req_pool_indices, prefix_lens,
                                 scale, max_prefix)
