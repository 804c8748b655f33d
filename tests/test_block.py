"""The block vocabulary (sglang_dflash/block.py) against definitions written out by hand."""

import pytest
import torch

from sglang_dflash.block import accepted_counts, accepted_prefix, acceptance_by_row, make_block

pytestmark = pytest.mark.unit


def test_make_block():
    ids, positions = make_block(torch.tensor([5, 9]), torch.tensor([0, 12]), 4, mask_token_id=2)
    assert ids.tolist() == [[5, 2, 2, 2], [9, 2, 2, 2]]
    assert positions.tolist() == [[0, 1, 2, 3], [12, 13, 14, 15]]
    assert ids.dtype == positions.dtype == torch.int64


@pytest.mark.parametrize("seed", range(3))
def test_accepted_prefix_is_the_count_before_the_first_miss(seed):
    match = torch.rand(64, 7, generator=torch.Generator().manual_seed(seed)) < 0.7
    want = [next((k for k, m in enumerate(row) if not m), len(row)) for row in match.tolist()]
    assert accepted_prefix(match).tolist() == want
    assert accepted_prefix(torch.zeros(3, 0, dtype=torch.bool)).tolist() == [0, 0, 0]  # K = 1: nothing to accept


def test_acceptance_by_row():
    accepted = torch.tensor([0, 1, 1, 3, 0, 2, 3])  # drafts accepted by 7 verify steps of 4 rows
    counts = accepted_counts(accepted, rows=4)
    assert counts == [2, 2, 1, 2]
    assert acceptance_by_row(counts) == pytest.approx([5 / 7, 3 / 7, 2 / 7])  # row k: steps accepting >= k
    assert acceptance_by_row([0, 0, 0]) == [None, None]
    # by window: the same 7 steps of 4 rows, 10 plain decode steps (1 row) and 2 steps of 2 rows that accepted
    # 1 and 0 drafts; row k's rate is over the steps that verified it
    by_window = [[0] * 4, [10, 0, 0, 0], [1, 1, 0, 0], [0] * 4, counts]
    assert acceptance_by_row(by_window) == pytest.approx([6 / 9, 3 / 7, 2 / 7])
    assert acceptance_by_row(torch.tensor(by_window)) == pytest.approx([6 / 9, 3 / 7, 2 / 7])
    assert acceptance_by_row([[0] * 4, [10, 0, 0, 0], [0] * 4, [0] * 4, [0] * 4]) == [None, None, None]
    assert acceptance_by_row([[0] * 4] * 4 + [counts]) == acceptance_by_row(counts)  # one window: as above
