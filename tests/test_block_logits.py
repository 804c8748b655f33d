"""A request's logit rules over a verify block: row j must get what SGLang's non-speculative
sampler applies after the output [committed, d_1 … d_j]. The reference is SGLang's own
penalizer orchestrator fed token by token, and a real xgrammar grammar stepped token by token."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.block_logits import apply_rules, penalize, stop_token_ids

pytestmark = pytest.mark.unit

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


def penalized_batch(req, prompt):
    """A one-request batch with the penalizer state SGLang builds for it at prefill (the orchestrator of
    SamplingBatchInfo.from_schedule_batch), the request's prompt in place and no output yet. SGLang passes
    its four penalizers as a set, whose order changes from process to process, and frequency and presence
    penalties subtracted in another order round differently: here they come in block_logits' order."""
    import sglang.srt.sampling.penaltylib as penaltylib

    req.origin_input_ids, req.output_ids = list(prompt), []
    batch = FakeBatch([req])
    batch.sampling_info = SimpleNamespace(penalizer_orchestrator=penaltylib.BatchedPenalizerOrchestrator(
        vocab_size=V, batch=batch, penalizers=[penaltylib.BatchedFrequencyPenalizer,
                                               penaltylib.BatchedMinNewTokensPenalizer,
                                               penaltylib.BatchedPresencePenalizer,
                                               penaltylib.BatchedRepetitionPenalizer]))
    return batch


def sglang_row_logits(req, logits_row, prompt, output_so_far):
    """What SGLang's synchronous scheduler applies to the logits of the token after output_so_far: the
    prefill emits the first output token with nothing cumulated; before each decode step
    prepare_for_decode calls ScheduleBatch.cumulate_penalty_output_tokens, which feeds the penalizers the
    request's output as it then stands (its last token, or the prompt's last when there is no output);
    then the orchestrator applies its penalties."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    batch = penalized_batch(req, prompt)
    for t in output_so_far:  # the token the step before emitted, then the decode step's own prepare
        req.output_ids.append(t)
        ScheduleBatch.cumulate_penalty_output_tokens(batch)
    out = logits_row.clone()[None]
    batch.sampling_info.penalizer_orchestrator.apply(out)
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
    prompt = torch.randint(0, 16, (20,), generator=g).tolist()  # shares tokens with the output and drafts
    logits = torch.randn(B, V, generator=g) * 3
    req = fake_req(output, **params)
    ours = logits.clone()
    penalize(ours, output, torch.cat([torch.tensor([0]), drafts]), torch.arange(-1, B - 1), req.sampling_params,
             stop_token_ids(req))
    for j in range(B):
        ref = sglang_row_logits(req, logits[j], prompt, output + drafts[:j].tolist())
        assert torch.equal(ours[j], ref), f"row {j}: {params}"


def test_sglangs_overlap_schedule_penalizes_the_prompts_last_token():
    """Why the server tests take SGLang's synchronous schedule as the reference under penalties: its overlap
    schedule prepares a decode step before the step before it has been processed, so
    cumulate_penalty_output_tokens finds no output at the first decode step and feeds the penalizers the
    prompt's last token (and later each output token a step late). The DFLASH server is synchronous."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    req = fake_req([], repetition_penalty=2.0)
    batch = penalized_batch(req, [4, 5, 6, 11])
    ScheduleBatch.cumulate_penalty_output_tokens(batch)  # the overlap schedule's first decode step: no output yet
    out = torch.full((1, V), 3.0)
    batch.sampling_info.penalizer_orchestrator.apply(out)
    assert out[0, 11] == 1.5 and out[0, 6] == 3.0 and (out[0] == 3.0).sum() == V - 1


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


def tree_path(parents: list[int], m: int) -> list[int]:
    """The nodes from the root's child down to m (the root, the bonus token, is already output)."""
    path = []
    while m > 0:
        path.append(m)
        m = parents[m]
    return path[::-1]


TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 6]  # node 0 the root; two children of 0, of 1, of 3; depth up to 4


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("seed", range(3))
def test_a_trees_rows_get_sglangs_penalties_for_their_own_paths(params, seed):
    """A tree's node m: the penalties SGLang applies after the output [committed, the tokens on m's path]."""
    g = torch.Generator().manual_seed(seed)
    N = len(TREE_PARENTS)
    output = torch.randint(0, 12, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
    tokens = torch.randint(0, 12, (N,), generator=g)
    prompt = torch.randint(0, 16, (20,), generator=g).tolist()
    logits = torch.randn(N, V, generator=g) * 3
    req = fake_req(output, **params)
    ours = logits.clone()
    penalize(ours, output, tokens, torch.tensor(TREE_PARENTS), req.sampling_params, stop_token_ids(req))
    for m in range(N):
        path_tokens = tokens[tree_path(TREE_PARENTS, m)].tolist()
        assert torch.equal(ours[m], sglang_row_logits(req, logits[m], prompt, output + path_tokens)), (m, params)


def test_a_trees_grammar_rows_follow_their_own_paths(json_grammar):
    """Each node's row: the mask of a fresh grammar stepped along the node's path; a node whose token the
    grammar forbids is masked at its parent's row, and the rows below it are left unconstrained; the grammar
    is rolled back to where the scheduler left it."""
    tok, make = json_grammar
    vocab = len(tok)
    good = tok.encode('{"n": 12}', add_special_tokens=False)
    x = tok.encode("x", add_special_tokens=False)[0]
    # the root (bonus, already output); 1, 2: a forbidden x, then good[0] (a sibling walked after a rejected one);
    # 3, 4 under 2: good[1] and x; 5 under 1 (below a forbidden token); 6, 7 under 3: good[2] and x
    parents = [-1, 0, 0, 2, 2, 1, 3, 3]
    tokens = [0, x, good[0], good[1], x, good[1], good[2], x]
    grammar = make()
    req = fake_req([])
    req.grammar = grammar
    batch = SimpleNamespace(reqs=[req], has_grammar=True,
                            sampling_info=SimpleNamespace(logit_bias=None, has_custom_logit_processor=False))
    logits = torch.zeros(1, len(parents), vocab)
    apply_rules(logits, torch.tensor([tokens]), batch, torch.tensor([parents]))
    for m in (0, 2, 3, 6):  # the nodes every token of whose path the grammar allows
        ref = make()
        for t in tree_path(parents, m):
            ref.accept_token(tokens[t])
        row = ref.allocate_vocab_mask(vocab_size=vocab, batch_size=1, device="cpu")
        ref.fill_vocab_mask(row, 0)
        expect = torch.zeros(1, vocab)
        ref.apply_vocab_mask(expect, row)
        assert torch.equal(logits[0, m], expect[0]), f"node {m}"
    assert all(logits[0, m, x] == float("-inf") for m in (0, 2, 3))  # 1, 4 and 7 can never be accepted
    assert (logits[0, [1, 4, 5, 7]] == 0).all()  # from a forbidden token down: never emitted, left unconstrained
    assert grammar.accepted_tokens == []
    grammar.accept_token(good[0])
