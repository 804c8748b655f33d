"""step_stats.py: the worker's step statistics, off by default and counted in memory when on; and
window.py's step clock."""

import json

import pytest
import torch

from sglang_dflash.step_stats import NO_STATS, StepStats
from sglang_dflash.window import AdaptiveWindow

pytestmark = pytest.mark.unit


def test_off_costs_nothing_and_records_nothing():
    with NO_STATS.phase("verify"):
        pass
    NO_STATS.record(torch.tensor([1, 2]), 4)  # no file, no state
    assert not hasattr(NO_STATS, "accept_hist")


@pytest.mark.parametrize("profile", [False, True])
def test_on_counts_steps_and_windows_and_times_phases_only_when_profiling(tmp_path, profile):
    path = tmp_path / "stats.json"
    stats = StepStats(str(path), max_window=4, device="cpu", profile=profile)
    with stats.phase("verify"):
        pass
    stats.record(torch.tensor([1, 4, 2]), 4)
    stats.record(torch.tensor([1]), 1)
    written = json.loads(path.read_text())
    assert written["accept_length_histogram"] == [0, 2, 1, 0, 1]
    assert written["accept_length_histogram_by_window"] == [[0] * 5, [0, 1, 0, 0, 0], [0] * 5, [0] * 5, [0, 1, 1, 0, 1]]
    assert written["window_histogram"] == [0, 1, 0, 0, 1] and written["decode_batches"] == 2
    if profile:
        assert written["phase_seconds"].keys() == {"verify"} and written["phase_seconds"]["verify"] >= 0
    else:  # counting alone: no timing, no device sync
        assert "phase_seconds" not in written and stats.phase_seconds == {}
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]  # no temporary file left


def test_the_step_clock_times_decode_steps_only(monkeypatch):
    import sglang_dflash.window as window

    now = [100.0]
    monkeypatch.setattr(window.time, "perf_counter", lambda: now[0])
    policy = AdaptiveWindow(8)
    policy.start_step(4, 8)
    now[0] += 0.25
    policy.end_step(next_is_decode=True)  # measured: start to the next forward's start
    assert policy.buckets[AdaptiveWindow.bucket_of(4)].seconds == {8: 0.25}
    policy.start_step(4, 4)
    now[0] += 5.0
    policy.end_step(next_is_decode=False)  # a prefill came next: its work would be counted, so nothing is
    policy.end_step(next_is_decode=True)  # and nothing is pending any more
    assert policy.buckets[AdaptiveWindow.bucket_of(4)].seconds == {8: 0.25}


def test_an_adaptive_window_writes_what_it_knows(tmp_path):
    """With an adaptive window the file carries the policy's state: a_j, and per batch-size bucket the
    measured anchors' step seconds and the window it would choose (what a bench or a test reads to see
    why a bucket chose its window)."""
    path = tmp_path / "stats.json"
    stats, policy = StepStats(str(path), max_window=4, device="cpu"), AdaptiveWindow(4)
    for k, seconds in ((1, 0.1), (2, 0.3)):
        assert policy.choose(5) == k
        policy.observe_accepts([0] * 5, k)
        policy.observe_step(5, k, seconds)
        stats.record(torch.ones(5, dtype=torch.long), k, policy)
    written = json.loads(path.read_text())["adaptive_window"]
    assert written["buckets"] == {"4-7": {"steps": 2, "best": 1, "seconds": {"1": 0.1, "2": 0.3},
                                          "samples": {"1": 1, "2": 1}, "chosen": {"1": 1, "2": 1}, "recent": [1, 2]}}
    assert written["accept_rate"][0] == 1.0 and written["accept_rate"][1] < 0.1


def test_a_tree_step_counts_the_requests_it_took_beyond_the_chain(tmp_path):
    """Four requests, trees of 6 nodes from the top 2 of each of 4 rows (each row's first choice another
    token): a path of first choices down 4 rows, one through row 1's second choice, a shorter chain, and the root
    alone (nothing accepted). One request went beyond the chain."""
    from sglang_dflash.tree import build_trees

    path = tmp_path / "stats.json"
    stats = StepStats(str(path), max_window=6, device="cpu")
    rows = torch.tensor([[4.0, 3.0, 0.0, 0.0], [3.0, 4.0, 0.0, 0.0], [0.0, 3.0, 4.0, 0.0], [0.0, 0.0, 3.0, 4.0]])
    logprobs = torch.log_softmax(rows, dim=-1).repeat(4, 1, 1)  # [4 requests, 4 rows, V 4]: row d's first is d - 1
    tokens, parents, depths = build_trees(logprobs, 2, 6, torch.tensor([2, 2, 2, 2]))
    # best first: the root; rows 1, 2, 3's first choices; row 1's second; row 4's first
    assert tokens[0].tolist() == [2, 0, 1, 2, 1, 3] and parents[0].tolist() == [-1, 0, 1, 2, 0, 3]
    paths = torch.tensor([[0, 1, 2, 3, 5], [0, 4, 4, 4, 4], [0, 1, 2, 2, 2], [0, 0, 0, 0, 0]])  # padded: last node
    accept_len = torch.tensor([4, 1, 2, 0])
    stats.record_tree(tokens, depths, logprobs, paths, accept_len)
    stats.record(accept_len + 1, 6)
    assert json.loads(path.read_text())["tree_requests_beyond_the_chain"] == 1
    NO_STATS.record_tree(tokens, depths, logprobs, paths, accept_len)  # off: nothing
