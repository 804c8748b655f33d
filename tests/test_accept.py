"""Acceptance rules: greedy on constructed cases; rejection sampling exact by enumeration."""


import functools
import itertools

import pytest
import torch

from sglang_dflash.accept import accept_greedy, accept_sampled, rejection_tables

pytestmark = pytest.mark.unit


def one_hot_logits(tokens, vocab):
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()[None]


def test_accept_greedy_prefix_and_bonus():
    V = 10
    target = one_hot_logits([3, 4, 5, 6], V)  # target argmax after each block position
    cases = {(3, 4, 5): (3, 6), (3, 4, 9): (2, 5), (3, 9, 5): (1, 4), (9, 4, 5): (0, 3)}
    for drafts, (n, nxt) in cases.items():
        acc, bonus = accept_greedy(torch.tensor([drafts]), target)
        assert (int(acc), int(bonus)) == (n, nxt), drafts


def test_accept_greedy_batch_rows_are_independent():
    V = 8
    target = torch.cat([one_hot_logits([1, 2, 3], V), one_hot_logits([4, 5, 6], V)])
    acc, bonus = accept_greedy(torch.tensor([[1, 2], [4, 0]]), target)
    assert acc.tolist() == [2, 1] and bonus.tolist() == [3, 5]


def exact_first_token_distribution(p, q):
    """P(first committed token = v) under accept_sampled, by enumerating the draft's first token
    and the accept/reject outcome (u is uniform, so acceptance has probability min(1, p/q))."""
    V = p.shape[-1]
    dist = torch.zeros(V, dtype=torch.float64)
    for d in range(V):
        a = min(1.0, float(p[0, d] / q[0, d])) if q[0, d] > 0 else 0.0
        dist[d] += q[0, d] * a
        residual = (p[0] - q[0]).clamp_min(0)
        if residual.sum() > 0:
            dist += q[0, d] * (1 - a) * residual / residual.sum()
    return dist


def test_rejection_sampling_first_token_is_exactly_target():
    """By enumeration of the draft's first token and the accept/reject outcome, the first
    committed token is distributed exactly as p_1, for random p and q."""
    torch.manual_seed(0)
    V = 5
    for _ in range(20):
        p = torch.softmax(torch.randn(2, V, dtype=torch.float64) * 2, -1)
        q = torch.softmax(torch.randn(1, V, dtype=torch.float64) * 2, -1)
        assert torch.allclose(exact_first_token_distribution(p, q), p[0], atol=1e-12)


def test_accept_sampled_matches_target_empirically():
    """The implementation itself (not the analysis above): 200k draws of a 2-token block."""
    g = torch.Generator().manual_seed(1)
    V, N = 3, 200_000
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.2, 0.6], [0.6, 0.3, 0.1]], dtype=torch.float64)
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(2)], 1)
    acc, nxt = accept_sampled(drafts, q.expand(N, -1, -1), p.expand(N, -1, -1), generator=g)
    first = torch.where(acc >= 1, drafts[:, 0], nxt)
    second = torch.where(acc >= 2, drafts[:, 1], torch.where(acc == 1, nxt, -1))
    both = second >= 0
    emp1 = torch.bincount(first, minlength=V).double() / N
    assert (emp1 - p[0]).abs().max() < 0.006  # > 5 sigma of a 200k-sample frequency
    emp2 = torch.bincount(second[both & (first == 1)], minlength=V).double() / (both & (first == 1)).sum()
    assert (emp2 - p[1]).abs().max() < 0.01
    assert set(acc.unique().tolist()) == {0, 1, 2}


def random_tables(V: int, seed: int):
    """p(. | prefix) of a random target and q_i(. | prefix) of a random draft, with zeros (top-k-style
    truncation in p, tokens the draft never proposes in q), float64."""
    g = torch.Generator().manual_seed(seed)

    @functools.cache
    def dist(key):
        logits = torch.randn(V, generator=g, dtype=torch.float64) * 2
        logits[torch.rand(V, generator=g) < 0.25] = -torch.inf
        if torch.isinf(logits).all():
            logits[0] = 0.0
        return torch.softmax(logits, -1)

    return (lambda prefix: dist(("p", prefix))), (lambda prefix, i: dist(("q", prefix, i)))


