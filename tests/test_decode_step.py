"""DFlashWorker.decode_step with stub models in place of SGLang's: build -> draft -> verify -> accept ->
commit, exact and fast, for batches of requests with different prefixes, accept lengths 0 … K-1, a
window shorter than the block, K = 1, and a sampled request beside greedy ones.

The stub target is a rule: after token x at position t comes rule(x, t). Its verify logits are 0 at
that token and -1e4 elsewhere, so greedy and sampled requests (T = 1: p is a point mass) both
follow it exactly. The stub draft proposes the rule's tokens for each request's first `plan` rows
of the block and a wrong token after them, through a real DraftHead (identity weights, so its q is
a point mass too). Each test checks what the step emitted and what it wrote: the tokens, the accept
and sequence lengths, the slots the verify forward wrote, and the draft context rows (position,
slot, features) of exactly the committed positions, nothing else."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.unit

V = 40  # vocabulary; the stubs' hidden width is V too (one-hot rows)
MASK = 39
SCALE = 1e4  # logits 0 at the chosen token, -SCALE elsewhere: softmax is exactly one-hot


def rule(token, position):
    """The stub target's next token after `token` at `position` (tensors or ints), never MASK."""
    return (5 * token + 3 * position + 1) % (V - 1)


def truth(first: int, start: int, n: int) -> list[int]:
    """The target's tokens at positions start … start + n - 1, the one at start being first."""
    out = [first]
    for t in range(start, start + n - 1):
        out.append(int(rule(out[-1], t)))
    return out


class StubDraft:
    """The paged draft's interface: forward_block proposes, write_context records."""

    def __init__(self, plan: dict[int, int], block_size: int):
        self.plan = plan  # req_pool_index -> how many of the block's drafts are right this step
        self.block_size = block_size
        self.writes = []  # (features [N, 2], positions [N], slots [N]) per call
        self.seen = []  # (block tokens [bs, B], positions [bs, B], prefix_lens [bs]) per forward

    def forward_block(self, embeds, positions, req_to_token, req_pool_indices, prefix_lens, max_prefix=None):
        bs, B, H = embeds.shape
        assert B == self.block_size and H == V  # the whole block, whatever the window
        assert max_prefix is None or max_prefix == int(prefix_lens.max())
        tokens = embeds.argmax(-1)  # the one-hot embedding gives the ids back
        self.seen.append((tokens.clone(), positions.clone(), prefix_lens.clone()))
        hidden = torch.zeros(bs, B, V)
        for i in range(bs):
            good = self.plan[int(req_pool_indices[i])]
            want = truth(int(tokens[i, 0]), int(positions[i, 0]), B)
            for j in range(1, B):  # row j proposes the token at position prefix + j
                token = want[j] if j <= good else (want[j] + 1) % (V - 1)
                hidden[i, j, token] = 1.0
        return hidden

    def write_context(self, features, positions, slots):
        self.writes.append((features.clone(), positions.clone(), slots.clone()))


TREE_SCALE = 4.0  # the tree stub draft's head: logits 4 and 3.6 at its two candidates, 0 elsewhere


class StubTreeDraft(StubDraft):
    """Two candidates per block row for a tree: the rule's token and a wrong one, with hidden weights 1.0 and 0.9;
    plan[req_pool_index] lists, for rows 1 … B-1, whether the rule's token is the second candidate (1) or the
    first (0): a chain of first choices stops at the first row whose truth is second."""

    def forward_block(self, embeds, positions, req_to_token, req_pool_indices, prefix_lens, max_prefix=None):
        bs, B, H = embeds.shape
        tokens = embeds.argmax(-1)
        self.seen.append((tokens.clone(), positions.clone(), prefix_lens.clone()))
        hidden = torch.zeros(bs, B, V)
        for i in range(bs):
            second = self.plan[int(req_pool_indices[i])]
            want = truth(int(tokens[i, 0]), int(positions[i, 0]), B)
            for j in range(1, B):
                wrong = (want[j] + 1) % (V - 1)
                hidden[i, j, want[j]], hidden[i, j, wrong] = (0.9, 1.0) if second[j - 1] else (1.0, 0.9)
        return hidden


