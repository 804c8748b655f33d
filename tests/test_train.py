"""The training recipe: the objective's pieces against brute-force definitions, and short real runs."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from sglang_dflash.train.objective import (IGNORE, block_inputs, teacher_forced_accepts, training_block_mask,
                                           position_weights, sample_anchors)



@pytest.mark.unit
@pytest.mark.parametrize("seed", range(5))
def test_mask_equals_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    T = int(torch.randint(5, 60, (1,), generator=gen))
    P = int(torch.randint(1, T - 2, (1,), generator=gen))
    B = int(torch.randint(2, 9, (1,), generator=gen))
    anchors = sample_anchors(P, T, 7, gen)
    assert anchors.numel() == min(7, T - 1 - P) and (anchors >= P).all() and (anchors <= T - 2).all()
    mask = training_block_mask(anchors, T, B)
    N = anchors.numel()
    assert mask.shape == (N * B, T + N * B)
    for q in range(N * B):
        j = q // B
        for key in range(T + N * B):
            if key < T:
                want = key < anchors[j]  # context strictly before the anchor
            else:
                want = (key - T) // B == j  # its own block, both directions; never another block
            assert bool(mask[q, key]) == want, (q, key)


@pytest.mark.unit
def test_block_inputs_and_labels():
    tokens = torch.arange(100, 120)  # T = 20
    ids, pos, labels = block_inputs(tokens, torch.tensor([3, 15]), block_size=8, mask_token_id=7)
    assert ids[0].tolist() == [103] + [7] * 7 and ids[1, 0] == 115
    assert pos[1].tolist() == list(range(15, 23))
    assert labels[0].tolist() == [IGNORE] + list(range(104, 111))
    assert labels[1].tolist() == [IGNORE, 116, 117, 118, 119] + [IGNORE] * 3  # past the end of the sequence


@pytest.mark.unit
def test_position_weights():
    w = position_weights(16, gamma=7.0)
    assert w[0] == 0 and w[1] == 1
    for k in range(2, 16):
        assert math.isclose(w[k].item(), math.exp(-(k - 1) / 7), rel_tol=1e-6)


@pytest.mark.unit
def test_teacher_forced_accepts():
    labels = torch.tensor([[IGNORE, 1, 2, 3, 4], [IGNORE, 1, 2, 3, 4], [IGNORE, 1, 2, IGNORE, IGNORE]])
    pred = torch.tensor([[9, 1, 2, 0, 4], [9, 0, 2, 3, 4], [9, 1, 2, 3, 4]])
    assert teacher_forced_accepts(pred, labels).tolist() == [2, 0, 2]


@pytest.mark.train
def test_batched_greedy_equals_transformers_generate(tiny_qwen3_path, prompts):
    """Left-padded prompts of different lengths, rows that stop at different steps (so finished rows are
    dropped from the batch mid-way) and rows that run to max_new_tokens: each output equals Transformers'
    own greedy generate() of that prompt alone, through its first stop token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_dflash.train.batched_greedy import greedy_batch
    from sglang_dflash.train.data import chat_ids

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path, dtype=torch.float32).eval()
    ids = [chat_ids(tok, p["prompt"])[: 20 + 7 * i] for i, p in enumerate(prompts[:8])]
    assert len({len(x) for x in ids}) > 4  # really different widths

    def alone(x, n, stops):
        with torch.no_grad():
            g = model.generate(torch.tensor([x]), attention_mask=torch.ones(1, len(x), dtype=torch.long),
                               max_new_tokens=n, do_sample=False, eos_token_id=stops or None, pad_token_id=0)
        g = g[0, len(x):].tolist()
        return g[: next((i + 1 for i, t in enumerate(g) if t in stops), len(g))]

    free = [alone(x, 24, []) for x in ids]
    stops = [free[0][2], free[3][9], free[5][15]]  # tokens that end some rows early
    want = [alone(x, 24, stops) for x in ids]
    lengths = sorted(map(len, want))
    assert lengths[0] < 24 and lengths[-1] == 24 and len(set(lengths)) > 2, lengths
    assert greedy_batch(model, ids, 24, stops, pad=0) == want
    assert greedy_batch(model, ids, 24, [], pad=0) == free


