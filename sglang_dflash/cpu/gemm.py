"""Float32 linear layers over a few rows, on the CPU: the verify forward's products.

Measured on one of the project's 2-core machines (AVX2 only; torch 2.14, MKL's default mode, float32,
SmolLM2-135M's 30 layers and its lm_head with weights not in cache, ms per forward of M rows):

    M                      1     2     3     4     8    16    32    64
    F.linear(x, W)        53    94   122    75    73    81   111   168
    (W @ x.T).T           55    22    30    31    51    67    96   149

torch's float32 x @ W.T falls off a cliff for a few rows, and the other orientation does not:
with it, verifying a block of 4 tokens costs less than decoding one. bfloat16 shows no cliff
(27 against 33 ms at M=4), so only float32 takes this path. Past about 96 rows the other orientation
loses (every linear layer of the 30 and the lm_head, weights cycled through memory, ms per forward):

    M                      4    16    64    96   128   256   512
    F.linear(x, W)        93   111   229   304   374   738  1466
    (W @ x.T).T           43    84   204   308   392   835  1925

so it is taken from 2 to FAST_MAX_ROWS rows: a verify batch of 16 requests × 16 rows or 128 × 4 (the
window-4 server at load) takes SGLang's product.

Those tables are MKL's default mode. With MKL_CBWR set (cpu/runtime.py's mkl_mode: `sglang-dflash serve`
sets AUTO) x @ Wᵀ no longer falls off its cliff, and the other orientation wins at a few rows only (a 2-core
AMD EPYC, Zen 4, AVX-512; the same 30 layers and lm_head, ms per forward):

    M                      2     4     6     8    12    16    32    64
    F.linear(x, W)        40    35    49    43    50    62    84   127
    (W @ x.T).T           19    28    42    52    82    69    95   138

so with MKL_CBWR set the fast path ends at FAST_MAX_ROWS_CBWR rows.

`linear` computes the product the fast way. Inside `verify_scope()` the target's linear layers and
its lm_head (SGLang's UnquantizedLinearMethod.apply and LogitsProcessor._compute_lm_head, hooked by
the plugin on the CPU engine) use it too, for the DFLASH verify forward only: the server without
speculation, prefill and every other forward keep SGLang's own path.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch
import torch.nn.functional as F

FAST_MAX_ROWS_CBWR = 6
# MKL reads MKL_CBWR once, at a process's first product; a server's environment is set before it starts
FAST_MAX_ROWS = FAST_MAX_ROWS_CBWR if os.environ.get("MKL_CBWR") else 64
# Whether the current forward is a DFLASH verify forward: set by the worker around it (verify_scope), read by
# the hooks below. A context variable, not a module global: it belongs to the thread (and task) that set it.
_in_verify = contextvars.ContextVar("sglang_dflash_in_verify", default=False)


def takes_fast_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    rows = x.numel() // max(x.shape[-1], 1)
    return x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and 2 <= rows <= FAST_MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [..., in], weight [out, in] -> [..., out], contiguous."""
    if not takes_fast_path(x, weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = (weight @ rows.T).T.contiguous()  # [M, out]
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def verify_scope():
    """The target's linear layers and lm_head use `linear` while this is open (on a CPU, in float32)."""
    token = _in_verify.set(True)
    try:
        yield
    finally:
        _in_verify.reset(token)


def _plain_layer(layer) -> bool:
    return not getattr(layer, "use_intel_amx_backend", False) and not hasattr(layer, "set_lora")


def linear_method_apply(original, self, layer, x, bias=None):
    """Around UnquantizedLinearMethod.apply."""
    if _in_verify.get() and _plain_layer(layer) and takes_fast_path(x, layer.weight):
        return linear(x, layer.weight, bias)
    return original(self, layer, x, bias)


def compute_lm_head(original, self, hidden_states, lm_head, embedding_bias=None, **kw):
    """Around LogitsProcessor._compute_lm_head: where SGLang would take its plain matmul (no quantized
    lm_head kernel, by SGLang's own rule; no bias; not the RL on-policy bf16 product)."""
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

    plain = (hasattr(lm_head, "weight") and embedding_bias is None and _plain_layer(lm_head)
             and getattr(self, "rl_on_policy_target", None) is None
             and not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None)))
    if _in_verify.get() and plain and takes_fast_path(hidden_states, lm_head.weight):
        return linear(hidden_states, lm_head.weight)
    return original(self, hidden_states, lm_head, embedding_bias, **kw)