class StubPool:
    """The target's KV pool: one row per slot, the (token, position) whose K/V the slot holds; SGLang's
    move_kv_cache(tgt, src) copies rows, every source read before any target is written, as its kernels do."""

    def __init__(self, num_slots: int):
        self.kv = torch.full((num_slots, 2), -1)
        self.moves = []  # (tgt, src) per call

    def move_kv_cache(self, tgt_loc, src_loc):
        self.moves.append((tgt_loc.clone(), src_loc.clone()))
        self.kv[tgt_loc.long()] = self.kv[src_loc.long()]


class StubTarget:
    """The target worker's verify forward: logits of the rule at each row; features (token, position), which
    it also writes to the KV pool at the rows' slots."""

    def __init__(self, pool: StubPool):
        self.pool = pool
        self.verified = []  # (input ids [N], positions [N], slots written [N])
        self.spec_infos = []  # the verify inputs

    def forward_batch_generation(self, batch=None, forward_batch=None, is_verify=False):
        assert is_verify and batch is None
        ids, pos = forward_batch.input_ids, forward_batch.positions
        self.verified.append((ids.clone(), pos.clone(), forward_batch.out_cache_loc.clone()))
        self.spec_infos.append(forward_batch.spec_info)
        self.pool.kv[forward_batch.out_cache_loc.long()] = torch.stack([ids, pos], dim=1)
        logits = torch.full((ids.numel(), V), -SCALE)
        logits[torch.arange(ids.numel()), rule(ids, pos)] = 0.0
        hidden = torch.stack([ids.float(), pos.float()], dim=1)  # [N, F = 2]
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits, hidden_states=hidden))


def prepare_for_verify(self, batch, target_worker):
    """DFlashVerifyInput.prepare_for_verify reduced to what the stub target reads (SGLang's builds a
    ForwardBatch for its attention backends); the verify input rides along as the forward batch's spec_info."""
    fb = SimpleNamespace(input_ids=self.draft_token, positions=self.positions, out_cache_loc=batch.out_cache_loc,
                         spec_info=self, mark_forward_metadata_ready=lambda: None)
    return fb, False


@pytest.fixture
def make_worker(monkeypatch):
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    from sglang_dflash.draft_head import DraftHead
    from sglang_dflash.step_stats import NO_STATS
    from sglang_dflash.worker import DFlashWorker

    monkeypatch.setattr(DFlashVerifyInput, "prepare_for_verify", prepare_for_verify)

    def make(block_size: int, window: int, page_size: int, plan: dict, topk: int = 1):
        w = DFlashWorker.__new__(DFlashWorker)  # no SGLang model runner: the stubs stand in for it
        embed = torch.nn.Embedding(V, V)
        embed.weight.data = torch.eye(V)
        draft = StubDraft(plan, block_size) if topk == 1 else StubTreeDraft(plan, block_size)
        pool = StubPool(SLOTS)
        w.__dict__.update(
            _target_worker=StubTarget(pool), model_runner=SimpleNamespace(token_to_kv_pool=pool), server_args=None,
            device="cpu", dtype=torch.float32, block_size=block_size,
            window=window, config=SimpleNamespace(mask_token_id=MASK), page_size=page_size, embed=embed,
            head=DraftHead(torch.eye(V) * (SCALE if topk == 1 else TREE_SCALE), V), draft=draft, tp_size=1,
            adaptive=None, stats=NO_STATS, warned_custom=False, topk=topk, cut_rows=True)
        return w

    return make


SLOTS = 1000 * 16 + 4 * 128  # the KV pool's slots: make_batch's for up to 4 request rows, pages of up to 16