@pytest.mark.train
def test_batched_greedy_captures_what_a_second_pass_computes(tiny_qwen3_path, prompts):
    """capture: the features that come out of the generating forwards (prompt rows from the prefill, one row per
    output token, rows dropped mid-way, rows that stop early and rows that run to max_new_tokens) are, for every
    prompt, the target's own states over prompt + output in one plain forward (to the bf16 they are stored in)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_dflash.generate import target_features
    from sglang_dflash.train.batched_greedy import greedy_batch
    from sglang_dflash.train.data import chat_ids

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path, dtype=torch.float32).eval()
    ids = [chat_ids(tok, p["prompt"])[: 20 + 7 * i] for i, p in enumerate(prompts[:8])]
    free = greedy_batch(model, ids, 24, [], pad=0)
    stops = [free[0][2], free[3][9], free[5][15]]
    plain = greedy_batch(model, ids, 24, stops, pad=0)
    outputs, features = greedy_batch(model, ids, 24, stops, pad=0, capture=[0, 2])
    assert outputs == plain and len({len(g) for g in outputs}) > 2
    for x, g, (ctx, fin) in zip(ids, outputs, features):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([x + g]), output_hidden_states=True)
        for got, want in ((ctx, target_features(out.hidden_states, [0, 2])[0]), (fin, out.hidden_states[-1][0])):
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            # both rounded to bf16: at most one bf16 step (2^-8 relative) apart
            torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=8e-3,
                                       atol=1e-3 * want.abs().max().item())


@pytest.mark.train
def test_feature_cache_takes_the_captured_features(tiny_qwen3_path, tmp_path):
    """build_feature_cache uses the features saved by the regeneration (captured/) for the responses that have
    them, runs the target for the others, removes captured/ when done, and refuses captured features whose tokens
    are not the response's."""
    from transformers import AutoModelForCausalLM

    from sglang_dflash.generate import target_features
    from sglang_dflash.train.features import build_feature_cache, save_captured

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path, dtype=torch.float32).eval()
    rows = [{"id": "a", "prompt_ids": [5, 6, 7], "output_ids": [8, 9]},
            {"id": "b", "prompt_ids": [11, 12], "output_ids": [13, 14, 15]}]
    F, H = 2 * model.config.hidden_size, model.config.hidden_size
    marked = (torch.full((5, F), 3.0), torch.full((5, H), -2.0))  # no forward gives these
    save_captured(tmp_path / "f", rows[:1], [marked])
    seqs = build_feature_cache(model, rows, [0, 1], tmp_path / "f", progress=False).load()
    assert not (tmp_path / "f" / "captured").exists()
    assert torch.equal(seqs[0].context.float(), marked[0]) and torch.equal(seqs[0].final.float(), marked[1])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[11, 12, 13, 14, 15]]), output_hidden_states=True)
    assert torch.equal(seqs[1].context, target_features(out.hidden_states, [0, 1])[0].to(torch.bfloat16))
    assert seqs[1].tokens.tolist() == [11, 12, 13, 14, 15] and seqs[1].prompt_len == 2

    save_captured(tmp_path / "g", [dict(rows[0], output_ids=[8, 10])], [marked])
    with pytest.raises(ValueError, match="captured features of 'a' are for other tokens"):
        build_feature_cache(model, rows, [0, 1], tmp_path / "g", progress=False)


@pytest.mark.train
def test_the_feature_cache_cuts_long_sequences_and_says_so(tiny_qwen3_path, tmp_path, caplog):
    """A sequence longer than max_len is kept to its first max_len tokens (tokens and features alike), and the
    log says how many were cut."""
    import logging

    from transformers import AutoModelForCausalLM

    from sglang_dflash.train.features import build_feature_cache

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path, dtype=torch.float32).eval()
    rows = [{"id": "a", "prompt_ids": [5, 6, 7], "output_ids": [8, 9]}, {"id": "b", "prompt_ids": [11], "output_ids": [13]}]
    with caplog.at_level(logging.WARNING):
        seqs = build_feature_cache(model, rows, [0, 1], tmp_path / "f", max_len=4, progress=False).load()
    assert seqs[0].tokens.tolist() == [5, 6, 7, 8] and seqs[0].context.shape[0] == seqs[0].final.shape[0] == 4
    assert seqs[1].tokens.tolist() == [11, 13]
    assert "1 of the 2 sequences built now are longer than 4 tokens and were cut to their first 4" in caplog.text


