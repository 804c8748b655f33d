"""χ² tests for the statistical tier (issue 6): do sampled outputs follow a given distribution?

Categories are whole outcomes (e.g. the first three generated tokens); rare ones are pooled into
one "other" bin so that every expected count is large enough for the χ² approximation. Each
function returns the p-value; the tests fail below P_FAIL, so that a family of up to 100 such
tests fails by chance with probability under 1e-4.
"""

from __future__ import annotations

from collections import Counter

import torch

P_FAIL = 1e-6


def chi2_sf(stat: float, df: int) -> float:
    """P(χ²_df >= stat): the regularised upper incomplete gamma function Q(df/2, stat/2)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def goodness_of_fit(samples: list, probs: dict, min_expected: float = 5.0) -> float:
    """samples against an exact distribution given for some outcomes (probs: outcome -> probability,
    the rest of the mass is 'other'). Outcomes expected fewer than min_expected times are pooled."""
    n = len(samples)
    counts = Counter(samples)
    bins = [o for o, p in probs.items() if n * p >= min_expected]
    observed = [counts[o] for o in bins]
    expected = [n * probs[o] for o in bins]
    other_p = max(0.0, 1.0 - sum(probs[o] for o in bins))
    if n * other_p >= min_expected:
        observed.append(n - sum(observed))
        expected.append(n * other_p)
    elif n - sum(observed) > 0.01 * n + 10:
        return 0.0  # outcomes the distribution says are (nearly) impossible keep turning up
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return chi2_sf(stat, len(observed) - 1)


@torch.no_grad()
def exact_paths(model, prompt_ids: list[int], depth: int, filt, min_prob: float) -> dict[tuple, float]:
    """The exact probability of every path of depth tokens whose probability is at least min_prob,
    sampling each token from filt(logits [N, V]) -> probs [N, V] (the request's temperature and
    filters). Breadth-first: a path below min_prob has no descendant above it."""
    frontier: dict[tuple, float] = {(): 1.0}
    for _ in range(depth):
        prefixes = list(frontier)
        ids = torch.tensor([prompt_ids + list(p) for p in prefixes])
        probs = filt(model(ids).logits[:, -1].float()).double()
        nxt = {}
        for pref, row in zip(prefixes, probs):
            mass = frontier[pref] * row
            for t in (mass >= min_prob).nonzero().flatten().tolist():
                nxt[pref + (t,)] = float(mass[t])
        frontier = nxt
    return frontier