def make_batch(prefix_lens, bonus, pool_indices, sampled, page_size, width=128, left=None):
    """The scheduler's batch at a decode step: committed lengths, bonus tokens, req_to_token rows with
    slots reserved for every position (distinct, page-aligned: slot = page * page_size + offset); each request
    with `left` (or 100) new tokens still to come before its max_new_tokens (one, the bonus, is out)."""
    g = torch.Generator().manual_seed(0)
    rows = max(pool_indices) + 1
    pages = torch.randperm(rows * width // page_size, generator=g).view(rows, width // page_size) + 1000
    req_to_token = (pages[:, :, None] * page_size + torch.arange(page_size)).reshape(rows, width).to(torch.int32)
    bs = len(prefix_lens)
    from sglang_dflash.draft_input import make_draft_input

    temps = torch.tensor([[1.0] if s else [1.0] for s in sampled])
    info = SimpleNamespace(is_all_greedy=not any(sampled), temperatures=temps,
                           top_ks=torch.tensor([V if s else 1 for s in sampled]), top_ps=torch.ones(bs),
                           min_ps=torch.zeros(bs), need_min_p_sampling=False, sampling_seed=None, logit_bias=None,
                           has_custom_logit_processor=False)
    left = left or [100] * bs
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(frequency_penalty=0.0, presence_penalty=0.0,
                                                            repetition_penalty=1.0, min_new_tokens=0,
                                                            max_new_tokens=n + 1), output_ids=[b])
            for n, b in zip(left, bonus)]
    return SimpleNamespace(
        seq_lens=torch.tensor(prefix_lens), seq_lens_cpu=torch.tensor(prefix_lens), seq_lens_sum=sum(prefix_lens),
        req_pool_indices=torch.tensor(pool_indices), req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        spec_info=make_draft_input(torch.tensor(bonus), torch.tensor(prefix_lens)), sampling_info=info,
        reqs=reqs, has_grammar=False,
        return_logprob=False, out_cache_loc=None, batch_size=lambda: bs)


def slot_of(batch, i, position):
    return int(batch.req_to_token_pool.req_to_token[batch.req_pool_indices[i], position])


def run_steps(worker, batch, plans: list[dict[int, int]], windows: list[int] | None = None):
    """Decode steps with each step's plan (and rows verified: the worker's window, or `windows`); after each,
    check it against the rule and carry its result into the batch as the scheduler does. Returns every
    request's emitted tokens."""
    bs = batch.seq_lens.numel()
    emitted = [[] for _ in range(bs)]
    for step, plan in enumerate(plans):
        K = worker.window if windows is None else windows[step]
        worker.draft.plan = plan
        worker.draft.writes.clear()
        worker._target_worker.verified.clear()
        prefix = batch.seq_lens.tolist()
        bonus = batch.spec_info.bonus_tokens.tolist()
        res = worker.decode_step(batch)

        accepted = [min(plan[int(batch.req_pool_indices[i])], K - 1) for i in range(bs)]
        commit = [a + 1 for a in accepted]
        assert res.speculative_num_draft_tokens == K
        assert res.accept_lens.tolist() == commit
        assert res.new_seq_lens.tolist() == [p + c for p, c in zip(prefix, commit)]
        out = res.next_token_ids.view(bs, K)
        for i in range(bs):  # the accepted drafts, then the target's own token: the rule's continuation
            want = truth(bonus[i], prefix[i], commit[i] + 1)[1:]
            assert out[i, :commit[i]].tolist() == want, (i, plan)
            emitted[i] += want
        assert res.next_draft_input.bonus_tokens.tolist() == [e[-1] for e in emitted]
        assert res.next_draft_input.new_seq_lens.tolist() == res.new_seq_lens.tolist()

        # the verify forward: K rows per request at prefix … prefix + K - 1, written to their reserved slots
        (ids, pos, written), = worker._target_worker.verified
        assert pos.view(bs, K).tolist() == [list(range(p, p + K)) for p in prefix]
        assert written.view(bs, K).tolist() == [[slot_of(batch, i, p + j) for j in range(K)]
                                                for i, p in enumerate(prefix)]
        assert ids.view(bs, K)[:, 0].tolist() == bonus
        if K > 1:  # the draft saw [bonus, MASK, …] over its whole block at prefix … prefix + B - 1
            tokens, block_pos, seen_prefix = worker.draft.seen[-1]
            assert tokens[:, 0].tolist() == bonus and bool((tokens[:, 1:] == MASK).all())
            assert block_pos.tolist() == [list(range(p, p + worker.block_size)) for p in prefix]
            assert seen_prefix.tolist() == prefix

        # the draft context: exactly the committed positions prefix … prefix + accepted (bonus + accepted drafts)
        (features, positions, slots), = worker.draft.writes
        rows = [(i, p + j) for i, p in enumerate(prefix) for j in range(commit[i])]
        assert positions.tolist() == [t for _, t in rows]
        assert slots.tolist() == [slot_of(batch, i, t) for i, t in rows]
        row_tokens = [([bonus[i]] + emitted[i][len(emitted[i]) - commit[i]:])[t - prefix[i]] for i, t in rows]
        assert features.tolist() == [[float(tok), float(t)] for tok, (_, t) in zip(row_tokens, rows)]

        batch.seq_lens = res.new_seq_lens
        batch.seq_lens_cpu = res.new_seq_lens.clone()
        batch.seq_lens_sum = int(res.new_seq_lens.sum())
        batch.spec_info = res.next_draft_input
        for req, c in zip(batch.reqs, commit):
            req.output_ids += [0] * c
    return emitted