@pytest.mark.train
def test_a_cache_of_more_layers_serves_a_draft_of_fewer(tiny_qwen3_path, tmp_path):
    """A feature folder made (or captured) with the states of more target layers than a draft uses keeps
    them when the recipe asks for a subset, and load(layer_ids) gives that subset's columns, in the draft's
    order; a layer the folder lacks is refused by name, and so are captured features of another width."""
    from transformers import AutoModelForCausalLM

    from sglang_dflash.generate import target_features
    from sglang_dflash.train.features import FeatureCache, build_feature_cache, save_captured, stored_layers

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path, dtype=torch.float32).eval()
    rows = [{"id": "a", "prompt_ids": [5, 6, 7], "output_ids": [8, 9]}]
    build_feature_cache(model, rows, [0, 1], tmp_path / "f", progress=False)
    assert stored_layers(tmp_path / "f", [1]) == [0, 1]
    cache = build_feature_cache(model, rows, [1], tmp_path / "f", progress=False)  # kept, not rebuilt
    assert cache.layer_ids == [0, 1]
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), output_hidden_states=True).hidden_states
    for ids in ([0, 1], [1], [1, 0]):
        got = FeatureCache(tmp_path / "f").load(ids)[0].context
        assert torch.equal(got, target_features(hidden, ids)[0].to(torch.bfloat16)), ids
    with pytest.raises(ValueError, match=r"holds the states of target layers \[0, 1\], not of all of \[2\]"):
        FeatureCache(tmp_path / "f").load([2])
    with pytest.raises(ValueError, match="use another work folder"):
        build_feature_cache(model, rows, [1, 2], tmp_path / "f", progress=False)

    H = model.config.hidden_size
    save_captured(tmp_path / "g", rows, [(torch.zeros(5, 3 * H), torch.zeros(5, H))])
    with pytest.raises(ValueError, match=r"captured features of 'a' hold 3 layers, the cache 2 \(\[0, 1\]\)"):
        build_feature_cache(model, rows, [0, 1], tmp_path / "g", progress=False)


@pytest.mark.unit
def test_number_variants():
    """prompt-variants: every whole number of 2 and up becomes another near it, nothing else changes (decimals,
    ordinals, words, thousands separators kept); a prompt without such a number gives no variant; the same seed
    gives the same prompts."""
    import re

    from sglang_dflash.train.data import number_variants

    rows = [{"id": "a", "prompt": "Sam has 48 clips, sells 12 at $1,250 each, 2.5 kg, 3rd place, 100% and 1 pear."},
            {"id": "b", "prompt": "Ten apples and one pear."}]
    variants = number_variants(rows, copies=3, seed=7)
    assert [v["id"] for v in variants] == ["a-v1", "a-v2", "a-v3"]
    assert variants == number_variants(rows, copies=3, seed=7) != number_variants(rows, copies=3, seed=8)
    pattern = r"Sam has (\d+) clips, sells (\d+) at \$([\d,]+) each, 2\.5 kg, 3rd place, (\d+)% and 1 pear\."
    for v in variants:
        got = re.fullmatch(pattern, v["prompt"])
        assert got, v["prompt"]
        for new, old in zip(got.groups(), (48, 12, 1250, 100)):
            assert int(new.replace(",", "")) != old and old // 2 <= int(new.replace(",", "")) <= old * 3 // 2
            assert new == f"{int(new.replace(',', '')):,}"  # a separator where the number has thousands