def exact_output_distribution(p_of, q_of, B: int, V: int, L: int) -> dict:
    """The exact law of the first L generated tokens when every step drafts B-1 tokens independently
    from q_i(. | committed prefix), and rejection_tables decides what is committed; by enumerating
    every draft and every accept/stop outcome (no sampling)."""

    @functools.cache
    def from_prefix(prefix):
        if len(prefix) >= L:
            return {prefix[:L]: 1.0}
        out = {}
        for drafts in itertools.product(range(V), repeat=B - 1):
            q = torch.stack([q_of(prefix, i) for i in range(B - 1)])
            p_drafts = float(torch.prod(q[torch.arange(B - 1), list(drafts)]))
            if p_drafts == 0:
                continue
            p = torch.stack([p_of(prefix + drafts[:i]) for i in range(B)])
            accept, stop = rejection_tables(torch.tensor([drafts]), q[None], p[None])
            reach = 1.0  # probability that the first k drafts were accepted
            for k in range(B):
                p_stop_here = reach * (1 - float(accept[0, k])) if k < B - 1 else reach
                for x in range(V):
                    w = p_drafts * p_stop_here * float(stop[0, k, x])
                    if w > 0:
                        for seq, pr in from_prefix(prefix + drafts[:k] + (x,)).items():
                            out[seq] = out.get(seq, 0.0) + w * pr
                if k < B - 1:
                    reach *= float(accept[0, k])
        return out

    return from_prefix(())


