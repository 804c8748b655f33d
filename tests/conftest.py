"""Shared fixtures: offline target models (cached outside the repository), prompts, drafts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sglang_dflash.cpu.runtime import cache_dir, mkl_mode
from sglang_dflash.targets import prepare_target
from sglang_dflash.train.data import chat_ids  # noqa: F401  (the tests tokenize prompts as training does)

mkl_mode(os.environ)  # as the CLI sets it for itself and its servers: before this process's first product

DATA = Path(__file__).parent / "data"
# Block ids for random drafts: SmolLM2 has no unused embedding row, so its drafts use
# a special token that chat text never contains (16 = "<empty_output>"); Qwen3's
# mask is the first row after its special tokens, as in the published drafts.
MASK_TOKEN = {"smollm2": 16, "tiny-qwen3": 151669}
# Feature layers of 2-layer random drafts: the default rule for SmolLM2's 30 layers ([1, 27]);
# the 4-layer tiny Qwen3 is too shallow for the rule.
LAYER_IDS = {"smollm2": None, "tiny-qwen3": [1, 2]}


# The suite's tiers, in the order they run. Every test has exactly one: its module's `pytestmark` or,
# in a module of mixed tiers, its own marker. `bash launch/test.sh` runs them all (CI);
# `bash launch/test.sh unit` is the quick loop.
TIERS = {
    "unit": "in-process tests: no server, no training loop, no child process (the quick loop, under 3 minutes)",
    "process": "child processes without a server: TP ranks over gloo, Triton's interpreter, a fresh interpreter",
    "train": "runs of the training recipe and of the Transformers backend's generation loop",
    "server": "real SGLang servers on this machine",
    "stats": "the statistical tier: thousands of samples tested against the target's exact distribution",
}
pytest_plugins = ["shared_servers"]  # the SmolLM2 servers the session shares


def pytest_configure(config):
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def tier(item) -> str:
    names = {m.name for m in item.iter_markers() if m.name in TIERS}
    if len(names) != 1:
        raise pytest.UsageError(f"{item.nodeid} needs exactly one tier marker of {list(TIERS)}, has {sorted(names)}")
    return names.pop()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test in one tier; the tiers run in TIERS' order (module order kept within a tier)."""
    order = list(TIERS)
    items.sort(key=lambda item: order.index(tier(item)))


def random_draft(target_config, name: str, seed: int = 0):
    """A random 2-layer draft of block 16 for the target `name` (its config: a transformers config)."""
    from sglang_dflash.config import draft_config_for_target
    from sglang_dflash.models.reference import DFlashDraftModel

    cfg = draft_config_for_target(target_config, num_layers=2, block_size=16, mask_token_id=MASK_TOKEN[name],
                                  target_layer_ids=LAYER_IDS[name])
    return DFlashDraftModel.random(cfg, seed=seed)


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
    from sglang_dflash.train.data import read_jsonl

    return read_jsonl(DATA / "prompts.jsonl")


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
