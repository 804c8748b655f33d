"""Acceptance rules: greedy on constructed cases; rejection sampling exact by enumeration."""


import torch

from sglang_dflash.accept import accept_greedy, accept_sampled


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