@pytest.mark.unit
def test_jsonl_lines_end_at_newlines_only(tmp_path):
    """A JSON string may hold U+2028, U+2029, U+0085, form feeds (gsm8k_train's row 2381 holds U+2028): they
    are not line ends, as str.splitlines() takes them; a line that is not JSON is named by its number."""
    from sglang_dflash.train.data import read_jsonl, read_prompts

    texts = ["a\u2028b", "c\u2029d", "e\x85f\x0cg\x0bh\x1ci", "plain"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "prompt": t}, ensure_ascii=False) + "\n"
                            for i, t in enumerate(texts)) + "\n", encoding="utf-8")
    assert [r["prompt"] for r in read_jsonl(path)] == texts
    assert read_prompts(path, limit=2) == [{"id": "0", "prompt": texts[0]}, {"id": "1", "prompt": texts[1]}]
    path.write_text(path.read_text(encoding="utf-8") + "{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"p\.jsonl:6: not JSON"):
        read_jsonl(path)


@pytest.mark.unit
def test_a_rewritten_shard_leaves_its_hard_links_alone(tmp_path):
    """A stage's work folder starts with hard links to the stage before's shards; rebuilding a shard there (the
    last one, when the prompt count grows past it) must not change the earlier folder's copy."""
    import os

    from safetensors.torch import load_file

    from sglang_dflash.train.features import save_shard

    row = lambda n, value: ([1] * n, 1, torch.full((n, 6), value), torch.full((n, 3), value))  # noqa: E731
    save_shard(tmp_path / "old.safetensors", ["a"], [row(4, 1.0)])
    os.link(tmp_path / "old.safetensors", tmp_path / "new.safetensors")
    os.link(tmp_path / "old.json", tmp_path / "new.json")
    save_shard(tmp_path / "new.safetensors", ["a", "b"], [row(4, 1.0), row(2, 2.0)])
    assert json.loads((tmp_path / "old.json").read_text())["ids"] == ["a"]
    assert load_file(str(tmp_path / "old.safetensors"))["tokens"].numel() == 4
    assert json.loads((tmp_path / "new.json").read_text())["ids"] == ["a", "b"]
    assert load_file(str(tmp_path / "new.safetensors"))["tokens"].numel() == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json", "new.safetensors", "old.json", "old.safetensors"]


@pytest.mark.unit
def test_mapped_safetensors_equals_load_file(tmp_path):
    """The feature cache maps its shards instead of reading them (a cache larger than memory trains): every
    tensor equals safetensors' own reading, of every dtype the shards and a checkpoint hold, and writing to a
    mapped tensor leaves the file as it was."""
    from safetensors.torch import load_file, save_file

    from sglang_dflash.train.features import mapped_safetensors

    gen = torch.Generator().manual_seed(0)
    tensors = {"a_bf16": torch.randn(7, 5, generator=gen).bfloat16(), "b_i32": torch.arange(3, dtype=torch.int32),
               "c_i64": torch.arange(5), "d_f32": torch.randn(2, 3, 4, generator=gen),
               "e_f16": torch.randn(3, generator=gen).half(), "f_u8": torch.arange(11, dtype=torch.uint8)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"note": "kept"})
    got, want = mapped_safetensors(tmp_path / "x.safetensors"), load_file(str(tmp_path / "x.safetensors"))
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    got["d_f32"][0] = 99.0
    assert torch.equal(load_file(str(tmp_path / "x.safetensors"))["d_f32"], tensors["d_f32"])


@pytest.fixture(scope="module")
def tiny_run(tiny_qwen3_path, prompts, tmp_path_factory):
    """A short real recipe run on tiny-qwen3 (Transformers regeneration, float32 features), paused halfway
    and resumed, next to an uninterrupted run of the same length."""
    from sglang_dflash.train.recipe import Recipe, run
    from sglang_dflash.train.trainer import FitConfig

    base = tmp_path_factory.mktemp("train")
    file = base / "prompts.jsonl"
    file.write_text("".join(json.dumps({"id": str(i), "prompt": p["prompt"]}) + "\n" for i, p in enumerate(prompts[:12])))

    def recipe(name, **fit):
        cfg = FitConfig(steps=600, seqs_per_step=2, blocks_per_seq=8, lr=2e-3, warmup=10, heldout=0, eval_every=1000,
                        save_every=1000, **fit)
        return Recipe(target=str(tiny_qwen3_path), prompts=[str(file)], out=str(base / name), work=str(base / ("work-" + name)),
                      max_new_tokens=48, generator="hf", gen_dtype="float32", feature_dtype="float32", num_layers=1, block_size=8,
                      mask_token_id=151669, target_layer_ids=[1, 2], init="random", fit=cfg,
                      train_on_evaluation_prompts=True)  # test prompts, on purpose

    straight = recipe("straight")
    paused = recipe("paused", stop_at=300)
    first = run(paused)
    paused_card = (base / "paused" / "TRAINING.json").exists()  # written only when a run finishes
    # the responses and features are cached; the resumed run reuses the same folder, the straight run a copy
    # (the paused run captured its features while regenerating; a second pass would round a few differently)
    shutil.copytree(base / "work-paused" / "features", base / "work-straight" / "features")
    (base / "work-straight" / "responses.jsonl").write_text((base / "work-paused" / "responses.jsonl").read_text())
    run_straight = run(straight)
    paused.fit.stop_at = 0
    resumed = run(paused)
    return dict(base=base, file=file, first=first, straight=run_straight, resumed=resumed, recipe=straight,
                paused_card=paused_card)


