"""The plain-torch operators of the serving path, against brute-force definitions on random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_dflash.accept import filtered_probs
from sglang_dflash.config import DraftConfig
from sglang_dflash.models.paged import PagedDraft
from sglang_dflash.models.reference import DFlashDraftModel
from sglang_dflash.ops.attention import paged_block_attention
from sglang_dflash.ops.cpu_kernels import assign_extend_cache_locs, assign_req_to_token_pool, copy_all_layer_kv_cache

pytestmark = pytest.mark.unit


def random_pool(g, bs, n, max_prefix, pool=512, width=96, prefix=None):
    """A req_to_token table whose requests own disjoint random slots, and their prefix lengths."""
    prefix = torch.randint(1, max_prefix + 1, (bs,), generator=g) if prefix is None else torch.tensor(prefix)
    perm = torch.randperm(pool, generator=g)
    req_to_token = torch.zeros(bs + 2, width, dtype=torch.int32)
    rpi = torch.randperm(bs + 2, generator=g)[:bs]
    used = 0
    for i in range(bs):
        m = int(prefix[i]) + n
        req_to_token[rpi[i], :m] = perm[used:used + m].int()
        used += m
    return req_to_token, rpi, prefix


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rows", ["random", "one row, one request", "one row, spread lengths", "one row, even lengths"])
def test_paged_block_attention_matches_per_request_sdpa(causal, seed, rows):
    """Random shapes, and the three ways of a 1-row step: one request, lengths spread (one request at a
    time), lengths alike (padded and masked); values of another head dim than keys' (odd seeds)."""
    g = torch.Generator().manual_seed(seed)
    bs, n, h, kvh, d = int(torch.randint(1, 6, (1,), generator=g)), [1, 4, 16][seed % 3], 6, 2, 8
    prefix = {"random": None, "one row, one request": [int(torch.randint(1, 60, (1,), generator=g))],
              "one row, spread lengths": [3, 60, 1, 9], "one row, even lengths": [50, 52, 49, 51]}[rows]
    if prefix is not None:
        bs, n = len(prefix), 1
    req_to_token, rpi, prefix = random_pool(g, bs, n, max_prefix=60, prefix=prefix)
    dv = [d, 12][seed % 2]
    k_buf, v_buf = torch.randn(512, kvh, d, generator=g), torch.randn(512, kvh, dv, generator=g)
    q = torch.randn(bs * n, h, d, generator=g)
    out = paged_block_attention(q, k_buf, v_buf, req_to_token, rpi, prefix, n, 0.3, causal)
    for i in range(bs):
        m = int(prefix[i]) + n
        slots = req_to_token[rpi[i], :m].long()
        k = k_buf[slots].repeat_interleave(h // kvh, 1).transpose(0, 1)  # [h, m, d]
        v = v_buf[slots].repeat_interleave(h // kvh, 1).transpose(0, 1)
        qi = q[i * n:(i + 1) * n].transpose(0, 1)  # [h, n, d]
        mask = torch.ones(n, m, dtype=torch.bool)
        if causal:
            mask = torch.arange(m)[None] <= (int(prefix[i]) + torch.arange(n))[:, None]
        ref = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(out[i * n:(i + 1) * n], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_paged_block_attention_with_a_tree_mask_matches_per_request_sdpa(seed):
    """A tree's verify (tree.ancestor_mask as the block mask): each node over the prefix and its ancestors."""
    from sglang_dflash.tree import ancestor_mask, build_trees

    g = torch.Generator().manual_seed(seed)
    bs, n, h, kvh, d = 3, 7, 4, 2, 8
    req_to_token, rpi, prefix = random_pool(g, bs, n, max_prefix=40)
    _, parents, _ = build_trees(torch.log_softmax(torch.randn(bs, 4, 10, generator=g), -1), 2, n, torch.zeros(bs))
    block_mask = torch.stack([ancestor_mask(p) for p in parents])
    dv = [d, 12][seed % 2]
    k_buf, v_buf = torch.randn(512, kvh, d, generator=g), torch.randn(512, kvh, dv, generator=g)
    q = torch.randn(bs * n, h, d, generator=g)
    out = paged_block_attention(q, k_buf, v_buf, req_to_token, rpi, prefix, n, 0.3, True, block_mask)
    for i in range(bs):
        P = int(prefix[i])
        slots = req_to_token[rpi[i], :P + n].long()
        k = k_buf[slots].repeat_interleave(h // kvh, 1).transpose(0, 1)
        v = v_buf[slots].repeat_interleave(h // kvh, 1).transpose(0, 1)
        mask = torch.cat([torch.ones(n, P, dtype=torch.bool), block_mask[i]], dim=1)
        ref = F.scaled_dot_product_attention(q[i * n:(i + 1) * n].transpose(0, 1), k, v, attn_mask=mask,
                                             scale=0.3).transpose(0, 1)
        torch.testing.assert_close(out[i * n:(i + 1) * n], ref, atol=1e-5, rtol=1e-5)


def test_cpu_kernel_twins():
    g = torch.Generator().manual_seed(0)
    req_to_token = torch.zeros(4, 32, dtype=torch.int32)
    rpi = torch.tensor([2, 0, 3])
    start, end = torch.tensor([0, 5, 3], dtype=torch.int32), torch.tensor([4, 5, 10], dtype=torch.int32)
    locs = torch.randperm(100, generator=g)[:11]
    assign_req_to_token_pool(rpi, req_to_token, start, end, locs, 32)
    expected = torch.zeros_like(req_to_token)
    expected[2, 0:4], expected[3, 3:10] = locs[0:4].int(), locs[4:11].int()
    assert torch.equal(req_to_token, expected)
    back = torch.full((11,), -1, dtype=torch.int64)
    assign_extend_cache_locs(rpi, req_to_token, start.long(), end.long(), back, 32)
    assert torch.equal(back, locs)
    # a span past the row's end is an error: torch would broadcast one slot into the empty slice (issue 24's leak)
    for s, e in ((32, 33), (30, 34)):
        with pytest.raises(IndexError, match="run past req_to_token's width 32"):
            assign_req_to_token_pool(torch.tensor([1]), req_to_token, torch.tensor([s]), torch.tensor([e]),
                                     locs[:e - s], 32)
    assert torch.equal(req_to_token, expected)

    bufs = [torch.randn(20, 3, 4), torch.randn(20, 3, 4)]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b[0].nbytes for b in bufs], dtype=torch.int64)
    copy_all_layer_kv_cache(ptrs, strides, torch.tensor([7, 1]), torch.tensor([1, 5]))
    for b, old in zip(bufs, before):
        expected = old.clone()
        expected[7], expected[1] = old[1], old[5]
        assert torch.equal(b, expected)


def small_draft(seed=0, **kw):
    cfg = DraftConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=64, block_size=8, num_target_layers=6,
                      target_layer_ids=[1, 3], mask_token_id=63, **kw)
    return DFlashDraftModel.random(cfg, seed=seed)


def test_paged_draft_matches_reference_model():
    """Context written slot by slot and read back through req_to_token gives the reference's hidden states."""
    g = torch.Generator().manual_seed(5)
    model = small_draft()
    B, F_ = model.config.block_size, 2 * 48
    bs = 3
    req_to_token, rpi, prefix = random_pool(g, bs, B, max_prefix=30)
    paged = PagedDraft(model, 512, "cpu", torch.float32)
    features = [torch.randn(int(p), F_, generator=g) for p in prefix]
    # commit each request's context in two uneven pieces, as prefill + a verify step would
    for i in range(bs):
        p = int(prefix[i])
        cut = p // 3
        for a, b in ((0, cut), (cut, p)):
            paged.write_context(features[i][a:b], torch.arange(a, b), req_to_token[rpi[i], a:b].long())
    embeds = torch.randn(bs, B, 48, generator=g)
    positions = prefix[:, None] + torch.arange(B)[None]
    hidden = paged.forward_block(embeds, positions, req_to_token, rpi, prefix)
    for i in range(bs):
        p = int(prefix[i])
        ctx = model.new_cache(1, "cpu", torch.float32)
        model.commit_context(ctx, features[i][None], torch.arange(p)[None])
        ref = model(embeds[i:i + 1], positions[i:i + 1], ctx)
        torch.testing.assert_close(hidden[i:i + 1], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["mixed", "no top_p", "temperature only", "min_p only"])
def test_filtered_probs_matches_sglang_sampler(case):
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    g = torch.Generator().manual_seed(2)
    N, V = 6, 50
    logits = torch.randn(N, V, generator=g) * 3
    temps = torch.tensor([0.7, 1.0, 1.3, 1.0, 0.5, 1.0])
    top_ks = torch.tensor([50, 20, 50, 1, 5, 1 << 30])  # 1 << 30: SGLang's "no top-k"
    top_ps = torch.tensor([1.0, 1.0, 0.9, 1.0, 0.8, 0.95])
    min_ps = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.1])
    if case != "mixed":  # the paths that sort nothing
        top_ps = torch.ones(N)
    if case in ("temperature only", "min_p only"):
        top_ks = torch.full((N,), 1 << 30)
    if case == "temperature only":
        min_ps = torch.zeros(N)
    ours = filtered_probs(logits, temps, top_ks, top_ps, min_ps)
    probs = torch.softmax(logits / temps[:, None], -1)
    _, probs_sort, probs_idx, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        probs.clone(), top_ks, top_ps, min_ps, True, None, torch.zeros(N), return_filtered_probs=True)
    theirs = torch.zeros_like(probs).scatter_(-1, probs_idx.long(), probs_sort)
    theirs = theirs / theirs.sum(-1, keepdim=True)
    torch.testing.assert_close(ours, theirs)
    if top_ks[3] == 1:
        assert torch.equal(ours[3] > 0, F.one_hot(logits[3].argmax(), V).bool())  # top_k 1 is greedy