PREFIXES, BONUS, POOL = [5, 17, 9, 30], [3, 11, 0, 27], [2, 0, 3, 1]  # four requests, in pool rows out of order


@pytest.mark.parametrize("block, window, page", [(8, 8, 1), (8, 4, 1), (8, 8, 4), (16, 5, 16)])
def test_accept_lengths_zero_to_k_minus_one(make_worker, block, window, page):
    """Greedy batch: over three steps every request accepts 0, 1, K-2 and K-1 drafts (and a plan past
    the window is capped at K-1)."""
    plans = [{0: 0, 1: 1, 2: window - 2, 3: window - 1}, {0: window - 1, 1: 0, 2: 1, 3: block},
             {0: 1, 1: window - 1, 2: 0, 3: window - 2}]
    worker = make_worker(block, window, page, plans[0])
    batch = make_batch(PREFIXES, BONUS, POOL, [False] * 4, page)
    emitted = run_steps(worker, batch, plans)
    for i in range(4):  # three steps of one decoding: the target's continuation of the bonus token
        assert emitted[i] == truth(BONUS[i], PREFIXES[i], len(emitted[i]) + 1)[1:]


def test_rows_no_request_can_use_are_not_verified(make_worker):
    """With at most n new tokens left to any request of the batch, a step verifies min(K, n + 1) rows: rows
    0 … n-1 decide the n tokens (row n-1 judging draft n, as in any larger window), row n's bonus is past
    max_new_tokens. The tokens committed up to the limit are the full window's."""
    # plans by pool row (POOL: batch position 0 is row 2, 1 row 0, 2 row 3, 3 row 1): the requests with 9 left
    # accept 7 drafts (8 tokens), so 1 is left to any request (2 rows), then none (1 row, a plain decode step)
    plans = [{0: 7, 1: 7, 2: 7, 3: 1}, {0: 7, 1: 0, 2: 7, 3: 7}, {0: 7, 1: 7, 2: 7, 3: 7}]
    worker = make_worker(8, 8, 1, plans[0])
    batch = make_batch(PREFIXES, BONUS, POOL, [False, True, False, False], 1, left=[9, 3, 2, 9])
    emitted = run_steps(worker, batch, plans, windows=[8, 2, 1])
    full = make_worker(8, 8, 1, plans[0])
    long = run_steps(full, make_batch(PREFIXES, BONUS, POOL, [False, True, False, False], 1), plans[:2])
    for i, n in enumerate([9, 3, 2, 9]):
        assert emitted[i][:n] == long[i][:n] and len(emitted[i]) >= n


