"""The draft as the server runs it: the reference model's layers with SGLang's tensor-parallel linears.

Under --tp N each rank holds 1/N of every layer: QKVParallelLinear splits the query heads (and the
key/value heads; with fewer kv heads than ranks each rank holds one, replicated), o_proj and
down_proj are RowParallelLinear (partial products all-reduced, so every rank ends each layer with
the same hidden states), gate/up one MergedColumnParallelLinear. fc, the norms, and the embedding and
lm_head (the target's) are not split. The context K/V store (models/paged.py) then holds this rank's
kv heads only. At --tp 1 the same layers compute what models/reference.py computes.

The published checkpoint (separate q/k/v and gate/up tensors, the whole of each) loads through the
layers' own weight loaders, each rank keeping its part, in the server's dtype whatever dtype the
checkpoint was saved in. SGLang's process_weights_after_loading is not called: the weights stay
plain [out, in] tensors (no CPU AMX packing), which `project_kv` slices.

When the ranks do not divide the heads (SmolLM2's 9 query / 3 kv heads at --tp 2), the draft is
padded as SGLang pads such a target on a CPU: kv heads up to a multiple of the ranks, each with its
group of query heads, all of zero weights (a zero query, key and value and a zero o_proj column: a
padded head adds exactly nothing); likewise an MLP width the ranks do not divide.

Building one needs SGLang's parallel state: the server's, or in tests one stood up per rank as
tests/test_sharded_draft.py does (init_distributed_environment, publish_build_topology,
initialize_model_parallel).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.config import DraftConfig
from sglang_dflash.models.reference import (DFlashDraftModel, DraftAttention, DraftLayer, RMSNorm,
                                            read_checkpoint)

# checkpoint projection -> (this model's fused projection, the weight loader's shard id)
FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class ShardedAttention(DraftAttention):
    def __init__(self, cfg):
        from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear

        nn.Module.__init__(self)
        heads, d, H, bias = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size, cfg.attention_bias
        self.qkv_proj = QKVParallelLinear(H, d, heads, cfg.num_key_value_heads, bias=bias)
        self.h, self.kvh, self.d = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d  # this rank's
        self.o_proj = RowParallelLinear(heads * d, H, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project_qkv(self, x):
        kv = self.kvh * self.d
        return self.qkv_proj(x)[0].split([self.h * self.d, kv, kv], dim=-1)

    def project_kv(self, x):
        q = self.h * self.d  # the context rows need no queries: only the k and v rows of the weight
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[q:]
        return F.linear(x, self.qkv_proj.weight[q:], bias).split(self.kvh * self.d, dim=-1)

    def project_out(self, o):
        return self.o_proj(o)[0]


class ShardedMLP(nn.Module):
    def __init__(self, cfg):
        from sglang.srt.layers.linear import MergedColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x)[0].chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)[0]


class ShardedLayer(DraftLayer):
    attention_class, mlp_class = ShardedAttention, ShardedMLP


class ShardedDraftModel(DFlashDraftModel):
    layer_class = ShardedLayer

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None, device="cpu") -> "ShardedDraftModel":
        from sglang.srt.runtime_context import get_parallel

        cfg, state = read_checkpoint(path, device)
        cfg, state = pad_for_ranks(cfg, state, get_parallel().tp_size)
        with torch.device(device), default_dtype(dtype or next(iter(state.values())).dtype):
            model = cls(cfg)
        model.load_weights(state)
        return model.eval()

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Checkpoint tensors (whole, reference names) -> this rank's parts, in this model's dtype."""
        params = dict(self.named_parameters())
        for name, tensor in state.items():
            module, proj, leaf = split_name(name)
            if proj in FUSED:
                fused, shard_id = FUSED[proj]
                param = params[f"{module}.{fused}.{leaf}"]
                param.weight_loader(param, tensor, shard_id)
            elif proj in ("o_proj", "down_proj"):
                params[name].weight_loader(params[name], tensor)
            else:
                params[name].copy_(tensor)


def split_name(name: str) -> tuple[str, str, str]:
    """"layers.0.self_attn.q_proj.weight" -> ("layers.0.self_attn", "q_proj", "weight");
    a top-level parameter ("norm.weight") has no projection: ("", "", name)."""
    return tuple(name.rsplit(".", 2)) if name.count(".") >= 2 else ("", "", name)


def pad_for_ranks(cfg: DraftConfig, state: dict[str, torch.Tensor], tp: int):
    """(config, checkpoint tensors) -> the same draft with zero heads and MLP columns appended where
    `tp` ranks do not divide them (unchanged when they do)."""
    group, kvh, width = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.num_key_value_heads, cfg.intermediate_size
    heads_split = cfg.num_attention_heads % tp == 0 and (kvh % tp == 0 or tp % kvh == 0)
    new_kvh = kvh if heads_split else -(-kvh // tp) * tp
    new_width = -(-width // tp) * tp
    if (new_kvh, new_width) == (kvh, width):
        return cfg, state
    d = cfg.head_dim

    def pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        shape = list(t.shape)
        shape[dim] = size - shape[dim]
        return torch.cat([t, t.new_zeros(shape)], dim=dim)

    rows = {"q_proj": new_kvh * group * d, "k_proj": new_kvh * d, "v_proj": new_kvh * d,
            "gate_proj": new_width, "up_proj": new_width}  # output rows (weight and bias)
    cols = {"o_proj": new_kvh * group * d, "down_proj": new_width}  # input columns
    padded = {}
    for name, t in state.items():
        proj = split_name(name)[1]
        if proj in rows:
            t = pad(t, 0, rows[proj])
        elif proj in cols and name.endswith("weight"):
            t = pad(t, 1, cols[proj])
        padded[name] = t
    return dataclasses.replace(cfg, num_attention_heads=new_kvh * group, num_key_value_heads=new_kvh,
                               intermediate_size=new_width), padded


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """SGLang's layers create their parameters in the default dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
