"""The step kernels (csrc/dflash_kernels.cu) and their plain-torch twins (sglang_dflash/ops/kernels.py).

On every machine: each twin equals a brute-force, loop-by-loop definition on random inputs
(batch sizes, page sizes, accept lengths from 0 to the block size). Where a GPU is present the
same inputs also go through the compiled kernels, which must equal the twins exactly.
"""

import os
import shutil

import pytest
import torch

from sglang_dflash.ops import kernels

pytestmark = pytest.mark.unit

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and kernels.extension_available() else [])
SEEDS = range(6)


def paged_req_to_token(num_reqs: int, max_len: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """[num_reqs + 2, max_len] int32: each request's positions on randomly chosen, distinct pages of
    page_size contiguous slots (SGLang's paged layout); two unused rows around them."""
    pages_per_req = -(-max_len // page_size)
    pages = torch.randperm(num_reqs * pages_per_req + 7, generator=gen)[: num_reqs * pages_per_req] + 1
    pages = pages.view(num_reqs, pages_per_req)
    pos = torch.arange(max_len)
    rows = pages[:, pos // page_size] * page_size + pos % page_size
    filler = torch.full((1, max_len), -5, dtype=torch.long)
    return torch.cat([filler, rows, filler]).to(torch.int32)


def random_step(seed: int, page_size: int):
    gen = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, 9, (1,), generator=gen))
    B = int(torch.randint(2, 17, (1,), generator=gen))
    max_len = 64
    req_to_token = paged_req_to_token(bs, max_len, page_size, gen)
    req_pool_indices = torch.randperm(bs, generator=gen) + 1
    seq_lens = torch.randint(0, max_len - B + 1, (bs,), generator=gen)
    bonus = torch.randint(0, 1000, (bs,), generator=gen)
    return gen, bs, B, req_to_token, req_pool_indices, seq_lens, bonus


def on(device, *tensors):
    return [t.to(device) for t in tensors]


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", SEEDS)
def test_build_block(seed, page_size, device):
    _, bs, B, req_to_token, rpi, seq_lens, bonus = random_step(seed, page_size)
    mask_id = 7
    ids, positions, slots = kernels.build_block(*on(device, bonus, seq_lens, rpi, req_to_token), mask_id, B, page_size)
    for r in range(bs):
        for k in range(B):
            pos = int(seq_lens[r]) + k
            assert ids[r, k] == (bonus[r] if k == 0 else mask_id)
            assert positions[r, k] == pos
            assert slots[r, k] == req_to_token[rpi[r], pos]
    twin = kernels.build_block_torch(bonus, seq_lens, rpi, req_to_token, mask_id, B, page_size)
    assert all(same(a, b) for a, b in zip((ids, positions, slots), twin))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", SEEDS)
def test_gather_context_features(seed, dtype, device):
    gen, bs, B, req_to_token, rpi, seq_lens, _ = random_step(seed, 1)
    F = 24
    hidden = torch.randn(bs, B, F, generator=gen).to(dtype)
    commit_lens = torch.randint(1, B + 1, (bs,), generator=gen)  # accept lengths 0 … B-1, plus the bonus
    commit_lens[0] = 1
    if bs > 1:
        commit_lens[-1] = B
    positions = seq_lens[:, None] + torch.arange(B)[None]
    slots = req_to_token[rpi[:, None], positions].long()
    rows, row_pos, row_slots, total = kernels.gather_context_features(*on(device, hidden, commit_lens, positions, slots))
    kept = [(r, k) for r in range(bs) for k in range(B) if k < commit_lens[r]]
    dropped = [(r, k) for r in range(bs) for k in range(B) if k >= commit_lens[r]]
    assert int(total) == len(kept)
    for i, (r, k) in enumerate(kept + dropped):
        assert torch.equal(rows[i].cpu(), hidden[r, k])
        assert row_pos[i] == positions[r, k]
        assert row_slots[i] == (slots[r, k] if i < len(kept) else -1)
    twin = kernels.gather_context_features_torch(hidden, commit_lens, positions, slots)
    assert all(same(a, b) for a, b in zip((rows, row_pos, row_slots, total), twin))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_accept_greedy(seed, device):
    gen, bs, B, _, _, _, _ = random_step(seed, 1)
    target = torch.randint(0, 5, (bs, B), generator=gen)
    draft = target[:, :-1].clone()
    for r in range(bs):  # a first mismatch at a chosen row (B-1: none), so every accept length occurs
        miss = int(torch.randint(0, B, (1,), generator=gen)) if r else B - 1
        if miss < B - 1:
            draft[r, miss] = target[r, miss] + 1
    accept_len, next_token = kernels.accept_greedy(*on(device, draft, target))
    for r in range(bs):
        n = 0
        while n < B - 1 and draft[r, n] == target[r, n]:
            n += 1
        assert accept_len[r] == n and next_token[r] == target[r, n]
    assert accept_len[0] == B - 1
    twin = kernels.accept_greedy_torch(draft, target)
    assert all(same(a, b) for a, b in zip((accept_len, next_token), twin))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_training_block_mask(seed, device):
    gen = torch.Generator().manual_seed(seed)
    T, B = int(torch.randint(4, 40, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
    N = int(torch.randint(0, 6, (1,), generator=gen))
    anchors = torch.randint(0, T, (N,), generator=gen)
    mask = kernels.training_block_mask(anchors.to(device), T, B)
    assert mask.shape == (N * B, T + N * B) and mask.dtype == torch.bool
    for q in range(N * B):
        for c in range(T + N * B):
            want = c < anchors[q // B] if c < T else (c - T) // B == q // B
            assert bool(mask[q, c]) == bool(want), (q, c)
    assert same(mask, kernels.training_block_mask_torch(anchors, T, B))


def test_extension_is_built_where_nvcc_is():
    """Where nvcc and a CUDA-enabled torch are present, `pip install` must have compiled csrc/
    (a compile error fails set-up, and an extension that does not import fails here)."""
    nvcc = shutil.which("nvcc") or os.path.isfile("/usr/local/cuda/bin/nvcc")
    expected = bool(torch.version.cuda and nvcc and os.environ.get("SGLANG_DFLASH_BUILD_CUDA") != "0")
    assert kernels.extension_available() == expected, kernels.EXTENSION_ERROR
