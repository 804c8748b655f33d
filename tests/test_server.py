"""A real SGLang server on this machine, started by `sglang-dflash serve`, without speculation: the
session's shared reference server (shared_servers.py)."""

import json

import pytest
import torch

from conftest import chat_ids, load_target

pytestmark = pytest.mark.server


def test_cpu_server_float32_equals_hf_greedy(smollm2_path, smol_base_url, prompts, tmp_path):
    """Greedy responses of the server, asked by the training recipe's regeneration (6 prompts at once), are HF
    transformers' own, token for token, in the prompt set's order whatever order they finish in."""
    from sglang_dflash.train.recipe import Recipe, regenerate

    model, tok = load_target(smollm2_path)
    eos = model.generation_config.eos_token_id
    inputs = [chat_ids(tok, p["prompt"]) for p in prompts[:12:2]]  # 6 prompts across the three sets
    refs = [model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=eos,
                           pad_token_id=eos)[0, len(ids):].tolist() for ids in inputs]
    url = smol_base_url
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts[:12:2]))
    recipe = Recipe(target=str(smollm2_path), prompts=[str(tmp_path / "prompts.jsonl")], out=str(tmp_path / "out"),
                    work=str(tmp_path / "work"), max_new_tokens=64, server_url=url, gen_concurrency=6,
                    train_on_evaluation_prompts=True)  # test prompts, on purpose
    rows = regenerate(recipe, tok)
    assert [r["id"] for r in rows] == [str(p["id"]) for p in prompts[:12:2]]
    assert [r["prompt_ids"] for r in rows] == inputs
    for ids, row, ref in zip(inputs, rows, refs):
        assert row["output_ids"] == ref, tok.decode(ids[-20:])
    assert sum(len(r) for r in refs) > 5 * 32  # the prompts really generated text
