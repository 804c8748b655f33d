"""The DFlash draft checkpoint config: parse, write, and check against a target.

The format is the published one (z-lab drafts): a Qwen3 config plus
`block_size`, `num_target_layers` and `dflash_config = {target_layer_ids,
mask_token_id}`, with `architectures = ["DFlashDraftModel"]`.
Every problem raises DraftConfigError with a message that names it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from sglang_dflash import settings

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS_FILE = "model.safetensors"


class DraftConfigError(ValueError):
    """A draft checkpoint that is malformed or does not fit its target."""


# What a config.json may hold besides the fields DraftConfig reads. A key outside these changes what the
# draft computes in a way this worker does not implement (DFlash2's selector, sliding-window layers, a
# quantised draft or one with its own embedding, …): such a config is refused by name, never run as
# something else (unsupported_keys).
INERT_KEYS = {  # Hugging Face / Qwen3 fields that do not change a draft's forward at inference
    "model_type", "auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "tie_word_embeddings",
    "attention_dropout", "max_window_layers",
}
INERT_VALUES = {  # keys that are harmless at these values only (a DFlash variant sets them otherwise)
    "use_sliding_window": (False, None), "has_embed_tokens": (False, None), "has_lm_head": (False, None),
    "dflash_config.selector_rank": (0, None), "dflash_config.selector_top_k": (0, None),
    "dflash_config.conv_kernel_size": (0, None), "dflash_config.conv_group_size": (0, None),
    "dflash_config.output_multiplier": (1, 1.0, None), "dflash_config.final_logit_softcapping": (0, 0.0, None),
    "dflash_config.attention_sink_bias": (False, None), "dflash_config.attention_value_scale": (None,),
    "dflash_config.projector_type": (None,), "dflash_config.sample_from_anchor": (True, None),
}
BUILTIN_HINT = f"SGLang's builtin DFLASH may run it: start the server with {settings.IMPL}=builtin"


def unsupported_keys(d: dict[str, Any], dflash: dict[str, Any]) -> list[str]:
    """The keys of a config.json (its dflash_config's as dflash_config.KEY) this worker does not implement,
    as KEY=VALUE. sliding_window is inert unless a layer uses it (use_sliding_window, or a 'sliding_attention'
    entry in layer_types, whose other entries must be 'full_attention')."""
    known = {f.name for f in dataclasses.fields(DraftConfig)} - {"extra"}
    known |= {"dflash_config", "rope_parameters"}
    items = [(k, v) for k, v in d.items()] + [(f"dflash_config.{k}", v) for k, v in dflash.items()]
    layer_types = d.get("layer_types")
    sliding = bool(d.get("use_sliding_window")) or (isinstance(layer_types, list) and "sliding_attention" in layer_types)
    bad = []
    for key, value in items:
        if key in known or key in INERT_KEYS or key in ("dflash_config.target_layer_ids", "dflash_config.mask_token_id",
                                                          "dflash_config.mask_token"):
            continue
        if key in INERT_VALUES and any(value == v and type(value) is type(v) or value is v for v in INERT_VALUES[key]):
            continue
        if key == "sliding_window" and not sliding:
            continue
        if key == "layer_types" and isinstance(value, list) and set(value) <= {"full_attention"}:
            continue
        if key == "architectures" and value == [ARCHITECTURE]:
            continue
        bad.append(f"{key}={json.dumps(value)[:60]}")
    return bad


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Evenly spaced layer ids from 1 to num_target_layers - 3 (the published rule).

    The published drafts take as many features as the draft has layers.
    For a 36-layer target and 5 features: [1, 9, 17, 25, 33].
    """
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise DraftConfigError(f"a target with {num_target_layers} layers is too shallow for the default layer rule")
    span = end - start
    ids = [round(start + i * span / (num_features - 1)) for i in range(num_features)]
    if len(set(ids)) != len(ids):
        raise DraftConfigError(f"a target with {num_target_layers} layers is too shallow to spread {num_features} "
                               "feature layers by the default rule: give target_layer_ids explicitly")
    return ids


@dataclasses.dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    # The file's inert fields (INERT_KEYS, INERT_VALUES, an unused sliding_window), written back unchanged.
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    # ---- reading -------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DraftConfig":
        d = dict(d)
        dflash = d.pop("dflash_config", None)
        if not isinstance(dflash, dict):
            raise DraftConfigError("config.json has no 'dflash_config' object: this is not a DFlash draft checkpoint")
        if dflash.get("mask_token_id") is None:
            raise DraftConfigError("config.json: dflash_config.mask_token_id is missing (the draft needs a mask token)")
        for key in ("block_size", "num_target_layers"):  # a later layout keeps them in dflash_config
            if key in dflash:
                value = dflash.pop(key)
                if d.setdefault(key, value) != value:
                    raise DraftConfigError(f"config.json: {key} is {d[key]} and dflash_config.{key} is {value}")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "block_size", "num_target_layers",
                    "vocab_size", "intermediate_size"):
            if key not in d:
                raise DraftConfigError(f"config.json: required field '{key}' is missing")
        n_heads = d["num_attention_heads"]
        head_dim = d.pop("head_dim", None) or d["hidden_size"] // n_heads
        rope = d.pop("rope_parameters", None) or {}
        rope_theta = d.pop("rope_theta", None) or rope.get("rope_theta", 1_000_000.0)
        rope_scaling = d.pop("rope_scaling", None)
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        bad = unsupported_keys(d, dflash)
        if bad:
            raise DraftConfigError(f"the draft's config.json has keys this worker does not implement: {', '.join(bad)}. "
                                   + BUILTIN_HINT)
        ids = dflash.get("target_layer_ids")
        if ids is None:
            ids = default_target_layer_ids(d["num_target_layers"], d["num_hidden_layers"])
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "target_layer_ids", "mask_token_id", "head_dim",
                                                             "rope_theta", "rope_scaling"}
        known = {k: d.pop(k) for k in list(d) if k in names}
        extra = {k: v for k, v in d.items() if k not in ("architectures", "model_type")}
        extra.update({f"dflash_config.{k}": v for k, v in dflash.items() if k not in ("target_layer_ids", "mask_token_id")})
        cfg = cls(**known, head_dim=head_dim, rope_theta=float(rope_theta), rope_scaling=rope_scaling,
                  target_layer_ids=[int(i) for i in ids], mask_token_id=int(dflash["mask_token_id"]), extra=extra)
        cfg.check()
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "DraftConfig":
        path = Path(path)
        if not path.is_dir():
            raise DraftConfigError(f"draft path {str(path)!r} is not a directory")
        file = path / "config.json"
        if not file.is_file():
            raise DraftConfigError(f"draft path {str(path)!r} has no config.json")
        try:
            d = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise DraftConfigError(f"{file} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    # ---- writing -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"model_type": "qwen3", "architectures": [ARCHITECTURE]}
        dflash: dict[str, Any] = {}
        for key, value in self.extra.items():
            if key.startswith("dflash_config."):
                dflash[key.split(".", 1)[1]] = value
            else:
                d[key] = value
        for f in dataclasses.fields(self):
            if f.name in ("extra", "target_layer_ids", "mask_token_id"):
                continue
            value = getattr(self, f.name)
            if value is not None:
                d[f.name] = value
        dflash.update(mask_token_id=self.mask_token_id, target_layer_ids=list(self.target_layer_ids))
        d["dflash_config"] = dflash
        return d

    def save(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    # ---- checking ------------------------------------------------------
    def check(self) -> None:
        """Checks that need only the draft itself."""
        if self.block_size < 2:
            raise DraftConfigError(f"block_size {self.block_size} is too small: a block holds the bonus token and at least one mask")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftConfigError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                                   f"num_key_value_heads {self.num_key_value_heads}")
        if not self.target_layer_ids:
            raise DraftConfigError("dflash_config.target_layer_ids is empty")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DraftConfigError(f"mask_token_id {self.mask_token_id} is outside the draft's vocabulary (size {self.vocab_size})")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise DraftConfigError(f"target_layer_ids {bad} are out of range for num_target_layers {self.num_target_layers}")
        if any(a >= b for a, b in zip(self.target_layer_ids, self.target_layer_ids[1:])):
            raise DraftConfigError(f"target_layer_ids {self.target_layer_ids} must be strictly increasing "
                                   "(servers capture each target layer once, in layer order)")
        if self.hidden_act != "silu":
            raise DraftConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.rope_scaling and self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) not in (None, "default"):
            raise DraftConfigError(f"rope scaling {self.rope_scaling} is not supported by this draft model yet")

    def check_target(self, target: Any, num_draft_tokens: int | None = None) -> None:
        """Checks that the draft fits a target, given the target's HF config (or a dict).

        num_draft_tokens: the server's --speculative-num-draft-tokens (the verify window), when given.
        """
        get = (lambda k, default=None: target.get(k, default)) if isinstance(target, dict) else \
              (lambda k, default=None: getattr(target, k, default))
        if hasattr(target, "get_text_config"):
            text = target.get_text_config()
            get = lambda k, default=None: getattr(text, k, default)  # noqa: E731
        t_hidden, t_layers, t_vocab = get("hidden_size"), get("num_hidden_layers"), get("vocab_size")
        if t_hidden != self.hidden_size:
            raise DraftConfigError(f"draft hidden_size {self.hidden_size} does not match the target's {t_hidden}: "
                                   "the draft shares the target's embedding and lm_head")
        if t_vocab != self.vocab_size:
            raise DraftConfigError(f"draft vocab_size {self.vocab_size} does not match the target's vocabulary {t_vocab}")
        if not 0 <= self.mask_token_id < t_vocab:
            raise DraftConfigError(f"mask_token_id {self.mask_token_id} is not a row of the target's embedding (vocabulary {t_vocab})")
        if t_layers != self.num_target_layers:
            raise DraftConfigError(f"draft was built for a {self.num_target_layers}-layer target, this target has {t_layers} layers")
        bad = [i for i in self.target_layer_ids if not 0 <= i < t_layers]
        if bad:
            raise DraftConfigError(f"target_layer_ids {bad} are out of range for a target with {t_layers} layers")
        if num_draft_tokens is not None and not 2 <= num_draft_tokens <= self.block_size:
            raise DraftConfigError(f"--speculative-num-draft-tokens {num_draft_tokens} (the tokens verified per step) "
                                   f"must be between 2 and the draft's block_size {self.block_size}")