def test_window_of_one_is_a_plain_decode_step(make_worker):
    """K = 1: no draft forward, one verify row per request, one token committed."""
    worker = make_worker(8, 1, 1, {0: 5, 1: 5, 2: 5, 3: 5})
    batch = make_batch(PREFIXES, BONUS, POOL, [False, True, False, False], 1)
    run_steps(worker, batch, [{0: 5, 1: 5, 2: 5, 3: 5}] * 2)
    assert worker.draft.seen == []


def test_sampled_and_greedy_requests_in_one_batch(make_worker):
    """Rejection sampling for the sampled requests (point masses: exact), argmax for the greedy ones
    (their q is a point mass too), in the same step."""
    plans = [{0: 0, 1: 2, 2: 7, 3: 3}, {0: 7, 1: 0, 2: 4, 3: 1}]
    worker = make_worker(8, 8, 1, plans[0])
    batch = make_batch(PREFIXES, BONUS, POOL, [True, False, True, False], 1)
    run_steps(worker, batch, plans)


def test_no_instrumentation_runs_when_statistics_are_off(make_worker, monkeypatch):
    """Statistics off (the default): a decode step opens no file, reads no clock and syncs no device for them."""
    import builtins

    import sglang_dflash.step_stats as step_stats

    def forbidden(*args, **kwargs):
        raise AssertionError("instrumentation ran with statistics off")

    monkeypatch.setattr(step_stats.time, "perf_counter", forbidden)
    monkeypatch.setattr(step_stats.torch.cuda, "synchronize", forbidden)
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda *a, **k: forbidden() if "stats" in str(a[0]) else real_open(*a, **k))
    worker = make_worker(8, 8, 1, {0: 2, 1: 7, 2: 0, 3: 4})
    batch = make_batch(PREFIXES, BONUS, POOL, [False] * 4, 1)
    run_steps(worker, batch, [{0: 2, 1: 7, 2: 0, 3: 4}] * 2)