@pytest.mark.train
def test_training_lowers_the_loss_and_raises_tau(tiny_run, tiny_qwen3_path):
    from sglang_dflash.models.reference import DFlashDraftModel
    from sglang_dflash.train.data import read_prompts
    from sglang_dflash.train.evaluate import eval_draft
    from sglang_dflash.train.recipe import load_target

    log = [json.loads(line) for line in (tiny_run["base"] / "work-straight" / "log.jsonl").read_text().splitlines()]
    first, last = sum(m["loss"] for m in log[:10]) / 10, sum(m["loss"] for m in log[-10:]) / 10
    print(f"loss {first:.2f} (first 10 steps) -> {last:.2f} (last 10)")
    assert last < 0.5 * first, (first, last)
    target, tok = load_target(str(tiny_qwen3_path), torch.float32)
    trained = DFlashDraftModel.from_pretrained(tiny_run["base"] / "straight", dtype=torch.float32)
    untrained = DFlashDraftModel.random(trained.config, seed=0)
    prompts = read_prompts(tiny_run["file"], 6)
    after = eval_draft(target, tok, trained, prompts, max_new_tokens=48, progress=False)
    before = eval_draft(target, tok, untrained, prompts, max_new_tokens=48, progress=False)
    print(f"tiny-qwen3 on its own prompts: τ {before['tau']:.2f} untrained -> {after['tau']:.2f} trained")
    assert after["tau"] > before["tau"] + 0.5
    assert len(after["accept_rate_by_row"]) == 7 and after["accept_rate_by_row"] == sorted(after["accept_rate_by_row"], reverse=True)


@pytest.mark.train
def test_replayed_acceptance_equals_real_decoding(tiny_run, tiny_qwen3_path, tmp_path):
    """eval-draft's replay (greedy steps replayed from the target's batched greedy continuation) gives,
    prompt by prompt, the tokens and verify steps of real speculative decoding, with a half-trained draft
    (150 steps) whose steps accept anything from none to a whole block (the fully trained one accepts
    whole blocks only)."""
    from sglang_dflash.models.reference import DFlashDraftModel
    from sglang_dflash.train import trainer
    from sglang_dflash.train.data import read_prompts
    from sglang_dflash.train.evaluate import eval_draft
    from sglang_dflash.train.features import FeatureCache
    from sglang_dflash.train.recipe import load_target

    target, tok = load_target(str(tiny_qwen3_path), torch.float32)
    seqs = FeatureCache(tiny_run["base"] / "work-straight" / "features").load()
    cfg = DFlashDraftModel.from_pretrained(tiny_run["base"] / "straight").config
    frozen = trainer.Frozen(target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                            trainer.training_vocab(seqs, cfg.vocab_size))
    draft = DFlashDraftModel.random(cfg, seed=0)
    trainer.fit(draft, frozen, seqs, trainer.FitConfig(steps=600, stop_at=150, seqs_per_step=2, blocks_per_seq=8, lr=2e-3,
                                                        warmup=10, heldout=0, save_every=1000), tmp_path / "work",
                tmp_path / "out", progress=False)
    prompts = read_prompts(tiny_run["file"], 8)
    decode = eval_draft(target, tok, draft, prompts, max_new_tokens=40, progress=False, method="decode")
    replay = eval_draft(target, tok, draft, prompts, max_new_tokens=40, progress=False, method="replay")
    print(f"τ decode {decode['tau']:.3f}, replay {replay['tau']:.3f}; acceptance by row {decode['accept_rate_by_row']}")
    assert 1.2 < decode["tau"] < 6 and 0 < decode["accept_rate_by_row"][2] < decode["accept_rate_by_row"][0] < 1
    assert replay["per_prompt"] == decode["per_prompt"]
    assert replay["accept_rate_by_row"] == decode["accept_rate_by_row"]
    with pytest.raises(ValueError, match="greedy acceptance only"):
        eval_draft(target, tok, draft, prompts, method="replay", temperature=1.0)
    # several drafts walk the same continuations, made once: each gives what it gives alone. This one with a smaller
    # block (its weights) walks the longer continuation the larger block needs, the same up to float rounding; a
    # random one reading three target layers gets features of its own
    import dataclasses

    from sglang_dflash.train.evaluate import eval_drafts

    small = DFlashDraftModel.random(dataclasses.replace(cfg, block_size=4), seed=1)
    small.load_state_dict(draft.state_dict())
    wide = DFlashDraftModel.random(dataclasses.replace(cfg, target_layer_ids=[0, 1, 2]), seed=1)
    assert cfg.block_size > 4 and len(cfg.target_layer_ids) == 2
    together = eval_drafts(target, tok, [small, draft, wide], prompts, max_new_tokens=40, progress=False,
                           method="replay")
    assert together[1] == replay
    for d, got in ((small, together[0]), (wide, together[2])):
        alone = eval_draft(target, tok, d, prompts, max_new_tokens=40, progress=False, method="replay")
        assert sum(a == b for a, b in zip(got["per_prompt"], alone["per_prompt"])) >= 7, (got, alone)
        assert abs(got["tau"] - alone["tau"]) < 0.05 and len(got["accept_rate_by_row"]) == d.config.block_size - 1
    assert together[0]["tau"] > 1.2  # the smaller block's walks accept drafts: they were compared, not trivial

    # the trainer's held-out figure: the same walk over the cached (bf16) features, up to block_size - 1 tokens
    # before each response's end; equal to the walk over the target's own float32 features but for rounding
    from sglang_dflash.train.evaluate import replay_steps

    B = cfg.block_size
    cached, fresh = [], []
    for seq in seqs[:8]:
        length = seq.tokens.numel() - seq.prompt_len - (B - 1)
        cached.append(evaluate_walk(draft, frozen, seq, length))
        fresh.append(replay_steps(target, draft, seq.tokens, seq.prompt_len, length))
    print("held-out walk over cached features:", cached)
    assert sum(a == b for a, b in zip(cached, fresh)) >= 6
    # the lockstep walk (eval-draft's replay runs it) is the walks one by one
    from sglang_dflash.train.evaluate import replay_walks

    together = replay_walks(draft, lambda ids: frozen.embed[ids], frozen.head, [s.tokens for s in seqs[:8]],
                            [s.context for s in seqs[:8]], [s.prompt_len for s in seqs[:8]],
                            [s.tokens.numel() - s.prompt_len - (B - 1) for s in seqs[:8]])
    assert together == cached
    assert math.isclose(trainer.heldout_decoding_tau(draft, frozen, seqs[:8], "cpu"),
                        sum(map(sum, cached)) / sum(map(len, cached)))


