import os

import pytest

from sglang_dflash.targets import prepare_target

pytestmark = pytest.mark.unit


def test_smollm2_folder(smollm2_path):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(smollm2_path))
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") == cfg.eos_token_id == 2


def test_tiny_qwen3_folder(tiny_qwen3_path):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(tiny_qwen3_path))
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("qwen3", 4, 256)
    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3_path))
    assert len(tok) == 151669 and tok.convert_tokens_to_ids("<|im_end|>") == 151645
    assert tok.convert_tokens_to_ids("</think>") == 151668
    ids = tok("Hello world, 1234!")["input_ids"]
    assert ids == [9707, 1879, 11, 220, 16, 17, 18, 19, 0]  # the ids Qwen3 gives (digits one by one)
    assert tok.decode(ids) == "Hello world, 1234!"


def test_prepare_is_deterministic_and_a_rerun_is_a_no_op(tiny_qwen3_path, tmp_path):
    before = {f.name: f.stat().st_mtime_ns for f in tiny_qwen3_path.iterdir()}
    assert prepare_target("tiny-qwen3", tiny_qwen3_path) == tiny_qwen3_path
    assert {f.name: f.stat().st_mtime_ns for f in tiny_qwen3_path.iterdir()} == before
    fresh = prepare_target("tiny-qwen3", tmp_path / "again")
    a = (tiny_qwen3_path / "model.safetensors").read_bytes()
    assert a == (fresh / "model.safetensors").read_bytes()
    assert not any(p.name.startswith("again.tmp") for p in tmp_path.iterdir())
    assert os.path.exists(fresh / "tokenizer.json")
