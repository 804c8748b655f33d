"""The statistical tier: sampled output (temperature > 0) from the DFLASH server follows the target's
exact distribution (issue 6), on the session's shared window-4 server (shared_servers.py), and through tree
verification (--speculative-eagle-topk 2) on a server of its own."""

from __future__ import annotations

import pytest
import requests
import torch

from conftest import load_target, random_draft
from server import sglang_server
from shared_servers import STAT_TEXTS, TRAINED_DRAFT, dflash_args, stat_ids
from stats import P_FAIL, exact_paths, goodness_of_fit

pytestmark = pytest.mark.stats

# Each case draws STAT_SAMPLES completions of 3 tokens from the DFLASH server with a verify window of 4
# (on a 2-core AVX2 CPU a case took about 6 minutes with a 16-row verify per request to produce two
# tokens; the accept rule's row count is a parameter that tests/test_accept.py enumerates). The first
# token comes from the prefill; the next two from verify steps, so they go through rejection sampling (a
# step verifies no more rows than the tokens left plus one, worker.rows_used: 3, then 2, each emitted token
# still decided by a row that judges a draft, as in the full window).
# On the "point-mass draft" prompt the oracle plugin proposes the greedy continuation (q is a point mass;
# often accepted); on the "random draft" prompt the random draft samples its own proposals from its q
# (almost always rejected: the residual path). Each case's samples are tested against the exact
# distribution: filtered_probs (the distribution SGLang's own sampler draws from, checked exactly in
# tests/test_accept.py) of the target's logits, enumerated with the HF model in float32 over the paths
# of probability >= 5 / STAT_SAMPLES. Its power at P_FAIL: 5 points of probability moved off the most
# likely path (21 %) of the T=0.7 case are caught with probability 0.99, 4 points 0.77, 3 points 0.18
# (simulated, 200 draws of 2,000). Each case is one request of STAT_SAMPLES prompts: the five sent as
# one request took 755 s, one by one 538 s (filtered_probs sorts every row of a batch in which one row
# has top_p < 1).
STAT_SAMPLES = 2000
STAT_SETTINGS = {"T=0.7": {"temperature": 0.7}, "T=1.0": {"temperature": 1.0},
                 "top_p=0.9": {"temperature": 1.0, "top_p": 0.9}, "top_k=20": {"temperature": 1.0, "top_k": 20},
                 "min_p=0.1": {"temperature": 1.0, "min_p": 0.1}}
# every setting once, the point-mass draft where acceptance is likely, the random draft for the rest
STAT_CASES = [("point-mass draft", "T=0.7"), ("point-mass draft", "top_p=0.9"), ("point-mass draft", "min_p=0.1"),
              ("random draft", "T=1.0"), ("random draft", "top_k=20")]


def sample_many(url: str, ids: list[int], n: int, params: dict) -> tuple[list[tuple], list[dict]]:
    r = requests.post(url + "/generate", timeout=1800, json={
        "input_ids": [ids] * n, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, **params}})
    r.raise_for_status()
    outs = r.json()
    return [tuple(o["output_ids"]) for o in outs], [o["meta_info"] for o in outs]


@pytest.mark.parametrize("prompt,setting", STAT_CASES)
def test_sampled_output_follows_the_target_distribution(smol, window4_url, hf_smol, prompt, setting):
    params = STAT_SETTINGS[setting]
    ids = stat_ids(smol, prompt)
    spec, meta = sample_many(window4_url, ids, STAT_SAMPLES, params)
    exact = exact_paths(hf_smol, ids, 3, exact_for(params), min_prob=5 / STAT_SAMPLES)
    p = goodness_of_fit(spec, exact)
    one_step = sum(m["spec_verify_ct"] == 1 for m in meta) / len(meta)  # both verified tokens in one step
    print(f"{prompt} {setting}: p-value {p:.3g}; {len(set(spec))} distinct outcomes, "
          f"{len(exact)} exact paths >= {5 / STAT_SAMPLES}; first draft accepted in {one_step:.1%} of requests")
    assert all(len(s) == 3 for s in spec) and all(m["spec_verify_ct"] in (1, 2) for m in meta)
    assert p > P_FAIL, p
    if prompt == "point-mass draft":
        assert one_step * STAT_SAMPLES >= 20, "the point-mass proposals were (almost) never accepted: the accept path went untested"