def evaluate_walk(draft, frozen, seq, length):
    """The walk over one sequence alone."""
    from sglang_dflash.train.evaluate import replay_walks

    return replay_walks(draft, lambda ids: frozen.embed[ids], frozen.head, [seq.tokens], [seq.context], [seq.prompt_len],
                        [length])[0]


@pytest.mark.train
def test_a_resumed_run_continues_where_it_paused(tiny_run):
    assert tiny_run["first"]["step"] == 300 and tiny_run["resumed"]["step"] == 600
    assert not tiny_run["paused_card"] and (tiny_run["base"] / "paused" / "TRAINING.json").exists()
    a = (tiny_run["base"] / "straight" / "model.safetensors").read_bytes()
    b = (tiny_run["base"] / "paused" / "model.safetensors").read_bytes()
    assert a == b, "pausing at step 300 and resuming did not give the uninterrupted run's weights"


@pytest.mark.train
def test_trained_checkpoint_loads_in_the_serving_path(tiny_run, tiny_qwen3_path):
    from safetensors.torch import load_file

    from sglang_dflash.config import load_checked
    from sglang_dflash.models.paged import PagedDraft
    from sglang_dflash.models.reference import DFlashDraftModel

    out = tiny_run["base"] / "straight"
    cfg = load_checked(out, tiny_qwen3_path, num_draft_tokens=8)
    assert cfg.block_size == 8 and cfg.target_layer_ids == [1, 2] and cfg.mask_token_id == 151669
    weights = load_file(str(out / "model.safetensors"))
    assert not any("embed" in k or "lm_head" in k for k in weights), "the frozen target parts must not be saved"
    model = DFlashDraftModel.from_pretrained(out, dtype=torch.float32)
    PagedDraft(model, num_slots=64, device="cpu", dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


@pytest.mark.train
def test_a_run_continues_from_an_earlier_draft(tiny_run):
    """--init DRAFT: a new run (its own work folder, here a schedule of 20 steps) starts from an earlier run's
    exported weights, so its first steps already have that run's low loss; a draft of another architecture, or
    a path that is no draft, is refused by name."""
    import dataclasses

    from sglang_dflash.train.recipe import run

    earlier = tiny_run["base"] / "straight"
    (tiny_run["base"] / "work-continued").mkdir()
    (tiny_run["base"] / "work-continued" / "responses.jsonl").write_text(
        (tiny_run["base"] / "work-straight" / "responses.jsonl").read_text())
    base = tiny_run["recipe"]
    continued = dataclasses.replace(base, out=str(tiny_run["base"] / "continued"),
                                    work=str(tiny_run["base"] / "work-continued"), init=str(earlier),
                                    fit=dataclasses.replace(base.fit, steps=20, warmup=1, lr=1e-5))
    run(continued)
    log = lambda name: [json.loads(line)["loss"] for line in (tiny_run["base"] / name / "log.jsonl").read_text().splitlines()]
    scratch, again = log("work-straight"), log("work-continued")
    print(f"first-step loss: {scratch[0]:.2f} from random weights, {again[0]:.2f} from the earlier draft "
          f"(which ended at {sum(scratch[-10:]) / 10:.2f})")
    assert again[0] < 2 * sum(scratch[-10:]) / 10 < 0.5 * scratch[0]

    deeper = dataclasses.replace(continued, num_layers=2, work=str(tiny_run["base"] / "work-deeper"))
    with pytest.raises(ValueError, match="architecture differs.*num_hidden_layers"):
        run(deeper)
    with pytest.raises(ValueError, match="neither 'target', 'random' nor a draft folder"):
        run(dataclasses.replace(continued, init=str(tiny_run["base"] / "no-such-draft"),
                                work=str(tiny_run["base"] / "work-nodraft")))


@pytest.mark.train
def test_the_export_is_the_best_heldout_step(tiny_run, tiny_qwen3_path, tmp_path, monkeypatch):
    """With held-out sequences, the published-format draft is the weights of the step with the best held-out
    decoding τ, not the last step's (a long run on little data overfits). The held-out figures are scripted
    here (tiny-qwen3's random text does not generalise to unseen sequences, so its real figure stays 1.0)."""
    from safetensors.torch import load_file

    from sglang_dflash.models.reference import DFlashDraftModel
    from sglang_dflash.train import trainer
    from sglang_dflash.train.features import FeatureCache
    from sglang_dflash.train.recipe import load_target

    seqs = FeatureCache(tiny_run["base"] / "work-straight" / "features").load()
    target, _ = load_target(str(tiny_qwen3_path), torch.float32)
    cfg = DFlashDraftModel.from_pretrained(tiny_run["base"] / "straight").config
    frozen = trainer.Frozen(target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                            trainer.training_vocab(seqs, cfg.vocab_size))
    figures = iter([1.2, 1.5, 1.4, 1.5, 1.1])  # the best first reached at the second evaluation (step 20)
    snapshots = {}

    def scripted(draft, *args, **kwargs):
        snapshots[len(snapshots) * 10 + 10] = {k: v.detach().to(torch.bfloat16).clone() for k, v in draft.state_dict().items()}
        return next(figures)

    monkeypatch.setattr(trainer, "heldout_decoding_tau", scripted)
    fit_cfg = trainer.FitConfig(steps=50, seqs_per_step=2, blocks_per_seq=8, lr=2e-3, warmup=5, heldout=3, eval_every=10,
                                save_every=25)
    trainer.fit(DFlashDraftModel.random(cfg, seed=0), frozen, seqs, fit_cfg, tmp_path / "work", tmp_path / "out",
                progress=False)
    exported = json.loads((tmp_path / "out" / "training_state.json").read_text())
    assert (exported["step"], exported["heldout_decoding_tau"], exported["best_step"]) == (20, 1.5, 20)
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(weights[k], snapshots[20][k]) for k in weights)
    assert not all(torch.equal(weights[k], snapshots[50][k]) for k in weights)
    assert torch.load(tmp_path / "work" / "checkpoint.pt", weights_only=False)["step"] == 50  # resumes from the last
    trainer.fit(DFlashDraftModel.random(cfg, seed=0), frozen, seqs, fit_cfg, tmp_path / "work", tmp_path / "out",
                progress=False)  # the finished run again: nothing to do, its export stays
    assert json.loads((tmp_path / "out" / "training_state.json").read_text())["step"] == 20
    with pytest.raises(ValueError, match="has already finished \\(step 50\\) and .* holds no draft"):
        trainer.fit(DFlashDraftModel.random(cfg, seed=0), frozen, seqs, fit_cfg, tmp_path / "work", tmp_path / "other",
                    progress=False)  # its draft cannot be exported again elsewhere: a clear error, not a crash

    figures = iter([1.2, 1.5, 1.4, 1.5, 1.1])
    fit_cfg.keep_best = False  # as the first SmolLM2 draft was exported: the last checkpoint's step
    trainer.fit(DFlashDraftModel.random(cfg, seed=0), frozen, seqs, fit_cfg, tmp_path / "work-last", tmp_path / "last",
                progress=False)
    assert json.loads((tmp_path / "last" / "training_state.json").read_text())["step"] == 50
    trainer.fit(DFlashDraftModel.random(cfg, seed=0), frozen, seqs, fit_cfg, tmp_path / "work-last", tmp_path / "again",
                progress=False)  # here the export is the checkpoint's weights: another out gets the same draft
    assert json.loads((tmp_path / "again" / "training_state.json").read_text())["step"] == 50
    again, last = load_file(str(tmp_path / "again" / "model.safetensors")), load_file(str(tmp_path / "last" / "model.safetensors"))
    assert again.keys() == last.keys() and all(torch.equal(again[k], last[k]) for k in last)


