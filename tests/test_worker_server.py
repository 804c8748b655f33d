"""This package's DFLASH worker in a real SGLang server on the CPU, against the same server
without speculation: greedy output must be token for token the same in float32."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from conftest import chat_ids
from sglang_dflash import bench
from server import generate, kv_slots_in_use, oracle_env, sglang_server, sglang_servers
from shared_servers import (NEW_TOKENS, PENALTY_TOKENS, TRAINED_DRAFT, dflash_args, run_all, save_random_draft,
                            served, sixteen_of_forty, start_with_files)

pytestmark = pytest.mark.server
ONE_OF_EACH_SET = (0, 4, 8)  # tests/data/prompts.jsonl: gsm8k_test, humaneval, mt_bench


def assert_same(outs: list[dict], refs: list[dict], what: str):
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out["output_ids"] == ref["output_ids"], f"{what}: request {i} differs"


def first_tokens(refs: list[dict], n: int) -> list[dict]:
    """The baseline's outputs cut to their first n tokens (greedy: what max_new_tokens=n gives)."""
    return [dict(ref, output_ids=ref["output_ids"][:n]) for ref in refs]


def tau(out: dict) -> float:
    meta = out["meta_info"]
    return meta["completion_tokens"] / meta["spec_verify_ct"]


GSM8K = [i for i in range(40) if i < 4 or 12 <= i < 22]  # tests/data/prompts.jsonl: its gsm8k_test prompts
TRAINED_TAU_GSM8K = 1.8  # the shipped draft's τ on these prompts, 128 tokens, window 16, was 2.39 (its model card: 2.51)


def test_smollm2_lossless_float32(smol, trained_server):
    """The shipped trained draft (accept lengths of every size, not a random draft's 0s), 40 prompts at
    concurrency 16, 3 at concurrency 1, then 4 radix-cache hits: every output is the baseline's. Its τ on
    the gsm8k prompts is in the draft's known range, and the worker's accept-length histogram accounts
    for every verify step the scheduler counted (the server's only requests: it has no warm-up)."""
    url, stats = trained_server["url"], trained_server["stats"]
    conc16 = run_all(url, smol["inputs"], 16)
    conc1 = run_all(url, [smol["inputs"][i] for i in ONE_OF_EACH_SET], 1)
    repeat = run_all(url, smol["inputs"][:4], 4)  # the radix cache now holds these prompts
    assert_same(conc16, smol["base"], "concurrency 16")
    assert_same(conc1, [smol["base"][i] for i in ONE_OF_EACH_SET], "concurrency 1")
    assert_same(repeat, smol["repeat"], "radix-cache hits")
    assert all(r["meta_info"]["cached_tokens"] > 0 for r in repeat)
    outs = conc16 + conc1 + repeat
    assert all(o["meta_info"]["completion_tokens"] == len(o["output_ids"]) for o in outs)
    gsm8k = [conc16[i] for i in GSM8K]
    tau_gsm8k = sum(len(o["output_ids"]) - 1 for o in gsm8k) / sum(o["meta_info"]["spec_verify_ct"] for o in gsm8k)
    print(f"trained draft, window 16: τ {tau_gsm8k:.2f} on the gsm8k prompts, by request {[round(tau(o), 2) for o in conc16]}")
    assert tau_gsm8k > TRAINED_TAU_GSM8K
    hist = json.loads(stats.read_text())["accept_length_histogram"]  # verify steps by tokens committed
    assert sum(hist) == sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    # each step commits what it accepted; a request's last step may commit past its stop (EOS, max_new_tokens)
    committed, emitted = sum(n * c for n, c in enumerate(hist)), sum(len(o["output_ids"]) - 1 for o in outs)
    assert emitted <= committed <= emitted + 15 * len(outs)
    assert sum(hist[3:]) > 0.1 * sum(hist)  # whole runs of drafts were accepted, not only single ones


def test_smollm2_oracle_draft_accepts_whole_blocks(smol, oracle_url):
    """With proposals that are the target's own continuation every verify accepts the whole
    block, so τ reaches the block size; the output is still exactly the baseline's."""
    outs = run_all(oracle_url, smol["inputs"][:8], 4)
    assert_same(outs, smol["base"][:8], "oracle draft")
    full = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "length"]
    assert full, "no request ran to max_new_tokens"
    for out in full:
        # 1 token from prefill, then 127 = 7 full blocks of 16 + 15 -> 8 verify steps
        assert out["meta_info"]["spec_verify_ct"] == 8, out["meta_info"]
        assert out["meta_info"]["spec_accept_rate"] > 0.98


def _both(base_url, url, ids, **params):
    return generate(base_url, ids, **params), generate(url, ids, **params)


def test_max_new_tokens_exact(smol, smol_base_url, oracle_url):
    ids = smol["inputs"][1]
    for n in (1, 2, 17, 37):
        base, out = _both(smol_base_url, oracle_url, ids, temperature=0, max_new_tokens=n)
        assert out["output_ids"] == base["output_ids"] and len(out["output_ids"]) == n


def test_stop_token_and_stop_string_inside_an_accepted_block(smol, smol_base_url, oracle_url):
    long_refs = [(ids, ref["output_ids"]) for ids, ref in zip(smol["inputs"][:8], smol["base"][:8])
                 if len(ref["output_ids"]) == NEW_TOKENS]
    ids, ref = long_refs[0]
    k = next(k for k in range(20, NEW_TOKENS) if k % 16 not in (0, 1) and ref[k] not in ref[:k])
    base, out = _both(smol_base_url, oracle_url, ids, temperature=0, max_new_tokens=NEW_TOKENS, stop_token_ids=[ref[k]])
    assert base["output_ids"] == ref[:k + 1] and out["output_ids"] == base["output_ids"]
    assert out["meta_info"]["finish_reason"] == base["meta_info"]["finish_reason"]
    assert out["meta_info"]["spec_verify_ct"] <= 3  # the stop came inside a block of 16 accepted tokens
    stop = smol["tok"].decode(ref[40:43])
    base, out = _both(smol_base_url, oracle_url, ids, temperature=0, max_new_tokens=NEW_TOKENS, stop=[stop])
    assert out["text"] == base["text"] and out["output_ids"] == base["output_ids"]
    assert out["meta_info"]["finish_reason"] == base["meta_info"]["finish_reason"]
    assert len(out["output_ids"]) < NEW_TOKENS


