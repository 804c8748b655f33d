"""The DFlash draft model in plain PyTorch: training, the Transformers backend, the oracle.

Qwen3-style decoder layers with no embedding and no lm_head of their own (both
are the target's). The target's hidden states at `target_layer_ids` are
concatenated and projected, `hidden_norm(fc(features))`, into one context
vector per committed token; every layer attends over the context rows (as
extra keys/values through its own k_proj/v_proj/k_norm) plus the block,
bidirectionally.

Shapes: b batch, Q block tokens, C context tokens, H hidden, F = features * H,
h/kvh query/key-value heads, d head_dim.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.config import WEIGHTS_FILE, DraftConfig, DraftConfigError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [b, T] -> cos, sin [b, 1, T, d] (the rotate-half convention of HF Llama/Qwen3)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [b, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@dataclasses.dataclass
class ContextCache:
    """Per-layer K/V of the committed context: keys[l], values[l] are [b, kvh, C, d].

    A context is what a draft forward attends to: `attend(l, q, k_blk, v_blk, mask)` is layer l's
    attention of the block's queries over the context and the block. This one holds the context
    densely (training, the Transformers backend); models/paged.py's reads it from the server's
    paged store."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def attend(self, layer: int, q, k_blk, v_blk, mask=None):
        """q [b, h, Q, d], k_blk/v_blk [b, kvh, Q, d]; mask [b|1, 1, Q, C+Q] bool (True = attend) or None
        (everything) -> [b, h, Q, d]."""
        k = torch.cat([self.keys[layer], k_blk], dim=2)  # [b, kvh, C+Q, d]
        v = torch.cat([self.values[layer], v_blk], dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(H, self.h * self.d, bias=bias)
        self.k_proj = nn.Linear(H, self.kvh * self.d, bias=bias)
        self.v_proj = nn.Linear(H, self.kvh * self.d, bias=bias)
        self.o_proj = nn.Linear(self.h * self.d, H, bias=bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    # The three products (models/sharded.py computes them with SGLang's tensor-parallel layers).
    def project_qkv(self, x):
        """x [..., H] -> q [..., h·d], k [..., kvh·d], v [..., kvh·d]."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def project_kv(self, x):
        """x [..., H] -> k, v [..., kvh·d] (the context rows need no queries)."""
        return self.k_proj(x), self.v_proj(x)

    def project_out(self, o):
        """o [..., h·d] -> [..., H]."""
        return self.o_proj(o)

    def shape_kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """k, v [b, T, kvh·d] -> [b, kvh, T, d] each (k normed and rotated)."""
        b, T, _ = k.shape
        k = self.k_norm(k.view(b, T, self.kvh, self.d)).transpose(1, 2)
        return apply_rope(k, cos, sin), v.view(b, T, self.kvh, self.d).transpose(1, 2)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [b, T, H] -> k, v [b, kvh, T, d] (k normed and rotated)."""
        return self.shape_kv(*self.project_kv(x), cos, sin)

    def forward(self, x, cos, sin, attend):
        """x [b, Q, H] block -> [b, Q, H]. attend(q [b, h, Q, d], k_blk, v_blk [b, kvh, Q, d]) -> [b, h, Q, d]:
        the attention over the context and the block (the context's own: ContextCache.attend)."""
        b, Q, _ = x.shape
        q, k_blk, v_blk = self.project_qkv(x)
        q = apply_rope(self.q_norm(q.view(b, Q, self.h, self.d)).transpose(1, 2), cos, sin)
        out = attend(q, *self.shape_kv(k_blk, v_blk, cos, sin))
        return self.project_out(out.transpose(1, 2).reshape(b, Q, self.h * self.d))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    attention_class, mlp_class = DraftAttention, DraftMLP

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = self.attention_class(cfg)
        self.mlp = self.mlp_class(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    layer_class = DraftLayer

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        cfg.check()
        self.config = cfg
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    # ---- the two operations of a decode step ----------------------------
    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """features [b, C, F] (target hidden states at target_layer_ids, concatenated) -> [b, C, H]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> ContextCache:
        """Per-layer context K/V for features [b, C, F] at positions [b, C]."""
        ctx = self.project_context(features)
        cos, sin = self.rope(positions, ctx.dtype)
        kvs = [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]
        return ContextCache([k for k, _ in kvs], [v for _, v in kvs])

    def new_cache(self, batch: int, device, dtype) -> ContextCache:
        empty = lambda: torch.empty(batch, self.layers[0].self_attn.kvh, 0, self.config.head_dim,  # noqa: E731
                                    device=device, dtype=dtype)
        return ContextCache([empty() for _ in self.layers], [empty() for _ in self.layers])

    def commit_context(self, cache: ContextCache, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Append the context K/V of newly committed tokens (features [b, n, F] at positions [b, n])."""
        new = self.context_kv(features, positions)
        for i in range(len(self.layers)):
            cache.keys[i] = torch.cat([cache.keys[i], new.keys[i]], dim=2)
            cache.values[i] = torch.cat([cache.values[i], new.values[i]], dim=2)

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, context,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """block_embeds [b, Q, H] at positions [b, Q], attending to context + block -> hidden [b, Q, H].

        context: a ContextCache, or anything with its `attend` (models/paged.py's PagedContext).
        mask: [b|1, 1, Q, C+Q] bool, True where a query may attend; None = everything (non-causal).
        """
        cos, sin = self.rope(positions, block_embeds.dtype)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, functools.partial(context.attend, i, mask=mask))
        return self.norm(x)

    def rope(self, positions, dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    # ---- checkpoint format ---------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None, device="cpu") -> "DFlashDraftModel":
        cfg, state = read_checkpoint(path, device)
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(state, assign=True)
        return model.eval()

    def save_pretrained(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        self.config.save(path)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path / WEIGHTS_FILE))

    @classmethod
    def random(cls, cfg: DraftConfig, seed: int = 0, dtype=torch.float32) -> "DFlashDraftModel":
        """A randomly initialised draft (normal(0, 0.02) weights, unit norms), deterministic in seed."""
        gen = torch.Generator().manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        return model.to(dtype).eval()


def read_checkpoint(path: str | Path, device="cpu") -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """A draft in the published format -> (its config, its tensors by this model's parameter names),
    checked: every parameter present, none extra, each of the shape the config implies."""
    from safetensors.torch import load_file

    cfg = DraftConfig.from_pretrained(path)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise DraftConfigError(f"draft path {str(path)!r} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device=str(device)))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    with torch.device("meta"):
        expected = DFlashDraftModel(cfg).state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DraftConfigError(f"draft weights in {str(path)!r} do not match its config: "
                               f"missing {missing[:5]}{'…' if len(missing) > 5 else ''}, "
                               f"unexpected {unexpected[:5]}{'…' if len(unexpected) > 5 else ''}")
    for name, t in expected.items():
        if state[name].shape != t.shape:
            raise DraftConfigError(f"draft weight {name} has shape {tuple(state[name].shape)}, "
                                   f"its config implies {tuple(t.shape)}")
    return cfg, state