@pytest.mark.train
def test_two_workers_train_as_one(tiny_run, tiny_qwen3_path, tmp_path):
    """--workers 2 (train/parallel.py): two processes, each computing its share of every step's sequences
    (3 a step, so the shares are uneven) and summing gradients, train the draft that one process trains, up to
    the order of floating-point sums; a checkpoint of either resumes in the other."""
    from sglang_dflash.models.reference import DFlashDraftModel
    from sglang_dflash.train import trainer
    from sglang_dflash.train.features import FeatureCache
    from sglang_dflash.train.parallel import fit_parallel
    from sglang_dflash.train.recipe import load_target

    features = tiny_run["base"] / "work-straight" / "features"
    seqs = FeatureCache(features).load()
    target, _ = load_target(str(tiny_qwen3_path), torch.float32)
    cfg = DFlashDraftModel.from_pretrained(tiny_run["base"] / "straight").config
    frozen = trainer.Frozen(target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                            trainer.training_vocab(seqs, cfg.vocab_size))
    fit_cfg = lambda **kw: trainer.FitConfig(steps=8, seqs_per_step=3, blocks_per_seq=8, lr=2e-3, warmup=2, heldout=3,
                                             heldout_decode=2, eval_every=4, save_every=4, autocast="off", **kw)
    start = lambda: DFlashDraftModel.random(cfg, seed=0)
    trainer.fit(start(), frozen, seqs, fit_cfg(), tmp_path / "one", tmp_path / "one-out", progress=False)
    fit_parallel(2, start(), frozen, features, cfg.target_layer_ids, fit_cfg(), tmp_path / "two", tmp_path / "two-out")
    fit_parallel(2, start(), frozen, features, cfg.target_layer_ids, fit_cfg(stop_at=4), tmp_path / "mixed",
                 tmp_path / "mixed-out")
    trainer.fit(start(), frozen, seqs, fit_cfg(), tmp_path / "mixed", tmp_path / "mixed-out", progress=False)

    log = lambda name: [json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
    for name in ("two", "mixed"):
        assert [m["step"] for m in log(name)] == list(range(1, 9))  # one log line a step: the lead worker's
        assert [m["loss"] for m in log(name)] == pytest.approx([m["loss"] for m in log("one")], rel=1e-5)
        assert log(name)[-1]["heldout_tau"] == log("one")[-1]["heldout_tau"]
        assert (tmp_path / f"{name}-out" / "model.safetensors").exists()
    weights = lambda name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)["model"]
    one, two, mixed, begin = weights("one"), weights("two"), weights("mixed"), start().state_dict()
    moved = max((one[k] - begin[k]).abs().max().item() for k in one)
    gap = max(max((one[k] - w[k]).abs().max().item() for k in one) for w in (two, mixed))
    print(f"8 steps moved the weights by up to {moved:.2e}; two workers differ from one by up to {gap:.2e}")
    assert gap < 1e-3 * moved