def run_tree_steps(worker, batch, plans: list[dict], budgets: list[int] | None = None):
    """Tree decode steps (topk > 1) with each step's plan, and node budget (the worker's window, or what its
    adaptive policy was made to choose: budgets); after each, check it against the rule and the tree the step
    should have built, and carry its result into the batch as the scheduler does. A budget of one node is a
    plain decode step: the tree of the root alone."""
    from sglang_dflash.tree import TREE_MASK_ATTR, accept_tree_greedy, ancestor_mask, build_tree

    bs = batch.seq_lens.numel()
    req_to_token = batch.req_to_token_pool.req_to_token
    accepted_all, paths_all = [], []
    for step, plan in enumerate(plans):
        N = worker.window if budgets is None else budgets[step]
        worker.draft.plan = plan
        worker.draft.writes.clear()
        worker.draft.seen.clear()
        worker._target_worker.verified.clear()
        worker._target_worker.spec_infos.clear()
        prefix = batch.seq_lens.tolist()
        bonus = batch.spec_info.bonus_tokens.tolist()
        rows_before = req_to_token.clone()
        res = worker.decode_step(batch)

        # the tree each request should have built: its draft rows' distributions, the top 2 per row
        expected = []
        for i in range(bs):
            want = truth(bonus[i], prefix[i], worker.block_size)
            second = plan[int(batch.req_pool_indices[i])]
            logits = torch.zeros(N - 1, V)
            for j in range(1, N):
                wrong = (want[j] + 1) % (V - 1)
                logits[j - 1, want[j]], logits[j - 1, wrong] = ((0.9, 1.0) if second[j - 1] else (1.0, 0.9))
            tree = build_tree(torch.log_softmax(logits * TREE_SCALE, -1), worker.topk, N, bonus[i])
            target_next = rule(tree.tokens, prefix[i] + tree.depths)
            path, _ = accept_tree_greedy(tree, target_next)
            expected.append((tree, path))
        commit = [len(path) for _, path in expected]
        accepted_all.append([c - 1 for c in commit])
        paths_all.append([path for _, path in expected])
        assert res.speculative_num_draft_tokens == N and res.accept_lens.tolist() == commit
        assert res.new_seq_lens.tolist() == [p + c for p, c in zip(prefix, commit)]
        out = res.next_token_ids.view(bs, N)
        for i in range(bs):  # the path's drafts, then the target's own token: the rule's continuation
            assert out[i, :commit[i]].tolist() == truth(bonus[i], prefix[i], commit[i] + 1)[1:], (i, plan)

        # the verify forward: the tree's nodes at prefix + depth, written to the slots of prefix … prefix + N - 1,
        # each seeing its ancestors
        (ids, pos, written), = worker._target_worker.verified
        assert ids.view(bs, N).tolist() == [t.tokens.tolist() for t, _ in expected]
        assert pos.view(bs, N).tolist() == [(p + t.depths).tolist() for p, (t, _) in zip(prefix, expected)]
        window = [rows_before[batch.req_pool_indices[i], p: p + N] for i, p in enumerate(prefix)]
        assert written.view(bs, N).tolist() == [w.tolist() for w in window]
        mask = getattr(worker._target_worker.spec_infos[0], TREE_MASK_ATTR, None)
        if N > 1:
            assert torch.equal(mask, torch.stack([ancestor_mask(t.parents) for t, _ in expected]))
        else:  # the chain's plain step: no draft forward, no tree mask
            assert mask is None and not worker.draft.seen

        # the accepted path's K/V at the committed positions. Page size 1: it stays where it was written, position
        # prefix + j now holds the slot node path[j] was verified in; the window keeps every one of its slots (the
        # rest for the next step); nothing else moved. Pages: req_to_token is untouched and the K/V is copied.
        pool, moves = worker.model_runner.token_to_kv_pool, worker.model_runner.token_to_kv_pool.moves
        after = req_to_token.clone()
        if worker.page_size == 1:
            for i, p in enumerate(prefix):
                r = int(batch.req_pool_indices[i])
                path = expected[i][1]
                assert after[r, p: p + len(path)].tolist() == window[i][path].tolist()
                assert sorted(after[r, p: p + N].tolist()) == sorted(window[i].tolist())
                after[r, p: p + N] = rows_before[r, p: p + N]
            assert not moves
        else:  # one copy per step, of the accepted nodes that are not at their place already
            assert len(moves) == step + 1
            tgt, src = moves[-1]
            want = [(int(w[j]), int(w[node])) for w, (_, path) in zip(window, expected)
                    for j, node in enumerate(path) if node != j]
            assert list(zip(tgt.tolist(), src.tolist())) == want
        assert torch.equal(after, rows_before)
        for i, p in enumerate(prefix):  # each committed position's slot holds its token's K/V, at its position
            want = truth(bonus[i], p, commit[i])
            assert [pool.kv[slot_of(batch, i, p + j)].tolist() for j in range(commit[i])] == \
                [[want[j], p + j] for j in range(commit[i])], (i, expected[i][1])

        # the draft context: exactly positions prefix … prefix + accepted, at their new slots, with the features
        # (token, position) of the path's nodes as the verify computed them
        (features, positions, slots), = worker.draft.writes
        rows = [(i, p + j) for i, p in enumerate(prefix) for j in range(commit[i])]
        assert positions.tolist() == [t for _, t in rows]
        assert slots.tolist() == [slot_of(batch, i, t) for i, t in rows]
        assert features.tolist() == [[float(truth(bonus[i], prefix[i], t - prefix[i] + 1)[-1]), float(t)]
                                     for i, t in rows]

        batch.seq_lens = res.new_seq_lens
        batch.seq_lens_cpu = res.new_seq_lens.clone()
        batch.seq_lens_sum = int(res.new_seq_lens.sum())
        batch.spec_info = res.next_draft_input
    return accepted_all, paths_all


