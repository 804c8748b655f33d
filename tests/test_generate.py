"""The Transformers backend against HF transformers' own greedy generation (float32)."""

from __future__ import annotations

import pytest
import torch

import sglang_dflash.generate as gen
from sglang_dflash.generate import spec_generate
from sglang_dflash.models.reference import DFlashDraftModel

from conftest import chat_ids, random_draft
from shared_servers import TRAINED_DRAFT

pytestmark = pytest.mark.train

NEW_TOKENS = 128
_refs: dict = {}


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


def serving_draft(model, name):
    """SmolLM2: the shipped trained draft (accept lengths of every size); tiny Qwen3: a random one."""
    if name == "smollm2":
        return DFlashDraftModel.from_pretrained(TRAINED_DRAFT, dtype=torch.float32)
    return random_draft(model.config, name)


REFERENCE_PROMPTS = (0, 4, 5, 8)  # tests/data/prompts.jsonl: gsm8k_test, two HumanEval (long code), mt_bench


def references(target, prompts):
    """HF greedy continuations (stopping at the model's EOS) of REFERENCE_PROMPTS, computed once."""
    name, model, tok = target
    if name not in _refs:
        eos = model.generation_config.eos_token_id
        rows = []
        for p in [prompts[i] for i in REFERENCE_PROMPTS]:
            ids = chat_ids(tok, p["prompt"])
            rows.append((ids, hf_greedy(model, ids, NEW_TOKENS, eos)))
        _refs[name] = rows
    return _refs[name]


def test_draft_is_lossless(target, prompts):
    name, model, tok = target
    draft = serving_draft(model, name)
    eos = model.generation_config.eos_token_id
    for ids, ref in references(target, prompts):
        out = spec_generate(model, draft, torch.tensor(ids), max_new_tokens=NEW_TOKENS, stop_token_ids=[eos])
        assert out.tokens == ref, f"{name}: first difference at {next(i for i, (a, b) in enumerate(zip(out.tokens + [-1], ref + [-2])) if a != b)}"
        assert sum(out.accept_lengths) + 1 >= len(out.tokens)
        assert all(1 <= n <= draft.config.block_size for n in out.accept_lengths)


def oracle(full: list[int]):
    """A draft_block stand-in that proposes the target's own greedy continuation `full` (prompt + output)."""
    def draft_block(draft, target, block_ids, positions, context, temperature, generator=None):
        pos = positions[0, 1:].tolist()
        return torch.tensor([[full[p] if p < len(full) else 0 for p in pos]]), None
    return draft_block


def long_reference(target, prompts):
    """A prompt whose reference output runs the whole NEW_TOKENS without stopping."""
    name, model, tok = target
    for ids, ref in references(target, prompts):
        if len(ref) == NEW_TOKENS and model.generation_config.eos_token_id not in ref:
            return ids, ref
    pytest.fail(f"{name}: no reference output of full length")


def test_oracle_draft_accepts_whole_blocks(target, prompts, monkeypatch):
    name, model, tok = target
    ids, ref = long_reference(target, prompts)
    draft = random_draft(model.config, name)
    monkeypatch.setattr(gen, "draft_block", oracle(ids + ref))
    out = spec_generate(model, draft, torch.tensor(ids), max_new_tokens=100)  # not a multiple of 16
    assert out.tokens == ref[:100]
    B = draft.config.block_size
    assert out.accept_lengths == [B] * 7  # 1 token from prefill + 7 steps of 16 >= 100
    assert out.tau == B


@pytest.mark.parametrize("use_oracle", [False, True])
def test_stop_token_inside_a_block(target, prompts, monkeypatch, use_oracle):
    name, model, tok = target
    ids, ref = long_reference(target, prompts)
    # a token that first appears mid-block (with the oracle, blocks cover outputs 1-16, 17-32, …)
    k = next(k for k in range(20, NEW_TOKENS) if k % 16 not in (0, 1) and ref[k] not in ref[:k])
    stop = ref[k]
    expected = hf_greedy(model, ids, NEW_TOKENS, eos=stop)
    assert expected == ref[:k + 1]
    draft = random_draft(model.config, name)
    if use_oracle:
        monkeypatch.setattr(gen, "draft_block", oracle(ids + ref))
    out = spec_generate(model, draft, torch.tensor(ids), max_new_tokens=NEW_TOKENS, stop_token_ids=[stop])
    assert out.tokens == expected
    if use_oracle:
        assert out.accept_lengths[-1] == draft.config.block_size  # the stop fell inside an accepted block


def test_max_new_tokens_exact(target, prompts):
    name, model, tok = target
    ids, ref = long_reference(target, prompts)
    draft = random_draft(model.config, name)
    for n in (1, 2, 17, 37):
        assert spec_generate(model, draft, torch.tensor(ids), max_new_tokens=n).tokens == ref[:n]