@pytest.mark.unit
def test_autocast_setting():
    """bf16 autocast on, off, or auto: on only where bf16 products are native (emulated bf16 made this CPU's
    products five times slower than float32)."""
    from sglang_dflash.train.trainer import FitConfig, bf16_is_native, use_autocast

    assert use_autocast(FitConfig(autocast="on"), "cpu") and use_autocast(FitConfig(autocast="true"), "cpu")
    assert not use_autocast(FitConfig(autocast="off"), "cpu") and not use_autocast(FitConfig(autocast=False), "cpu")
    flags = open("/proc/cpuinfo").read()
    assert use_autocast(FitConfig(), "cpu") == bf16_is_native("cpu") == ("avx512_bf16" in flags or "amx_bf16" in flags)
    with pytest.raises(ValueError, match="autocast must be on, off or auto"):
        use_autocast(FitConfig(autocast="sometimes"), "cpu")


@pytest.mark.unit
def test_heldout_split_says_when_it_is_off(caplog):
    """The last `heldout` sequences are kept out when there are more than twice as many; otherwise none is, and
    the log says so (the export is then the last step's, not the best held-out step's)."""
    import logging

    from sglang_dflash.train.trainer import split_heldout

    seqs = list(range(10))
    assert split_heldout(seqs, 4) == (list(range(6)), [6, 7, 8, 9])
    with caplog.at_level(logging.WARNING, logger="sglang_dflash.train.trainer"):
        assert split_heldout(seqs, 5) == (seqs, [])
    assert "held-out evaluation is off: 10 sequences" in caplog.text
    caplog.clear()
    assert split_heldout(seqs, 0) == (seqs, []) and not caplog.text  # asked for none: nothing to say
    with pytest.raises(ValueError, match="no training sequences"):
        split_heldout([], 0)