def exact_for(params):
    """The filter of a request's sampling params over logits [n, V]: SGLang's sampler's distribution."""
    from sglang_dflash.accept import filtered_probs

    def filt(logits):
        n, V = logits.shape
        full = lambda v: torch.full((n,), float(v))  # noqa: E731
        return filtered_probs(logits, full(params["temperature"]), full(params.get("top_k", V)).long(),
                              full(params.get("top_p", 1.0)), full(params.get("min_p", 0.0)))
    return filt


def test_tree_verification_samples_the_target_distribution(smol, hf_smol):
    """A tree of 8 nodes from the trained draft's top 2 tokens per row (worker.tree_step): STAT_SAMPLES
    completions of 3 tokens at T = 0.7 follow the target's exact distribution (the walk draws each token from
    the target's distribution at its node and moves to the child holding it, if any: tree.py). The trained
    draft's candidates are often the target's likely tokens, so many walks go through the tree (both verified
    tokens in one step) and the rest leave it at the root."""
    params = {"temperature": 0.7}
    ids = stat_ids(smol, "point-mass draft")
    with sglang_server(smol["path"], *dflash_args(TRAINED_DRAFT, "--speculative-eagle-topk", "2",
                                                  "--max-running-requests", "128", window=8)) as url:
        spec, meta = sample_many(url, ids, STAT_SAMPLES, params)
    exact = exact_paths(hf_smol, ids, 3, exact_for(params), min_prob=5 / STAT_SAMPLES)
    p = goodness_of_fit(spec, exact)
    one_step = sum(m["spec_verify_ct"] == 1 for m in meta) / len(meta)
    print(f"tree of 8 nodes, T=0.7: p-value {p:.3g}; {len(set(spec))} distinct outcomes, {len(exact)} exact paths; "
          f"both verified tokens from one step in {one_step:.1%} of requests")
    assert all(len(s) == 3 for s in spec) and all(m["spec_verify_ct"] in (1, 2) for m in meta)
    assert p > P_FAIL, p
    assert one_step * STAT_SAMPLES >= 20, "the walks (almost) never went through the tree: the tree path went untested"


# ---- the Transformers backend (sglang_dflash.generate), one request at a time -----------------------
HF_SAMPLES = 500


def test_transformers_backend_samples_the_target_distribution(smollm2_path):
    """Temperature 1 through a random draft (its proposals almost always rejected: the residual path):
    HF_SAMPLES two-token outputs follow the target's exact distribution (χ², paths of probability
    >= 5 / HF_SAMPLES enumerated with the same model); a seeded generator gives the same outputs again."""
    from sglang_dflash.generate import spec_generate

    model, tok = load_target(smollm2_path)
    ids = tok(STAT_TEXTS["random draft"]).input_ids
    draft = random_draft(model.config, "smollm2")
    gen_ = torch.Generator().manual_seed(7)
    samples = [tuple(spec_generate(model, draft, torch.tensor(ids), max_new_tokens=2, temperature=1.0,
                                   generator=gen_).tokens) for _ in range(HF_SAMPLES)]
    exact = exact_paths(model, ids, 2, lambda logits: torch.softmax(logits, -1), min_prob=5 / HF_SAMPLES)
    p = goodness_of_fit(samples, exact)
    print(f"spec_generate, T=1: p-value {p:.3g}, {len(set(samples))} distinct outcomes, {len(exact)} exact paths")
    assert p > P_FAIL
    again = torch.Generator().manual_seed(7)
    assert [tuple(spec_generate(model, draft, torch.tensor(ids), max_new_tokens=2, temperature=1.0,
                                generator=again).tokens) for _ in range(20)] == samples[:20]