def test_ignore_eos(smol, smol_base_url, oracle_url):
    ended = [ids for ids, ref in zip(smol["inputs"], smol["base"]) if ref["meta_info"]["finish_reason"]["type"] == "stop"]
    assert ended, "no prompt ended with EOS"
    base, out = _both(smol_base_url, oracle_url, ended[0], temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert out["output_ids"] == base["output_ids"] and len(out["output_ids"]) == NEW_TOKENS


def test_mixed_greedy_and_sampled_requests_in_one_batch(smol, oracle_url, hf_smol):
    """Sampled requests (rejection sampling, top_p through the sorting path) share verify batches with
    greedy ones; the greedy ones stay token for token the baseline's. Every sampled token lies in the
    target's top-p nucleus at its position (a token drawn from the draft, or without the filter, would
    often not); their distribution is the statistical tier's (test_sampling_stats.py)."""
    from sglang_dflash.accept import filtered_probs

    greedy = [(ids, {"temperature": 0}) for ids in smol["inputs"][8:16]]
    sampled = [(ids, {"temperature": 0.8, "top_p": 0.9}) for ids in smol["inputs"][16:24]]
    jobs = [job for pair in zip(greedy, sampled) for job in pair]  # interleaved, so batches mix
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda job: generate(oracle_url, job[0], max_new_tokens=64, **job[1]), jobs))
    for i, ref in enumerate(smol["base"][8:16]):
        assert outs[2 * i]["output_ids"] == ref["output_ids"][:64], f"greedy request {i} changed"
    outside = []
    for (ids, _), out in zip(sampled, outs[1::2]):
        assert out["meta_info"]["spec_verify_ct"] >= 1 and out["meta_info"]["completion_tokens"] == len(out["output_ids"])
        seq = torch.tensor([ids + out["output_ids"]])
        with torch.no_grad():  # the target's logits at each output position, teacher-forced
            logits = hf_smol(seq).logits[0, len(ids) - 1:-1].float()
        n = logits.shape[0]
        # the nucleus of top_p 0.95: a superset of 0.9's, so float32 differences between HF and SGLang do not matter
        p = filtered_probs(logits, torch.full((n,), 0.8), torch.full((n,), logits.shape[-1]), torch.full((n,), 0.95), None)
        picked = p.gather(1, torch.tensor(out["output_ids"])[:, None]).squeeze(1)
        outside += [(len(ids), j) for j in (picked == 0).nonzero().flatten().tolist()]
    assert not outside, f"sampled tokens outside the target's nucleus (prompt length, token): {outside}"


def test_return_logprob_matches_the_baseline(smol, smol_base_url, oracle_url):
    """Output-token logprobs and top-3 logprobs of greedy requests agree with the non-speculative
    server's (float32): through the oracle prompts (whole blocks accepted) and a random-draft one."""
    for i in (0, 1, 30):
        body = {"input_ids": smol["inputs"][i], "sampling_params": {"temperature": 0, "max_new_tokens": 40},
                "return_logprob": True, "top_logprobs_num": 3}
        base = requests.post(smol_base_url + "/generate", timeout=600, json=body).json()
        out = requests.post(oracle_url + "/generate", timeout=600, json=body).json()
        assert out["output_ids"] == base["output_ids"], i
        got, want = out["meta_info"]["output_token_logprobs"], base["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in got] == out["output_ids"] and len(got) == len(want)
        for (lp, tok, _), (lp0, tok0, _) in zip(got, want):
            assert tok == tok0 and abs(lp - lp0) < 1e-3, (i, tok, lp, lp0)
        for top, top0 in zip(out["meta_info"]["output_top_logprobs"], base["meta_info"]["output_top_logprobs"]):
            assert [t[1] for t in top] == [t[1] for t in top0]
            assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(top, top0))


def test_penalties_grammar_and_logit_bias_apply_per_block_row(oracle_server):
    """Each verify row gets the request's rules as if the drafts before it were output: greedy output
    equals the baseline's under frequency / presence / repetition penalties, min_new_tokens, logit_bias
    and a JSON schema; fed the baseline's own output as proposals, whole blocks are accepted."""
    for (name, ids, params), ref in oracle_server["rules"]:
        out = generate(oracle_server["url"], ids, temperature=0, **params)
        assert out["output_ids"] == ref["output_ids"], name
        assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"], name
        print(f"{name}: {len(out['output_ids'])} tokens, τ {tau(out):.2f}")
        if name == "json_schema" and out["meta_info"]["finish_reason"]["type"] == "stop":
            json.loads(out["text"])  # a complete object
        if "stale" not in name and name != "min_new_tokens":  # proposals are this very output: every
            # verify accepts its whole block (16 tokens) after the prefill's first token
            assert out["meta_info"]["spec_verify_ct"] == -(-(len(out["output_ids"]) - 1) // 16), (name, out["meta_info"])


def test_penalties_match_sglang_token_for_token(smol, oracle_server):
    """Repetition (1.3, 2.0), frequency (0.5, 1.0) and presence (1.0) penalties, each alone and with
    min_new_tokens, on 8 prompts, sent at once with 8 unpenalised requests so that penalised and unpenalised
    requests share verify batches: every output is the baseline's token for token (float32). SGLang's
    penalizers count each output token once, from the first; row j of a verify block sees the committed
    output plus the drafts before it (block_logits.py). The proposals: the output under repetition 1.3,
    so that setting accepts whole blocks and the others reject at varied rows."""
    penalised = [(name, ids, params, ref["output_ids"]) for (name, ids, params), ref in oracle_server["penalties"]]
    plain = [(f"unpenalised, prompt {i}", smol["inputs"][i], {"max_new_tokens": PENALTY_TOKENS},
              smol["base"][i]["output_ids"][:PENALTY_TOKENS]) for i in (4, 5, 6, 7, 15, 16, 17, 18)]
    jobs = penalised[:8] + plain + penalised[8:]  # the unpenalised ones join the first batches
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda job: generate(oracle_server["url"], job[1], temperature=0, **job[2]), jobs))
    differ = [name for (name, _, _, ref), out in zip(jobs, outs) if out["output_ids"] != ref]
    assert not differ, f"{len(differ)} of {len(jobs)} outputs differ from the baseline's: {differ}"
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in outs[:8])
    assert sum(len(o["output_ids"]) for o in outs[:8]) - 8 > 4 * steps, "repetition 1.3 did not accept its blocks"
    print(f"penalties: {len(jobs)} outputs identical; τ by request {[round(tau(o), 2) for o in outs]}")