@pytest.mark.parametrize("B", [2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_sampling_is_exact_by_enumeration(B, seed):
    """For random prefix-dependent p and q (with zeros), the law of the first 4 generated tokens under
    draft -> rejection_tables -> commit, repeated, equals the target's own autoregressive law."""
    V, L = 3, 4
    p_of, q_of = random_tables(V, seed)
    got = exact_output_distribution(p_of, q_of, B, V, L)
    for seq in itertools.product(range(V), repeat=L):
        want = 1.0
        for j in range(L):
            want *= float(p_of(seq[:j])[seq[j]])
        assert abs(got.get(seq, 0.0) - want) < 1e-12, (seq, got.get(seq, 0.0), want)
    assert abs(sum(got.values()) - 1) < 1e-12


# ---- seeded requests ----------------------------------------------------------------------------
def seeded_step(p, q, seeds, start):
    """One block for each seed: drafts drawn from q with the seeded uniforms, then accept_sampled."""
    from sglang_dflash.accept import SALT_DRAFT, sample_inverse_cdf, seeded_uniform

    n = seeds.numel()
    B = p.shape[0]
    positions = start.view(-1, 1) + torch.arange(B)[None]  # [n, B]
    qn, pn = q.expand(n, -1, -1), p.expand(n, -1, -1)
    drafts = sample_inverse_cdf(qn, seeded_uniform(seeds, positions[:, 1:], SALT_DRAFT))
    acc, nxt = accept_sampled(drafts, qn, pn, seeds=seeds, positions=positions)
    return drafts, acc, nxt


def test_seeded_uniform_is_uniform_and_keyed_by_seed_position_and_salt():
    from sglang_dflash.accept import seeded_uniform
    from stats import P_FAIL, goodness_of_fit

    seeds = torch.arange(1000).repeat_interleave(100)
    positions = torch.arange(100).repeat(1000).view(-1, 1)
    u = seeded_uniform(seeds, positions, 1).flatten()
    assert 0 < u.min() and u.max() < 1 and u.unique().numel() > 99_000
    bins = (u * 50).long().tolist()
    assert goodness_of_fit(bins, {b: 1 / 50 for b in range(50)}) > P_FAIL
    assert torch.equal(u, seeded_uniform(seeds, positions, 1).flatten())
    assert not torch.equal(u, seeded_uniform(seeds, positions, 2).flatten())
    assert not torch.equal(u, seeded_uniform(seeds + (1 << 40), positions, 1).flatten())  # the seed's high bits count


def test_seeded_requests_are_reproducible_in_any_batch_and_follow_the_target():
    """The same (seed, position) gives the same tokens whatever its row in the batch; over 20k seeds
    the first committed token is distributed as p_1 (seeded draws are still exact)."""
    from stats import P_FAIL, goodness_of_fit

    g = torch.Generator().manual_seed(3)
    V, B, N = 6, 4, 20_000
    p = torch.softmax(torch.randn(B, V, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(B - 1, V, generator=g, dtype=torch.float64) * 2, -1)
    seeds = torch.randint(0, 1 << 62, (N,), generator=g)
    start = torch.randint(0, 1000, (N,), generator=g)
    drafts, acc, nxt = seeded_step(p, q, seeds, start)
    perm = torch.randperm(N, generator=g)
    d2, a2, n2 = seeded_step(p, q, seeds[perm], start[perm])
    assert torch.equal(d2, drafts[perm]) and torch.equal(a2, acc[perm]) and torch.equal(n2, nxt[perm])
    first = torch.where(acc >= 1, drafts[:, 0], nxt).tolist()
    assert goodness_of_fit(first, {t: float(p[0, t]) for t in range(V)}) > P_FAIL
    assert set(acc.unique().tolist()) == set(range(B))


def test_top_p_on_the_sorted_head_equals_the_full_sort(monkeypatch):
    """filtered_probs sorts only the 1024 most likely tokens when that provably keeps the same set;
    on peaked rows (head path) and flat rows (full sort) it equals the full-sort result."""
    import sglang_dflash.accept as accept

    g = torch.Generator().manual_seed(5)
    V, N = 5000, 24
    logits = torch.randn(N, V, generator=g) * torch.tensor([8.0] * 12 + [0.3] * 12)[:, None]  # peaked, flat
    T = torch.ones(N)
    for top_ks, top_ps in ((torch.full((N,), V), torch.full((N,), 0.9)),
                           (torch.randint(1, 2000, (N,), generator=g), torch.rand(N, generator=g)),
                           (torch.full((N,), 20), torch.full((N,), 0.95))):
        for rows in (slice(0, 12), slice(0, N)):  # the head path alone, and a batch that needs the full sort
            got = accept.filtered_probs(logits[rows], T[rows], top_ks[rows], top_ps[rows], torch.full((N,), 0.01)[rows])
            monkeypatch.setattr(accept, "SORT_HEAD", V)
            want = accept.filtered_probs(logits[rows], T[rows], top_ks[rows], top_ps[rows], torch.full((N,), 0.01)[rows])
            monkeypatch.undo()
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
            assert torch.equal(got > 0, want > 0)


def test_filtered_probs_is_the_distribution_sglangs_sampler_draws_from():
    """filtered_probs (the target's distribution in every accept rule) equals what SGLang's torch sampler
    (the CPU server's) draws from: softmax(logits / T), then its top-k, top-p and min-p filter, read back
    with return_filtered_probs and renormalised, for each setting alone and mixed per row (no ties: at an
    exact tie with the k-th token SGLang keeps k by sort order, filtered_probs all of them). With this,
    the statistical tier tests DFLASH's samples against filtered_probs of the target's exact logits."""
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    from sglang_dflash.accept import filtered_probs

    g = torch.Generator().manual_seed(11)
    V, N = 3000, 32
    logits = torch.randn(N, V, generator=g) * torch.linspace(0.3, 8.0, N)[:, None]  # flat to peaked rows
    full = lambda v, dtype=torch.float32: torch.full((N,), v, dtype=dtype)  # noqa: E731
    settings = {"T=0.7": (full(0.7), full(V, torch.long), full(1.0), full(0.0)),
                "top_p=0.9": (full(1.0), full(V, torch.long), full(0.9), full(0.0)),
                "top_k=20": (full(1.0), full(20, torch.long), full(1.0), full(0.0)),
                "min_p=0.1": (full(1.0), full(V, torch.long), full(1.0), full(0.1)),
                "mixed": (torch.rand(N, generator=g) + 0.3, torch.randint(1, V, (N,), generator=g),
                          torch.rand(N, generator=g), torch.rand(N, generator=g) * 0.3)}
    for name, (T, top_ks, top_ps, min_ps) in settings.items():
        probs = torch.softmax(logits / T[:, None], dim=-1)
        _, weights, index, _ = top_k_top_p_min_p_sampling_from_probs_torch(
            probs.clone(), top_ks, top_ps, min_ps, bool((min_ps > 0).any()), None, torch.zeros(N, dtype=torch.long),
            return_filtered_probs=True)
        sglang = torch.zeros_like(probs).scatter_(-1, index.long(), weights)
        sglang /= sglang.sum(-1, keepdim=True)
        ours = filtered_probs(logits, T, top_ks, top_ps, min_ps)
        # a token of probability above 1e-7 kept by one and not the other fails this; below it, SGLang's
        # float32 cumulative sum passes 1 in the tail of a flat row and drops tokens even at top_p 1
        torch.testing.assert_close(ours, sglang, rtol=1e-5, atol=1e-7, msg=name)


def test_target_rows_are_formed_only_where_acceptance_reaches():
    """accept_sampled_rows asks for row j's target distribution only for the requests that accepted
    every draft before it; the result equals accept_sampled's with all of p given."""
    from sglang_dflash.accept import accept_sampled_rows

    b, B, V = 64, 6, 5
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(b, B, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(b, B - 1, V, generator=g) * 2, -1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(b, B - 1)
    asked = []

    def p_row(j, rows):
        asked.append((j, rows.tolist()))
        return p[rows, j]
    got = accept_sampled_rows(drafts, q, p_row, generator=torch.Generator().manual_seed(7))
    want = accept_sampled(drafts, q, p, generator=torch.Generator().manual_seed(7))
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    acc = got[0]
    for j, rows in asked:
        assert rows == [i for i in range(b) if acc[i] >= j], j
    assert sum(len(r) for _, r in asked) == int((acc + 1).sum())  # one row per decision, not b × B


def test_draw_follows_the_distribution_and_never_takes_a_zero():
    """accept.draw (inverse CDF) against exact probabilities: rows that need not sum to 1, zeros at both ends and
    inside, one row a point mass; a χ² goodness of fit per row over 20,000 draws, never a zero-probability token
    (even at u = 1, the top of the range), and the same draws again from the same generator."""
    from sglang_dflash.accept import draw, sample_inverse_cdf
    from stats import P_FAIL, goodness_of_fit

    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 2.0, 0.0],  # a point mass, unnormalised
                          [1.0, 3.0, 0.0, 0.0, 0.0, 4.0]])
    n = 20_000
    tokens = draw(probs[:, None].expand(3, n, 6), torch.Generator().manual_seed(3))  # [3, n]
    for row, drawn in zip(probs, tokens):
        exact = {(v,): float(row[v] / row.sum()) for v in range(6) if row[v] > 0}
        assert set(drawn.unique().tolist()) <= {v for (v,) in exact}
        assert goodness_of_fit([(int(t),) for t in drawn], exact) > P_FAIL
    assert torch.equal(draw(probs[:, None].expand(3, n, 6), torch.Generator().manual_seed(3)), tokens)
    top = sample_inverse_cdf(probs, torch.ones(3, dtype=torch.float64))  # u = 1: the last token with mass
    assert top.tolist() == [4, 4, 5]