def draft_config_for_target(target: Any, *, num_layers: int = 1, block_size: int = 16, mask_token_id: int,
                            target_layer_ids: list[int] | None = None, num_features: int | None = None) -> DraftConfig:
    """A draft shaped like its target (HF config): same hidden size, heads, MLP width and rope."""
    t = target.get_text_config() if hasattr(target, "get_text_config") else target
    rope = getattr(t, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(t, "rope_theta", 1_000_000.0))
    n_layers = t.num_hidden_layers
    ids = target_layer_ids or default_target_layer_ids(n_layers, num_features or num_layers)
    cfg = DraftConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        vocab_size=t.vocab_size, block_size=block_size, num_target_layers=n_layers, target_layer_ids=list(ids),
        mask_token_id=mask_token_id, rms_norm_eps=t.rms_norm_eps, rope_theta=float(theta),
        max_position_embeddings=t.max_position_embeddings,
    )
    cfg.check()
    cfg.check_target(t)
    return cfg


def load_checked(draft_path: str | Path, target_path: str | Path, num_draft_tokens: int | None = None,
                 trust_remote_code: bool = False) -> DraftConfig:
    """The draft's config, checked on its own and against the target's HF config and the server's flag."""
    from transformers import AutoConfig

    cfg = DraftConfig.from_pretrained(draft_path)
    cfg.check_target(AutoConfig.from_pretrained(str(target_path), trust_remote_code=trust_remote_code),
                     num_draft_tokens=num_draft_tokens)
    return cfg
