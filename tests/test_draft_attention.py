"""The draft's serving attention: the Triton kernel against its plain-torch twin, and the twin against
per-request SDPA. The kernel runs here through Triton's interpreter (on the CPU, in numpy); on a GPU
benchmarks/kernels.py runs the compiled kernel against the same twin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sglang_dflash.ops import draft_attention as da

from test_ops import random_pool


def random_case(seed: int, bs: int, h: int, kvh: int, d: int, B: int, max_prefix: int, dtype=torch.float32,
                pool: int = 1024):
    g = torch.Generator().manual_seed(seed)
    req_to_token, rpi, prefix = random_pool(g, bs, B, max_prefix=max_prefix, pool=pool, width=max_prefix + B)
    t = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return (t(bs, h, B, d), t(bs, kvh, B, d), t(bs, kvh, B, d), t(pool, kvh, d), t(pool, kvh, d),
            req_to_token, rpi, prefix)


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(3))
def test_twin_matches_per_request_sdpa(seed):
    q, kb, vb, ks, vs, req_to_token, rpi, prefix = random_case(seed, bs=4, h=6, kvh=2, d=8, B=4, max_prefix=40)
    out = da.draft_attention_torch(q, kb, vb, ks, vs, req_to_token, rpi, prefix, 0.3)
    for r in range(q.shape[0]):
        slots = req_to_token[rpi[r], :int(prefix[r])].long()
        k = torch.cat([ks[slots].transpose(0, 1), kb[r]], dim=1).repeat_interleave(3, 0)  # [h, prefix + B, d]
        v = torch.cat([vs[slots].transpose(0, 1), vb[r]], dim=1).repeat_interleave(3, 0)
        torch.testing.assert_close(out[r], F.scaled_dot_product_attention(q[r], k, v, scale=0.3))


@pytest.mark.unit
def test_merge_splits_is_the_attention_over_the_union():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 8, generator=g), torch.randn(30, 8, generator=g), torch.randn(30, 8, generator=g)
    parts = [(0, 7), (7, 7), (7, 19), (19, 30)]  # one split with no keys
    outs, lses = [], []
    for a, b in parts:
        s = q @ k[a:b].T
        outs.append(torch.softmax(s, -1) @ v[a:b] if b > a else torch.zeros(5, 8))
        lses.append(torch.logsumexp(s, -1) if b > a else torch.full((5,), float("-inf")))
    merged = da.merge_splits(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, torch.softmax(q @ k.T, -1) @ v)


# (shape, splits): MHA with a published block; SmolLM2's draft (a group of 3 query heads per kv head, d 64);
# a head dim and a block that are no powers of two. Each with 1, 2 and 3 context splits.
KERNEL_CASES = [(dict(seed=s, bs=1, h=4, kvh=4, d=16, B=16), s) for s in (1, 2, 3)] + \
               [(dict(seed=s, bs=3, h=9, kvh=3, d=64, B=16), s) for s in (1, 2, 3)] + \
               [(dict(seed=s, bs=2, h=8, kvh=2, d=24, B=5), s) for s in (1, 2, 3)]


def check_kernel_cases() -> int:
    """The Triton kernel against the twin on every case; prints each, returns how many ran. Runs where
    Triton can run the kernel: on a GPU (float32 cases, then bfloat16), or through its interpreter
    (TRITON_INTERPRET=1, on the CPU; float32 only: the interpreter's tl.dot of two bfloat16 tiles is
    wrong, off by ~1e10 on a 16x16 product of N(0, 1) values, so bfloat16 is checked on a GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    ran = 0
    for dtype in dtypes:
        for plan, splits in KERNEL_CASES:
            q, kb, vb, ks, vs, req_to_token, rpi, prefix = (
                t.to(device) for t in random_case(max_prefix=90, dtype=dtype, **plan))
            ref = da.draft_attention_torch(q.float(), kb.float(), vb.float(), ks.float(), vs.float(), req_to_token,
                                           rpi, prefix, 0.125)
            out = da.draft_attention_triton(q, kb, vb, ks, vs, req_to_token, rpi, prefix, 0.125, splits=splits)
            err = (out.float() - ref).abs().max().item()
            print(f"{str(dtype)[6:]} {plan} splits={splits}: max |kernel - float32 twin| = {err:.2e}")
            assert out.dtype == dtype
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
            ran += 1
    return ran


# the kernel's runs: Triton's interpreter always; the compiled kernel where a GPU is
RUNS = ["interpreter"] + (["cuda"] if torch.cuda.is_available() and da.triton_available() else [])


@pytest.mark.process
@pytest.mark.parametrize("run", RUNS)
def test_triton_kernel_matches_twin(run):
    """The interpreter runs in a child process with TRITON_INTERPRET=1: Triton decides interpreted or
    compiled when it is imported (its own library included), so it cannot be switched in this one."""
    if run == "cuda":
        assert check_kernel_cases() == 2 * len(KERNEL_CASES)
        return
    pytest.importorskip("triton", reason="Triton is not installed (the kernel serves only CUDA then)")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    code = "import test_draft_attention as t; t.check_kernel_cases()"
    child = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True,
                           text=True, timeout=600)
    print(child.stdout)
    assert child.returncode == 0, child.stdout + child.stderr
    assert child.stdout.count("max |kernel") == len(KERNEL_CASES)


@pytest.mark.unit
def test_plan_splits():
    assert da.plan_splits(programs=512, max_prefix=4096, block_n=32, target_programs=264) == (1, 4096)
    assert da.plan_splits(programs=8, max_prefix=100, block_n=32, target_programs=264) == (1, 128)
    splits, chunk = da.plan_splits(programs=8, max_prefix=4096, block_n=32, target_programs=264)
    assert splits == 32 and chunk == 128 and chunk % 32 == 0
    splits, chunk = da.plan_splits(programs=8, max_prefix=1000, block_n=32, target_programs=264)
    assert splits * chunk >= 1000 and (splits - 1) * chunk < 1000 and chunk >= 128