TREE_PLANS = [  # per request (pool row): for block rows 1 … 7, whether the rule's token is the second candidate
    {0: [0] * 7, 1: [1, 0, 0, 0, 0, 0, 0], 2: [0, 1, 0, 1, 0, 0, 0], 3: [1, 1, 1, 1, 1, 1, 1]},
    {0: [1, 0, 1, 0, 0, 0, 0], 1: [0] * 7, 2: [1, 1, 0, 0, 0, 0, 0], 3: [0, 0, 0, 1, 0, 0, 0]},
    {0: [0, 0, 1, 1, 0, 0, 0], 1: [0, 1, 1, 0, 0, 0, 0], 2: [0] * 7, 3: [1, 0, 0, 0, 0, 0, 0]},
]


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("sampled", [[False] * 4, [True, False, True, False]])
def test_tree_steps_accept_past_a_wrong_first_choice(make_worker, sampled, page):
    """--speculative-eagle-topk 2 with 8 nodes: three steps of four requests, greedy, and sampled beside greedy
    (the stub target's distributions are point masses: exact for both), with pages of 1 and 4 slots. Where the
    rule's token is a row's second candidate, the chain of first choices would stop there; the tree goes on past
    it when its budget holds that branch. Checked per step: the tree built, the verify rows, the tokens and
    lengths, the path's K/V at the committed positions (page size 1: its slots permuted into place; pages: copied)
    and the draft context written."""
    worker = make_worker(8, 8, page, TREE_PLANS[0], topk=2)
    batch = make_batch(PREFIXES, BONUS, POOL, sampled, page)
    accepted, paths = run_tree_steps(worker, batch, TREE_PLANS)
    assert any(list(path) != list(range(len(path))) for step in paths for path in step)  # some path had to move
    chain = [[next((j for j, s in enumerate(plan[r]) if s), 7) for r in POOL] for plan in TREE_PLANS]
    assert any(a > c for step_a, step_c in zip(accepted, chain) for a, c in zip(step_a, step_c)), (accepted, chain)
    assert all(a >= c for step_a, step_c in zip(accepted, chain) for a, c in zip(step_a, step_c) if c <= 2)


def test_an_adaptive_tree_budget_steps_through_the_budgets_it_chooses(make_worker, monkeypatch):
    """--speculative-eagle-topk 2 with --speculative-adaptive: the policy's budget of each step (made to be 1,
    4, 8, 2 here) is the tree's node count, 1 a plain decode step; each step is the tree of that budget, checked
    as the fixed budget's are, and the policy is told which nodes each step's requests accepted (the first N of
    the best-first order, so the smaller budgets' acceptance too)."""
    from sglang_dflash.window import AdaptiveWindow

    worker = make_worker(8, 8, 1, TREE_PLANS[0], topk=2)
    worker.adaptive = policy = AdaptiveWindow(8, chain=False)
    budgets, observed = [1, 4, 8, 2], []
    chosen = iter(budgets)
    monkeypatch.setattr(policy, "choose", lambda bs: next(chosen))
    monkeypatch.setattr(policy, "observe_nodes", lambda accepted, requests, k: observed.append((accepted, requests, k)))
    batch = make_batch(PREFIXES, BONUS, POOL, [False] * 4, 1)
    accepted, paths = run_tree_steps(worker, batch, TREE_PLANS + TREE_PLANS[:1], budgets)
    assert [k for _, _, k in observed] == budgets and all(n == 4 for _, n, _ in observed)
    assert observed[0][0] == [] and accepted[0] == [0] * 4  # the plain step: nothing drafted
    for (nodes, _, N), step_paths in zip(observed, paths):  # node j: the requests whose path holds it
        assert nodes == [sum(j in path for path in step_paths) for j in range(1, N)], (nodes, step_paths)
    assert max(accepted[2]) > 1  # the tree of 8 went deeper than one draft
