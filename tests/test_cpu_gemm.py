"""The verify forward's float32 product on the CPU equals F.linear, and SGLang's layers take it
only inside verify_scope()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_dflash.cpu import gemm

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 15, 64, 65, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_f_linear(rows, dtype):
    torch.manual_seed(rows)
    w, b = torch.randn(300, 96, dtype=dtype), torch.randn(300, dtype=dtype)
    for x in (torch.randn(rows, 96, dtype=dtype), torch.randn(2, rows, 96, dtype=dtype)):
        for bias in (None, b):
            out = gemm.linear(x, w, bias)
            assert out.shape == (*x.shape[:-1], 300) and out.is_contiguous()
            torch.testing.assert_close(out, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_sglang_layers_take_it_only_inside_the_verify_scope():
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(50, 16), requires_grad=False)
    x = torch.randn(4, 16)
    calls = []

    def original(self, layer, x, bias=None):
        calls.append("sglang")
        return F.linear(x, layer.weight, bias)

    def original_head(self, hidden, lm_head, embedding_bias=None, **kw):
        calls.append("sglang head")
        return F.linear(hidden, lm_head.weight)

    gemm.linear_method_apply(original, None, layer, x)
    gemm.compute_lm_head(original_head, None, x, layer)
    assert calls == ["sglang", "sglang head"]
    with gemm.verify_scope():
        out = gemm.linear_method_apply(original, None, layer, x)
        head = gemm.compute_lm_head(original_head, None, x, layer)
        gemm.linear_method_apply(original, None, layer, x[:1])  # one row: no cliff, SGLang's path
        gemm.linear_method_apply(original, None, layer, torch.randn(gemm.FAST_MAX_ROWS + 1, 16))  # many: SGLang's
        layer.use_intel_amx_backend = True  # packed weights: SGLang's own kernel
        gemm.linear_method_apply(original, None, layer, x)
    assert calls == ["sglang", "sglang head", "sglang", "sglang", "sglang"]
    torch.testing.assert_close(out, F.linear(x, layer.weight))
    torch.testing.assert_close(head, F.linear(x, layer.weight))
