import dataclasses
import json

import pytest
import torch

from sglang_dflash.config import DraftConfig, DraftConfigError, default_target_layer_ids, draft_config_for_target
from sglang_dflash.models.reference import DFlashDraftModel

pytestmark = pytest.mark.unit

# The config of z-lab/Qwen3-8B-DFlash-b16 as public fixtures reproduce it.
PUBLISHED = {
    "model_type": "qwen3", "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16, "num_target_layers": 36,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000, "max_position_embeddings": 40960,
}
QWEN3_8B = {"hidden_size": 4096, "num_hidden_layers": 36, "vocab_size": 151936}


def test_published_config_parses_and_round_trips(tmp_path):
    cfg = DraftConfig.from_dict(PUBLISHED)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.mask_token_id == 151669 and cfg.head_dim == 128
    cfg.check_target(QWEN3_8B, num_draft_tokens=16)
    cfg.save(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    for key, value in PUBLISHED.items():
        assert written[key] == value, key
    assert DraftConfig.from_pretrained(tmp_path) == cfg


def test_default_layer_rule_matches_published_draft():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    with pytest.raises(DraftConfigError, match="too shallow"):
        default_target_layer_ids(4, 2)


def _error(match, **changes):
    d = json.loads(json.dumps(PUBLISHED))
    for key, value in changes.items():
        if key in ("mask_token_id", "target_layer_ids"):
            if value is None:
                d["dflash_config"].pop(key)
            else:
                d["dflash_config"][key] = value
        else:
            d[key] = value
    with pytest.raises(DraftConfigError, match=match):
        DraftConfig.from_dict(d)


def test_config_errors_name_the_problem():
    _error("mask_token_id is missing", mask_token_id=None)
    _error("mask_token_id 200000 is outside", mask_token_id=200000)
    _error(r"target_layer_ids \[36\] are out of range", target_layer_ids=[1, 36])
    _error("block_size 1 is too small", block_size=1)
    _error(r"target_layer_ids \[9, 1\] must be strictly increasing", target_layer_ids=[9, 1])
    _error("not a multiple of num_key_value_heads", num_key_value_heads=5)
    with pytest.raises(DraftConfigError, match="no 'dflash_config'"):
        DraftConfig.from_dict({k: v for k, v in PUBLISHED.items() if k != "dflash_config"})


# Configs of DFlash variants this worker does not implement: each must be refused with its keys named.
VARIANTS = {
    "DFlash2 selector": ({"selector_rank": 64, "selector_top_k": 8}, {},
                         "dflash_config.selector_rank=64, dflash_config.selector_top_k=8"),
    "sliding-window layers": ({}, {"layer_types": ["sliding_attention"] * 2 + ["full_attention"] * 3,
                                   "sliding_window": 2048},
                              'layer_types=["sliding_attention", "sliding_attention", '),
    "sliding window switched on": ({}, {"use_sliding_window": True, "sliding_window": 4096},
                                   "use_sliding_window=true, sliding_window=4096"),
    "grouped convolution": ({"conv_kernel_size": 4, "conv_group_size": 2}, {}, "dflash_config.conv_kernel_size=4"),
    "Domino projector": ({"projector_type": "domino", "gru_hidden_dim": 512}, {},
                         'dflash_config.projector_type="domino", dflash_config.gru_hidden_dim=512'),
    "own embedding, quantised": ({}, {"has_embed_tokens": True, "quantization_config": {"quant_algo": "W4A16_NVFP4"}},
                                 "has_embed_tokens=true, quantization_config="),
    "another architecture": ({}, {"architectures": ["Qwen3DSparkModel"]}, 'architectures=["Qwen3DSparkModel"]'),
    "an unknown key": ({}, {"some_new_switch": 1}, "some_new_switch=1"),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_a_config_with_keys_this_worker_does_not_implement_is_refused_by_name(name):
    dflash_keys, top_keys, named = VARIANTS[name]
    d = json.loads(json.dumps(PUBLISHED))
    d["dflash_config"].update(dflash_keys)
    d.update(top_keys)
    with pytest.raises(DraftConfigError, match="keys this worker does not implement") as e:
        DraftConfig.from_dict(d)
    assert named in str(e.value) and "SGLANG_DFLASH_IMPL=builtin" in str(e.value), str(e.value)


def test_inert_keys_load_and_are_written_back(tmp_path):
    """Standard Hugging Face fields, a sliding_window no layer uses, DFlash2's keys at their 'off' values and
    block_size / num_target_layers kept in dflash_config (a later layout) all load as the plain draft."""
    d = json.loads(json.dumps(PUBLISHED))
    inert = {"torch_dtype": "bfloat16", "transformers_version": "4.57.1", "use_cache": True, "tie_word_embeddings": False,
             "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 5,
             "layer_types": ["full_attention"] * 5}
    d.update(inert)
    d["dflash_config"].update(selector_rank=0, selector_top_k=0, output_multiplier=1.0, attention_sink_bias=False)
    d["dflash_config"]["block_size"] = d.pop("block_size")
    cfg = DraftConfig.from_dict(d)
    plain = DraftConfig.from_dict(PUBLISHED)
    assert dataclasses.replace(cfg, extra=plain.extra) == plain  # the same draft, inert fields aside
    cfg.save(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert {k: written[k] for k in inert} == inert and written["dflash_config"]["selector_rank"] == 0
    d["dflash_config"]["num_target_layers"] = 40
    with pytest.raises(DraftConfigError, match="num_target_layers is 36 and dflash_config.num_target_layers is 40"):
        DraftConfig.from_dict(d)


def test_target_mismatch_errors_name_the_problem():
    cfg = DraftConfig.from_dict(PUBLISHED)
    with pytest.raises(DraftConfigError, match="hidden_size 4096 does not match the target's 2048"):
        cfg.check_target({**QWEN3_8B, "hidden_size": 2048})
    with pytest.raises(DraftConfigError, match="vocab_size 151936 does not match the target's vocabulary 49152"):
        cfg.check_target({**QWEN3_8B, "vocab_size": 49152})
    with pytest.raises(DraftConfigError, match="built for a 36-layer target, this target has 28"):
        cfg.check_target({**QWEN3_8B, "num_hidden_layers": 28})
    for window in (17, 1):  # the verify window: 2 … block_size tokens
        with pytest.raises(DraftConfigError, match=rf"--speculative-num-draft-tokens {window} \(the tokens verified "
                                                   r"per step\) must be between 2 and the draft's block_size 16"):
            cfg.check_target(QWEN3_8B, num_draft_tokens=window)
    cfg.check_target(QWEN3_8B, num_draft_tokens=4)


def test_path_errors(tmp_path):
    with pytest.raises(DraftConfigError, match="is not a directory"):
        DraftConfig.from_pretrained(tmp_path / "nope")
    with pytest.raises(DraftConfigError, match="has no config.json"):
        DraftConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DraftConfigError, match="is not valid JSON"):
        DraftConfig.from_pretrained(tmp_path)


def _small_cfg(**kw):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=100, block_size=4, num_target_layers=6,
                target_layer_ids=[1, 3], mask_token_id=99)
    base.update(kw)
    return DraftConfig(**base)


def test_save_load_round_trip_and_weight_errors(tmp_path):
    model = DFlashDraftModel.random(_small_cfg(), seed=3)
    model.save_pretrained(tmp_path / "d")
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "d")
    assert loaded.config == model.config
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    names = set(model.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.mlp.gate_proj.weight"} <= names
    assert model.state_dict()["fc.weight"].shape == (64, 2 * 64)
    # a bf16 checkpoint loads in float32 (the server's dtype, whatever the file's)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert next(DFlashDraftModel.from_pretrained(tmp_path / "bf16", dtype=torch.float32).parameters()).dtype == torch.float32

    with pytest.raises(DraftConfigError, match="no \\*.safetensors weights"):
        _small_cfg().save(tmp_path / "noweights")
        DFlashDraftModel.from_pretrained(tmp_path / "noweights")
    _small_cfg(num_hidden_layers=3).save(tmp_path / "d")  # config now claims a third layer
    with pytest.raises(DraftConfigError, match="missing \\['layers.2"):
        DFlashDraftModel.from_pretrained(tmp_path / "d")
    _small_cfg(intermediate_size=96).save(tmp_path / "d")
    with pytest.raises(DraftConfigError, match=r"layers\.0\.mlp\.gate_proj\.weight has shape \(128, 64\), its config implies \(96, 64\)"):
        DFlashDraftModel.from_pretrained(tmp_path / "d")


def test_draft_config_for_target(smollm2_path):
    from transformers import AutoConfig

    t = AutoConfig.from_pretrained(str(smollm2_path))
    cfg = draft_config_for_target(t, num_layers=2, mask_token_id=16, num_features=5)
    assert (cfg.hidden_size, cfg.num_target_layers, cfg.vocab_size) == (576, 30, 49152)
    assert cfg.target_layer_ids == default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert draft_config_for_target(t, num_layers=3, mask_token_id=16).target_layer_ids == [1, 14, 27]