def frontend_program_outputs(url: str) -> dict:
    """An SGLang frontend program (sgl.function): multi-turn chat, fork, a regex-constrained gen,
    run against the server at url; returns every generated piece."""
    import sglang as sgl

    @sgl.function
    def chat(s, question):
        s += sgl.system("You are a concise assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=48, temperature=0))
        s += sgl.user("Give the final number only.")
        s += sgl.assistant(sgl.gen("number", max_tokens=8, temperature=0, regex=r"[0-9]+"))

    @sgl.function
    def facts(s, topic):
        s += f"Two facts about {topic}:\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"{i + 1}. " + sgl.gen("fact", max_tokens=24, temperature=0, stop="\n")
        forks.join()
        s += "In short:" + sgl.gen("summary", max_tokens=24, temperature=0)

    backend = sgl.RuntimeEndpoint(url)
    a = chat.run(question="Tom has 3 apples and buys 4 more. How many apples does he have?", backend=backend)
    b = facts.run(topic="the Moon", backend=backend)
    return {"answer": a["answer"], "number": a["number"], "summary": b["summary"], "text": b.text()}


def test_sglang_frontend_program(smol_base_url, oracle_url):
    """The same frontend program against the DFLASH server and the server without speculation: the
    same text, piece by piece (greedy, float32)."""
    base, ours = frontend_program_outputs(smol_base_url), frontend_program_outputs(oracle_url)
    assert base["number"].isdigit() and base["summary"]
    assert ours == base


def test_streaming(smol, oracle_url):
    r = requests.post(oracle_url + "/generate", stream=True, timeout=600, json={
        "input_ids": smol["inputs"][2], "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 64}})
    chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(chunks) > 1
    assert chunks[-1]["output_ids"] == smol["base"][2]["output_ids"][:64]


def test_abort_and_no_leaked_kv(smol, oracle_url):
    """64 requests, 8 of them aborted mid-generation; afterwards no KV slot is leaked."""

    def stream_then_abort(i):
        rid = f"abort-{i}"
        r = requests.post(oracle_url + "/generate", stream=True, timeout=600, json={
            "rid": rid, "input_ids": smol["inputs"][i % 40], "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}})
        for n, line in enumerate(r.iter_lines(decode_unicode=True)):
            if n == 3:
                requests.post(oracle_url + "/abort_request", json={"rid": rid}, timeout=60)
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
        return last

    with ThreadPoolExecutor(16) as pool:
        aborted = list(pool.map(stream_then_abort, range(8)))
        done = list(pool.map(lambda ids: generate(oracle_url, ids, temperature=0, max_new_tokens=4),
                             smol["inputs"] + smol["inputs"][:16]))
    assert all(a["meta_info"]["finish_reason"]["type"] == "abort" for a in aborted)
    assert all(len(d["output_ids"]) == 4 for d in done)
    # idle (flush_cache is retried until it is): no slot in use once the radix cache is flushed, and SGLang's
    # strict idle check, which stops a server that leaked, has had its look
    assert kv_slots_in_use(oracle_url) == 0
    assert requests.get(oracle_url + "/health_generate", timeout=60).status_code == 200


def _bench(smol, base_url, url, out, *extra):
    from sglang_dflash.cli import main

    return main(["bench", "--tokenizer", str(smol["path"]), "--baseline-url", base_url, "--dflash-url", url,
                 "--datasets", "mt-bench", "--dataset-path", str(Path(__file__).parent / "data" / "prompts.jsonl"),
                 "--num-prompts", "6", "--concurrency", "1,3", "--max-new-tokens", "48", "--out", str(out), *extra])


def test_bench_side_by_side_on_live_servers(smol, smol_base_url, oracle_server, tmp_path):
    """The benchmark against the live baseline and oracle-draft servers: valid results, identical greedy
    outputs, τ near the block size, the worker's accept-length histogram, the plots."""
    t0 = time.perf_counter()
    rc = _bench(smol, smol_base_url, oracle_server["url"], tmp_path, "--dflash-stats-file", str(oracle_server["stats"]))
    elapsed = time.perf_counter() - t0
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["side_by_side"]["mt-bench"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    runs = results["baseline"]["mt-bench"] + results["dflash"]["mt-bench"]
    for run in runs:  # throughput from the tokens really returned over a wall time this test's clock bounds
        assert run["output_tokens"] == sum(len(ids) for ids in run["output_ids"]) > 0
        assert max(q["latency_s"] for q in run["per_request"]) <= run["wall_s"]
        assert run["tok_per_s"] == pytest.approx(run["output_tokens"] / run["wall_s"])
    assert sum(run["wall_s"] for run in runs) < elapsed
    for r, base, run in zip(rows, results["baseline"]["mt-bench"], results["dflash"]["mt-bench"]):
        assert r["identical"] and base["output_ids"] == run["output_ids"]
        assert r["speedup"] == pytest.approx(base["wall_s"] / run["wall_s"])  # the same tokens: a ratio of times
        assert r["tau"] == pytest.approx(run["output_tokens"] / sum(q["verify_steps"] for q in run["per_request"]))
        assert r["tau"] > 8  # the oracle proposes the target's own continuation
        assert len(run["per_request"]) == 6 and all(q["ttft_s"] > 0 and q["latency_s"] >= q["ttft_s"]
                                                    for q in run["per_request"])
        hist = run["accept_length_histogram"]
        assert len(hist) == 17 and sum(hist) == sum(q["verify_steps"] for q in run["per_request"])
        assert run["accept_rate_by_row"][0] > 0.9
        assert run["decode_batches"] >= 1 and all(run["step_ms"][k] > 0 for k in ("draft", "verify", "accept"))
    assert "| mt-bench | 3 |" in (tmp_path / "results.md").read_text()
    for name in ("tau_histogram.png", "acceptance_by_row.png", "speedup.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_bench_flags_a_different_output(smol, smol_base_url, oracle_url, tmp_path, monkeypatch):
    real = bench.stream_one

    def one_token_changed(url, ids, sampling, timeout=1800):
        r = real(url, ids, sampling, timeout)
        if url == oracle_url and ids == smol["inputs"][2] and sampling["max_new_tokens"] > 8:
            r.output_ids[-1] += 1
        return r

    monkeypatch.setattr(bench, "stream_one", one_token_changed)
    # one concurrency and three prompts (the later flags win): the verdict is judged per row alike
    assert _bench(smol, smol_base_url, oracle_url, tmp_path, "--num-prompts", "3", "--concurrency", "3") == 1
    rows = json.loads((tmp_path / "results.json").read_text())["side_by_side"]["mt-bench"]
    assert [r["concurrency"] for r in rows] == [3]
    assert all(not r["identical"] and r["differing_requests"] == [2] and not r["lossless"] for r in rows)
    outs = json.loads((tmp_path / "results.json").read_text())["dflash"]["mt-bench"][0]["output_ids"]
    assert all(r["divergences"]["2"]["token"] == len(outs[2]) - 1 for r in rows)  # judged where it was changed
    assert "NO (1 differ)" in (tmp_path / "results.md").read_text()


def test_bfloat16_divergences_fall_on_near_ties(smol):
    """In bf16 a verify forward and a decode forward round differently, so outputs may part; every first
    divergence must fall where the non-speculative server's top two candidates are a near tie, and the
    DFLASH token must be one of the tied (an exact tie may have three or more members).
    16 prompts from the three sets, 64 tokens each, through the shipped trained draft (so that drafts are
    accepted mid-block, in bf16) and a verify window of 8: on a CPU without native bf16 products (AVX2
    only) the random-draft server with a window of 16 verified about 4.5 tokens/s at concurrency 16
    (float32: 14.5), and the test took 9 minutes."""
    body = lambda ids, **extra: {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 64},  # noqa: E731
                                 **extra}
    inputs = sixteen_of_forty(smol["inputs"])

    def run(url, **extra):
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda ids: requests.post(url + "/generate", json=body(ids, **extra), timeout=1800).json(),
                                 inputs))

    with sglang_servers((smol["path"], ("--dtype", "bfloat16"), None),
                        (smol["path"], (*dflash_args(TRAINED_DRAFT, window=8)[2:], "--dtype", "bfloat16"), None)
                        ) as (base_url, url):
        base = run(base_url, return_logprob=True, top_logprobs_num=5)
        spec = run(url)
    diverged = []
    for i, (b, s) in enumerate(zip(base, spec, strict=True)):
        if b["output_ids"] == s["output_ids"]:
            continue
        j = next((k for k, (x, y) in enumerate(zip(b["output_ids"], s["output_ids"])) if x != y), None)
        assert j is not None, f"prompt {i}: one output is a prefix of the other without a differing token"
        # the baseline's 5 best (logprob, id, text) there, from the decode that produced its token, judged by
        # bench's rule (bench.near_tie; bench asks the baseline again for them instead)
        judged = bench.near_tie(b["meta_info"]["output_top_logprobs"][j], s["output_ids"][j])
        diverged.append((i, j, judged["gap"], judged["behind"], judged["near_tie"]))
    print(f"bf16: {len(diverged)} of {len(base)} outputs diverge (prompt, token, baseline top-2 gap, "
          f"baseline's top logprob minus that of the DFLASH token, near tie): {diverged}")
    for i, j, gap, behind, tie in diverged:
        assert tie, f"prompt {i} parts at token {j} beyond a near tie (gap {gap}, DFLASH's token behind by {behind})"


def test_tiny_qwen3_lossless_float32(tiny_qwen3_path, prompts, tmp_path):
    """The Qwen3 architecture and tokenizer (a random 4-layer model, which never stops early).
    16 prompts × 64 tokens: SGLang's CPU decode of this 152k-vocabulary model is slow. A verify window of 4:
    the random draft's proposals are never accepted here (τ 1.02, 63 steps of one token for 64), so each step's
    token is decided at row 0 whatever the window; with 16 the test took 95 s, mostly rows that decide nothing."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3_path))
    inputs = [chat_ids(tok, p["prompt"]) for p in sixteen_of_forty(prompts)]
    draft = save_random_draft(tiny_qwen3_path, tmp_path / "draft", "tiny-qwen3")
    with sglang_servers((tiny_qwen3_path, ("--dtype", "float32"), None),
                        (tiny_qwen3_path, dflash_args(draft, window=4), None)) as (base_url, url):
        base = run_all(base_url, inputs, 16, max_new_tokens=64)
        outs = run_all(url, inputs, 16, max_new_tokens=64)
    print(f"tiny-qwen3: τ by request {[round(tau(o), 2) for o in outs]}")
    assert_same(outs, base, "tiny-qwen3")


def test_verify_window_shorter_than_the_block(smol, smol_base_url, window4_url):
    """--speculative-num-draft-tokens 4 with a 16-token draft: each step verifies the bonus and the
    draft's first 3 proposals (the draft still fills its whole block). Output equals the baseline's;
    with oracle proposals every step commits exactly 4 tokens."""
    oracle, plain = smol["inputs"][:4], smol["inputs"][36:40]
    url = window4_url
    outs = run_all(url, oracle + plain, 8, max_new_tokens=64)
    bodies = [{"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 24},
               "return_logprob": True, "top_logprobs_num": 2} for ids in (oracle[0], plain[0])]
    logprobs = [requests.post(url + "/generate", timeout=600, json=body).json() for body in bodies]
    refs = first_tokens(smol["base"][:4] + smol["base"][36:40], 64)
    assert_same(outs, refs, "verify window 4")
    for out in outs[:4]:
        if out["meta_info"]["finish_reason"]["type"] == "length":  # 1 token from prefill, 63 = 15 × 4 + 3
            assert out["meta_info"]["spec_verify_ct"] == 16, out["meta_info"]
    for body, out in zip(bodies, logprobs):  # the logprob rows have the window's stride
        base = requests.post(smol_base_url + "/generate", timeout=600, json=body).json()
        got, want = out["meta_info"]["output_token_logprobs"], base["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in got] == [t[1] for t in want] == base["output_ids"]
        assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(got, want))
    print(f"window 4: oracle τ {[round(tau(o), 2) for o in outs[:4]]}, random draft τ {[round(tau(o), 2) for o in outs[4:]]}")


# The two adaptive servers (random draft), started together, each for its own test.
def adaptive_start(smol, tmp_path_factory):  # no window given: adaptive, 1 … the block
    return start_with_files(smol, tmp_path_factory, "adaptive", "--dtype", "float32", "--speculative-algorithm",
                            "DFLASH", "--speculative-draft-model-path", str(smol["draft"]))


def adaptive8_start(smol, tmp_path_factory):  # SGLang's --speculative-adaptive with a window of 8
    return start_with_files(smol, tmp_path_factory, "adaptive8", *dflash_args(
        smol["draft"], "--speculative-adaptive", "--enable-metrics", "--decode-log-interval", "1", window=8))


@pytest.fixture
def adaptive_server(smol, tmp_path_factory, request):
    yield from served(request, "adaptive_server", lambda: adaptive_start(smol, tmp_path_factory),
                      beside={"adaptive8_server": lambda: adaptive8_start(smol, tmp_path_factory)})


@pytest.fixture
def adaptive8_server(smol, tmp_path_factory):
    yield from served(None, "adaptive8_server", lambda: adaptive8_start(smol, tmp_path_factory))


def test_adaptive_window_is_lossless_and_falls_back_to_decoding(smol, adaptive_server):
    """The default window (no --speculative-num-draft-tokens: adaptive, 1 … the block) with the random draft,
    which accepts nothing: the greedy output is the baseline's at concurrency 16, and the server verifies one
    row per step, a plain decode step, after trying 2 rows (and more only while a bucket has seen too few
    requests to rule them out); a sampled request decodes through it too."""
    url, stats, log = adaptive_server["url"], adaptive_server["stats"], adaptive_server["log"]
    inputs, refs = sixteen_of_forty(smol["inputs"]), first_tokens(sixteen_of_forty(smol["base"]), 64)
    outs = run_all(url, inputs, 16, max_new_tokens=64)
    sampled = generate(url, inputs[0], temperature=0.8, max_new_tokens=24, ignore_eos=True)
    assert "verify window adaptive 1-16" in log.read_text()  # the choice made for the user, in its start-up line
    assert_same(outs, refs, "adaptive window")
    assert len(sampled["output_ids"]) == sampled["meta_info"]["completion_tokens"] == 24
    written = json.loads(stats.read_text())
    windows, buckets = written["window_histogram"], written["adaptive_window"]["buckets"]  # decode batches by rows
    print(f"adaptive window, random draft: decode batches by window { {k: n for k, n in enumerate(windows) if n} }"
          f"; by bucket {buckets}")
    # A bucket of 8 or more requests where a 2-row step costs more than a plain one (1.2-1.8 times on this CPU)
    # settles on plain decoding: of its last 8 steps at most 2 verify more rows (the anchors around the choice
    # measured again). These buckets run after the smaller ones have shown that the draft accepts nothing: they
    # climb from 1 to 2, or to 4 where a noisy 2-row step looked cheap (a fresh-clone run: 1, 2, 4, then 1 but
    # for one 2 in the bucket of 16-31 requests), and measure the anchors around their choice once more (none
    # runs `refresh` = 128 steps here), at most 4 + 2 steps of more than one row in all. The bucket of one
    # request is not judged: it runs first, while the acceptance is still unknown, so it may climb to 16 and take
    # larger windows for a few steps, as it should with a draft that might accept; and at one request every window
    # costs about the same (1.0-1.25 times a plain step), so its choice follows the timing noise (a fresh-clone
    # run measured 0.089 s for 1 row, 0.138 s for 2 and 0.085 s for 4 there, and rightly chose 4).
    costly = {name: b for name, b in buckets.items()
              if int(name.split("-")[0]) >= 8 and b["seconds"].get("2", 0) > 1.2 * b["seconds"]["1"]}
    assert {"8-15", "16-31"} & costly.keys(), buckets
    for name, b in costly.items():
        assert b["best"] == 1 and sum(k > 1 for k in b["recent"][-8:]) <= 2, (name, b)
        assert sum(n for k, n in b["chosen"].items() if k != "1") <= 6, (name, b)
    assert windows[1] > 0.6 * sum(windows) and windows[2] >= 1, windows


def test_speculative_adaptive_with_a_window_adapts_up_to_it(smol, adaptive8_server):
    """--speculative-num-draft-tokens 8 --speculative-adaptive (SGLang's own flag, which SGLang itself would turn
    off for any algorithm but EAGLE): adaptive, 1 … 8; greedy output still the baseline's; and SGLang's own
    speculative metrics (--enable-metrics) carry the worker's verify steps."""
    url, stats, log = adaptive8_server["url"], adaptive8_server["stats"], adaptive8_server["log"]
    inputs, refs = smol["inputs"][:4], first_tokens(smol["base"][:4], 16)
    outs = run_all(url, inputs, 4, max_new_tokens=16)
    metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in requests.get(url + "/metrics").text
               .splitlines() if line.startswith("sglang:spec_")}
    assert_same(outs, refs, "--speculative-adaptive with a window of 8")
    assert metrics["sglang:spec_verify_calls_total"] >= sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0
    assert metrics["sglang:spec_accept_length"] >= 1 and metrics["sglang:spec_num_draft_tokens"] == 8
    assert "verify window adaptive 1-8" in log.read_text()
    windows = json.loads(stats.read_text())["window_histogram"]
    assert len(windows) == 9 and windows[2] >= 1  # up to 8 rows; it climbs past a plain step, to 2 rows first


# The two tree servers (trained draft, top 2, up to 8 nodes), started together, each for its own test; a leak
# or a double free, seen when idle, stops either (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE).
def tree_start(smol, tmp_path_factory, *args: str):
    return start_with_files(smol, tmp_path_factory, "tree", *dflash_args(
        TRAINED_DRAFT, "--speculative-eagle-topk", "2", *args, window=8),
        env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"})


TREE_PAGES = ("--page-size", "16", "--chunked-prefill-size", "64")  # a fixed budget of 8 nodes


@pytest.fixture
def tree_server(smol, tmp_path_factory, request):  # adaptive budgets
    yield from served(request, "tree_server", lambda: tree_start(smol, tmp_path_factory, "--speculative-adaptive"),
                      beside={"tree_pages_server": lambda: tree_start(smol, tmp_path_factory, *TREE_PAGES)})


@pytest.fixture
def tree_pages_server(smol, tmp_path_factory):
    yield from served(None, "tree_pages_server", lambda: tree_start(smol, tmp_path_factory, *TREE_PAGES))


def test_tree_verification_is_lossless(smol, smol_base_url, oracle_server, tree_server):
    """--speculative-eagle-topk 2 --speculative-num-draft-tokens 8 --speculative-adaptive with the shipped
    trained draft: each step a tree of 1 … 8 nodes (the policy's choice at the batch's size; 1 a plain decode
    step) from the top 2 tokens of each draft row, verified in one forward. Greedy output at concurrency 16
    is the baseline's (float32), whatever budgets the steps took; so are the requests with penalties,
    logit_bias and a JSON schema (each node's rules follow its own path) and the logprobs of a greedy
    request; a sampled request in the same batches completes; no KV slot leaks or is freed twice (the accepted
    path keeps its slots, the others stay in the row). The tree steps accept the draft's proposals, and τ is
    printed beside the chain's on the same prompts from the trained-draft server of
    test_smollm2_lossless_float32 (window 16), for the record. (The fixed budget: the statistical tier's
    tree test, and test_decode_step's.)"""
    inputs, refs = sixteen_of_forty(smol["inputs"]), first_tokens(sixteen_of_forty(smol["base"]), 64)
    url, log, stats = tree_server["url"], tree_server["log"], tree_server["stats"]
    body = {"input_ids": smol["inputs"][1], "sampling_params": {"temperature": 0, "max_new_tokens": 40},
            "return_logprob": True, "top_logprobs_num": 3}
    with ThreadPoolExecutor(1) as pool:
        sampled = pool.submit(generate, url, inputs[3], temperature=0.8, max_new_tokens=48, ignore_eos=True)
        outs = run_all(url, inputs, 16, max_new_tokens=64)
        sampled = sampled.result()
    ruled = [(name, generate(url, ids, temperature=0, **params), ref)
             for (name, ids, params), ref in oracle_server["rules"]]
    with_logprobs = requests.post(url + "/generate", timeout=600, json=body).json()
    assert kv_slots_in_use(url) == 0
    assert "tree verification of adaptive 1-8 nodes from the top 2 per row" in log.read_text()
    assert_same(outs, refs, "trees of up to 8 nodes")
    for name, out, ref in ruled:
        assert out["output_ids"] == ref["output_ids"], name
        assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"], name
    # the requests one at a time (rules, logprobs) went through trees too: some steps committed drafts
    alone = [out for _, out, _ in ruled] + [with_logprobs]
    assert sum(o["meta_info"]["spec_verify_ct"] for o in alone) < sum(len(o["output_ids"]) for o in alone)
    assert len(sampled["output_ids"]) == sampled["meta_info"]["completion_tokens"] == 48
    base = requests.post(smol_base_url + "/generate", timeout=600, json=body).json()
    assert with_logprobs["output_ids"] == base["output_ids"]
    got, want = with_logprobs["meta_info"]["output_token_logprobs"], base["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in got] == with_logprobs["output_ids"] and len(got) == len(want)
    assert all(tok == tok0 and abs(lp - lp0) < 1e-3 for (lp, tok, _), (lp0, tok0, _) in zip(got, want)), (got, want)
    for top, top0 in zip(with_logprobs["meta_info"]["output_top_logprobs"], base["meta_info"]["output_top_logprobs"]):
        assert [t[1] for t in top] == [t[1] for t in top0] and all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(top, top0))
    tree_tau = sum(len(o["output_ids"]) - 1 for o in outs) / sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    written = json.loads(stats.read_text())
    by_budget = written["accept_length_histogram_by_window"]  # [N][n]: request steps of N nodes committing n
    trees = [sum(row) for row in by_budget]
    assert sum(trees[4:]) > 0, trees  # the policy climbed to trees of 4 nodes or more
    committed = sum(n * c for row in by_budget[2:] for n, c in enumerate(row)) / sum(trees[2:])
    print(f"trees of up to 8 nodes (top 2, adaptive), trained draft: τ {tree_tau:.2f} over 16 prompts, by request "
          f"{[round(tau(o), 2) for o in outs]}; request steps by budget {trees}, {committed:.2f} tokens per tree "
          f"step; by bucket {written['adaptive_window']['buckets']}")
    assert committed > 1.3  # the draft's proposals are accepted in the tree steps (a random draft's: about 1.03)


def test_tree_verification_with_pages_and_chunked_prefill(smol, smol_base_url, tree_pages_server):
    """--speculative-eagle-topk 2 --speculative-num-draft-tokens 8 (a fixed budget: every step a tree) with KV
    pages of 16 slots, where a request's row must stay page-aligned, so the accepted path's K/V is copied to the
    committed positions (worker.keep_path), and prompts prefilled in chunks of 64 tokens (the draft context
    written chunk by chunk). Long prompts (4 of the test prompts each) and 16 others at concurrency 16: greedy
    output is the session's reference server's (no speculation, whole prompts in one prefill, pages of 1) token
    for token (float32); the trained draft's paths went beyond its chain of first choices, so K/V was copied;
    no KV slot leaks. (The chain with pages: test_reliability_server's configurations.)"""
    tok = smol["tok"]
    long_prompts = ["\n\n".join(tok.decode(ids) for ids in smol["inputs"][i:i + 4]) for i in range(0, 16, 4)]
    long_inputs = [chat_ids(tok, p) for p in long_prompts]
    assert min(len(ids) for ids in long_inputs) > 128 and max(len(ids) for ids in long_inputs) > 300
    inputs = long_inputs + sixteen_of_forty(smol["inputs"])
    refs = run_all(smol_base_url, long_inputs, 4, max_new_tokens=64) + first_tokens(sixteen_of_forty(smol["base"]), 64)
    url, stats = tree_pages_server["url"], tree_pages_server["stats"]
    outs = run_all(url, inputs, 16, max_new_tokens=64)
    assert kv_slots_in_use(url) == 0
    assert_same(outs, refs, "trees of 8 nodes, pages of 16, chunked prefill")
    written = json.loads(stats.read_text())
    steps = sum(written["accept_length_histogram_by_window"][8])
    print(f"trees of 8 nodes (top 2), pages of 16, chunked prefill, trained draft: τ {[round(tau(o), 2) for o in outs]};"
          f" {written['tree_requests_beyond_the_chain']} of {steps} request steps beyond the chain")
    assert written["window_histogram"][8] == written["decode_batches"] and steps > 0  # every step a tree of 8
    assert written["tree_requests_beyond_the_chain"] > 0  # so some paths were copied


def test_tensor_parallel_2_equals_1(smol, oracle_server):
    """--tp 2 on this CPU (two ranks, one core each, gloo): the target sharded, and the shipped trained
    draft too (SmolLM2's 9 query / 3 kv heads padded to 12 / 4, six and two per rank), proposing through
    the vocabulary-sharded lm_head. Greedy output equals the single-rank baseline's; the trained draft's
    own proposals are accepted on gsm8k prompts as at one rank (a random draft's τ is 1.03: a sharded
    draft computing garbage would be lossless too, but not accepted); the oracle prompts still accept
    whole blocks (draft, verify and commit agree across the ranks); a sampled request in the same
    batches completes (the ranks agree on every random draw, or the next collective would hang).
    32 tokens per prompt: decoding over gloo is slow."""
    env = oracle_env(oracle_server["sequences"])
    oracle, plain = smol["inputs"][:4], smol["inputs"][12:16]  # proposals: the baseline's own output | the draft's
    with sglang_server(smol["path"], *dflash_args(TRAINED_DRAFT, "--tp", "2"), env=env, timeout=600) as url:
        assert requests.get(url + "/server_info", timeout=30).json()["tp_size"] == 2
        with ThreadPoolExecutor(1) as pool:
            sampled = pool.submit(generate, url, smol["inputs"][35], temperature=0.8, max_new_tokens=32,
                                  ignore_eos=True)
            outs = run_all(url, oracle + plain, 8, max_new_tokens=32)
            sampled = sampled.result()
    refs = first_tokens(smol["base"][:4] + smol["base"][12:16], 32)
    assert_same(outs, refs, "tp 2")
    for out in outs[:4]:
        if out["meta_info"]["finish_reason"]["type"] == "length":  # 1 token from prefill, 31 = 16 + 15
            assert out["meta_info"]["spec_verify_ct"] == 2, out["meta_info"]
    trained_tau = sum(len(o["output_ids"]) for o in outs[4:]) / sum(o["meta_info"]["spec_verify_ct"] for o in outs[4:])
    assert trained_tau > 1.3, trained_tau
    assert len(sampled["output_ids"]) == sampled["meta_info"]["completion_tokens"] == 32
    print(f"tp 2: oracle τ {[round(tau(o), 1) for o in outs[:4]]}, trained draft τ {[round(tau(o), 2) for o in outs[4:]]}"
          f" ({trained_tau:.2f} over the four)")


# Launches that must stop at start-up with an error naming the problem: (the draft's config.json changes,
# or None for a draft folder that does not exist; extra options; what the output must say).
BAD_LAUNCHES = {
    "block size": ({"block_size": 8}, (), "--speculative-num-draft-tokens 16 (the tokens verified per step) must "
                                          "be between 2 and the draft's block_size 8"),
    "hidden size": ({"hidden_size": 64}, (), "draft hidden_size 64 does not match the target's 576"),
    "mask token": ({"dflash_config": {"target_layer_ids": [1, 27]}}, (), "mask_token_id is missing"),
    "layer ids": ({"dflash_config": {"target_layer_ids": [1, 30], "mask_token_id": 16}}, (),
                  "target_layer_ids [30] are out of range"),
    "DFlash2 selector": ({"dflash_config": {"target_layer_ids": [1, 14, 27], "mask_token_id": 16, "selector_rank": 64,
                                            "selector_top_k": 8}}, (),
                         "keys this worker does not implement: dflash_config.selector_rank=64, "
                         "dflash_config.selector_top_k=8. SGLang's builtin DFLASH may run it"),
    "sliding window": ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 512},  # 2 layers
                       (), 'keys this worker does not implement: layer_types=["sliding_attention", '),
    "window option": ({}, ("--speculative-draft-window-size", "64"), "--speculative-draft-window-size is not supported"),
    "unified memory": ({}, ("--enable-unified-memory",), "--enable-unified-memory is not supported"),
    "adaptive config": ({}, ("--speculative-adaptive", "--speculative-adaptive-config", "/dev/null"),
                        "--speculative-adaptive-config holds EAGLE's step counts"),
    "tree with tp": ({}, ("--speculative-eagle-topk", "4", "--tp", "2"),
                     "--speculative-eagle-topk 4: sglang-dflash's tree verification has not been run with tensor "
                     "parallelism yet: give --tp 1"),
    "grammar backend": ({}, ("--grammar-backend", "llguidance"), "--grammar-backend llguidance: sglang-dflash's "
                        "DFLASH worker walks a request's grammar along the drafts"),
    "LoRA": ({}, ("--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"),
             "sglang-dflash's DFLASH worker does not run LoRA adapters"),
    "missing draft": (None, (), None),  # SGLang reads the draft's config before our checks: its error names the path
}


# launched for real (a process that must exit without serving): a refusal of ours and one of SGLang's own; the
# others are judged by tests/launch_refusals.py, the launch's own steps up to where they stop it, in one process
LAUNCHED = ("block size", "missing draft")


@pytest.fixture(scope="module")
def bad_launches(smol, tmp_path_factory) -> dict:
    """{name: (draft path, return code, output)} of every BAD_LAUNCHES case: LAUNCHED ones started as servers,
    the rest (and "block size" again, and a good launch's arguments) judged in one interpreter, all at once
    (each a core's imports, mostly). The judge must refuse "block size" as its launch did, and pass the good."""
    import subprocess
    import sys

    from sglang_dflash.cpu.runtime import serve_setup

    def draft_for(name):
        change = BAD_LAUNCHES[name][0]
        draft = tmp_path_factory.mktemp("bad") / "draft"
        if change is not None:
            draft.mkdir()
            cfg = json.loads((smol["draft"] / "config.json").read_text())
            (draft / "config.json").write_text(json.dumps({**cfg, **change}))
            (draft / "model.safetensors").symlink_to(smol["draft"] / "model.safetensors")
        return draft

    drafts = {name: draft_for(name) for name in BAD_LAUNCHES}
    argv = lambda name: ["--model-path", str(smol["path"]), *dflash_args(drafts[name], *BAD_LAUNCHES[name][1])]  # noqa: E731

    def launch(name):
        r = subprocess.run([sys.executable, "-m", "sglang_dflash.cli", "serve", *argv(name)], capture_output=True,
                           text=True, timeout=300)
        return r.returncode, r.stdout + r.stderr

    judged = [name for name in BAD_LAUNCHES if name not in LAUNCHED] + ["block size"]
    cases = [argv(name) for name in judged] + [["--model-path", str(smol["path"]), *dflash_args(smol["draft"])]]

    def judge():
        r = subprocess.run([sys.executable, str(Path(__file__).parent / "launch_refusals.py")], input=json.dumps(cases),
                           env=serve_setup([])[1], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout)

    with ThreadPoolExecutor(3) as pool:
        verdicts = pool.submit(judge)
        launched = dict(zip(LAUNCHED, pool.map(launch, LAUNCHED)))
        verdicts = verdicts.result()
    *refused, block_size_again, good = verdicts
    assert good is None, f"the judge refused a good launch: {good}"
    launched_out = launched["block size"][1]
    assert block_size_again and block_size_again in launched_out, (block_size_again, launched_out[-3000:])
    out = {name: (drafts[name], *launched[name]) for name in LAUNCHED}
    out.update({name: (drafts[name], 1 if why else 0, why or "") for name, why in zip(judged, refused)})
    return out


@pytest.mark.parametrize("name", BAD_LAUNCHES)
def test_a_bad_draft_or_option_stops_the_server(bad_launches, name):
    """A bad draft or an option the worker cannot honour stops the server at start-up, never half-running,
    with an error that names the problem (LAUNCHED: a server process that exits; the others: the error the
    launch's argument resolution stops with, bad_launches)."""
    draft, returncode, out = bad_launches[name]
    message = BAD_LAUNCHES[name][2]
    assert returncode != 0 and "Uvicorn running" not in out, out[-3000:]
    if message is None:
        assert any(str(draft) in line and "Error" in line for line in out.splitlines()), out[-3000:]
    else:
        assert message in out, out[-3000:]
