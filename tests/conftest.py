"""Shared fixtures: offline target models (cached outside the repository), prompts, drafts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sglang_dflash.cpu.runtime import cache_dir
from sglang_dflash.targets import prepare_target
from sglang_dflash.train.data import chat_ids  # noqa: F401  (the tests tokenize prompts as training does)

DATA = Path(__file__).parent / "data"
# Block ids for random drafts: SmolLM2 has no unused embedding row, so its drafts use
# a special token that chat text never contains (16 = "<empty_output>"); Qwen3's
# mask is the first row after its special tokens, as in the published drafts.
MASK_TOKEN = {"smollm2": 16, "tiny-qwen3": 151669}
# Feature layers of 2-layer random drafts: the default rule for SmolLM2's 30 layers ([1, 27]);
# the 4-layer tiny Qwen3 is too shallow for the rule.
LAYER_IDS = {"smollm2": None, "tiny-qwen3": [1, 2]}


def fixture_dir() -> Path:
    return cache_dir() / "fixtures"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return prepare_target("smollm2", fixture_dir() / "smollm2")


@pytest.fixture(scope="session")
def tiny_qwen3_path() -> Path:
    return prepare_target("tiny-qwen3", fixture_dir() / "tiny-qwen3")


@pytest.fixture(scope="session")
def prompts() -> list[dict]:
    return [json.loads(line) for line in (DATA / "prompts.jsonl").read_text().splitlines()]


def load_target(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    return model, tok


@pytest.fixture(scope="session", params=["smollm2", "tiny-qwen3"])
def target(request):
    """(name, HF float32 model, tokenizer) for each offline target."""
    path = request.getfixturevalue("smollm2_path" if request.param == "smollm2" else "tiny_qwen3_path")
    model, tok = load_target(path)
    return request.param, model, tok
