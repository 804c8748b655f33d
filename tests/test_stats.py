"""The statistical tier's own tests can fail: same-distribution samples pass, a wrong one does not."""

import pytest
import torch

from stats import P_FAIL, chi2_sf, goodness_of_fit

pytestmark = pytest.mark.unit


def draws(probs, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [tuple(x) for x in torch.multinomial(torch.tensor(probs), n * 2, replacement=True, generator=g)
            .view(n, 2).tolist()]


def test_chi2_sf_known_values():
    assert abs(chi2_sf(3.841458820694124, 1) - 0.05) < 1e-9
    assert abs(chi2_sf(18.307038053275146, 10) - 0.05) < 1e-9


def test_same_distribution_passes_and_a_shifted_one_fails():
    p = [0.4, 0.3, 0.2, 0.05, 0.05]
    q = [0.3, 0.4, 0.2, 0.05, 0.05]
    exact = {(a, b): p[a] * p[b] for a in range(5) for b in range(5)}
    for seed in range(5):
        assert goodness_of_fit(draws(p, 2000, seed), exact) > P_FAIL
    assert goodness_of_fit(draws(q, 2000, 7), exact) < P_FAIL
