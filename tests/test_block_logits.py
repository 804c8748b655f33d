"""A request's logit rules over a verify block: row j must get what SGLang's non-speculative
sampler applies after the output [committed, d_1 … d_j]. The reference is SGLang's own
penalizer orchestrator fed token by token, and a real xgrammar grammar stepped token by token."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.block_logits import apply_rules, penalize, stop_token_ids

V, B = 64, 6
EOS = 2


def fake_req(output_ids, **params):
    sp = dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0,
              stop_token_ids={5, 7}, logit_bias=None)
    sp.update(params)
    tok = SimpleNamespace(eos_token_id=EOS, additional_stop_token_ids={9})
    return SimpleNamespace(sampling_params=SimpleNamespace(**sp), output_ids=list(output_ids), eos_token_ids={3},
                           tokenizer=tok, grammar=None)


class FakeBatch:  # the orchestrator keeps a weak reference to its batch
    def __init__(self, reqs):
        self.reqs, self.device = reqs, "cpu"


def sglang_row_logits(req, logits_row, output_so_far):
    """What SGLang's non-speculative path applies to one position: a fresh orchestrator for the
    request, each output token cumulated one at a time (as prepare_for_decode does), then apply."""
    import sglang.srt.sampling.penaltylib as penaltylib

    batch = FakeBatch([req])
    orch = penaltylib.BatchedPenalizerOrchestrator(vocab_size=V, batch=batch, penalizers=[
        penaltylib.BatchedFrequencyPenalizer, penaltylib.BatchedMinNewTokensPenalizer,
        penaltylib.BatchedPresencePenalizer, penaltylib.BatchedRepetitionPenalizer])
    for t in output_so_far:
        orch.cumulate_output_tokens(torch.tensor([t]))
    out = logits_row.clone()[None]
    orch.apply(out)
    return out[0]


# Additive penalties commute; the repetition penalty (multiplicative) is tested on its own because
# SGLang keeps its penalizers in a set, so its order against the additive ones is not fixed.
SETTINGS = [
    dict(frequency_penalty=0.5),
    dict(presence_penalty=0.75),
    dict(frequency_penalty=-0.25, presence_penalty=1.0),
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.8),
    dict(min_new_tokens=12),
    dict(min_new_tokens=12, frequency_penalty=1.0),
]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("seed", range(4))
def test_penalties_equal_sglangs_penalizers_row_by_row(params, seed):
    g = torch.Generator().manual_seed(seed)
    n_out = int(torch.randint(1, 14, (1,), generator=g))  # min_new_tokens=12 falls inside some blocks
    output = torch.randint(0, 12, (n_out,), generator=g).tolist()  # a small alphabet: repeats
    drafts = torch.randint(0, 12, (B - 1,), generator=g)
    logits = torch.randn(B, V, generator=g) * 3
    req = fake_req(output, **params)
    ours = logits.clone()
    penalize(ours, output, drafts, req.sampling_params, stop_token_ids(req))
    for j in range(B):
        ref = sglang_row_logits(req, logits[j], output + drafts[:j].tolist())
        assert torch.equal(ours[j], ref), f"row {j}: {params}"


def test_stop_tokens_are_sglangs_set():
    req = fake_req([1], min_new_tokens=4)
    assert stop_token_ids(req) == [2, 3, 5, 7, 9]


def test_apply_rules_adds_logit_bias_to_every_row_after_penalties():
    reqs = [fake_req([4, 4], frequency_penalty=0.5), fake_req([1])]
    bias = torch.zeros(2, V)
    bias[0, 4], bias[1, 8] = 2.0, -1.5
    batch = SimpleNamespace(reqs=reqs, has_grammar=False,
                            sampling_info=SimpleNamespace(logit_bias=bias, has_custom_logit_processor=False))
    logits = torch.zeros(2, B, V)
    block = torch.tensor([[4, 4, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    apply_rules(logits, block, batch)
    assert logits[0, :, 4].tolist() == [2.0 - 0.5 * c for c in (2, 3, 3, 3, 3, 3)]
    assert (logits[1, :, 8] == -1.5).all() and logits[1].abs().sum() == 1.5 * B


@pytest.fixture(scope="module")
def json_grammar(smollm2_path):
    """SGLang's xgrammar backend with SmolLM2's tokenizer, and a compiled JSON schema."""
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    backend = XGrammarGrammarBackend(tok, vocab_size=len(tok))
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                         "additionalProperties": False})

    def make():
        g = backend.dispatch_json(schema)
        return g.result() if hasattr(g, "result") else g
    return tok, make


def test_grammar_rows_follow_the_drafts_and_the_grammar_is_rolled_back(json_grammar):
    tok, make = json_grammar
    vocab = len(tok)
    good = tok.encode('{"n": 12}', add_special_tokens=False)
    bad_at = 2
    drafts = (good[:bad_at] + tok.encode("x", add_special_tokens=False) + good)[: B - 1]
    grammar = make()
    req = fake_req([])
    req.grammar = grammar
    batch = SimpleNamespace(reqs=[req], has_grammar=True,
                            sampling_info=SimpleNamespace(logit_bias=None, has_custom_logit_processor=False))
    logits = torch.zeros(1, B, vocab)
    apply_rules(logits, torch.tensor([[0] + drafts]), batch)
    # the reference: a fresh grammar stepped along the drafts, one mask per position
    ref = make()
    for j in range(bad_at + 1):
        row = ref.allocate_vocab_mask(vocab_size=vocab, batch_size=1, device="cpu")
        ref.fill_vocab_mask(row, 0)
        expect = torch.zeros(1, vocab)
        ref.apply_vocab_mask(expect, row)
        assert torch.equal(logits[0, j], expect[0]), f"row {j}"
        if j < bad_at:
            ref.accept_token(drafts[j])
    assert logits[0, bad_at, drafts[bad_at]] == float("-inf")  # the forbidden draft can never be accepted
    assert (logits[0, bad_at + 1:] == 0).all()  # rows after it are never emitted: left unconstrained
    assert grammar.accepted_tokens == []  # rolled back to where the scheduler left it
    grammar.accept_token(good[0])