@pytest.mark.parametrize("with_tree", [False, True])
def test_the_torch_native_verify_hook_applies_a_trees_mask(with_tree):
    """plugin.torch_native_forward_extend (TARGET_VERIFY on the CPU engine): with the tree's ancestor masks on
    the verify input (tree.TREE_MASK_ATTR) each node attends over the prefix and its ancestors; without them,
    the causal block, whatever custom_mask SGLang put on the input (here a padded all-True one, as its CUDA
    graph buffers hold); a mask of the wrong shape is an error."""
    from types import SimpleNamespace

    from sglang.srt.layers.radix_attention import AttentionType

    from sglang_dflash.plugin import torch_native_forward_extend
    from sglang_dflash.tree import TREE_MASK_ATTR, ancestor_mask, build_trees

    g = torch.Generator().manual_seed(5)
    bs, n, h, kvh, d = 3, 6, 4, 2, 8
    req_to_token, rpi, prefix = random_pool(g, bs, n, max_prefix=30)
    _, parents, _ = build_trees(torch.log_softmax(torch.randn(bs, 4, 10, generator=g), -1), 2, n, torch.zeros(bs))
    if not with_tree:
        parents = torch.arange(-1, n - 1).expand(bs, -1)  # the chain: each row's parent is the row before
    k_buf, v_buf = torch.randn(512, kvh, d, generator=g), torch.randn(512, kvh, d, generator=g)
    pool = SimpleNamespace(get_key_buffer=lambda i: k_buf, get_value_buffer=lambda i: v_buf)
    backend = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
    layer = SimpleNamespace(tp_q_head_num=h, qk_head_dim=d, v_head_dim=d, scaling=0.3, layer_id=0,
                            is_cross_attention=False, attn_type=AttentionType.DECODER)
    spec = SimpleNamespace(custom_mask=torch.ones(1000, dtype=torch.bool))
    if with_tree:
        setattr(spec, TREE_MASK_ATTR, torch.stack([ancestor_mask(p) for p in parents]))
    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True), spec_info=spec,
                         seq_lens=prefix, req_pool_indices=rpi, batch_size=bs)
    q = torch.randn(bs * n, h * d, generator=g)
    out = torch_native_forward_extend(None, backend, q, None, None, layer, fb, save_kv_cache=False).view(bs * n, h, d)
    for i in range(bs):
        P = int(prefix[i])
        slots = req_to_token[rpi[i], :P + n].long()
        k = k_buf[slots].repeat_interleave(h // kvh, 1).transpose(0, 1)
        v = v_buf[slots].repeat_interleave(h // kvh, 1).transpose(0, 1)
        mask = torch.cat([torch.ones(n, P, dtype=torch.bool), ancestor_mask(parents[i])], dim=1)
        ref = F.scaled_dot_product_attention(q[i * n:(i + 1) * n].view(n, h, d).transpose(0, 1), k, v,
                                             attn_mask=mask, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(out[i * n:(i + 1) * n], ref, atol=1e-5, rtol=1e-5)
    setattr(spec, TREE_MASK_ATTR, torch.ones(bs, n - 1, n - 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="a tree verify mask of shape"):
        torch_native_forward_extend(None, backend, q, None, None, layer, fb, save_kv_cache=False)
