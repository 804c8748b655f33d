"""The adaptive verify window (window.py) against a simulated server whose step costs and acceptance are known."""

from __future__ import annotations

import random

import pytest

from sglang_dflash.window import PRIOR, AdaptiveWindow

pytestmark = pytest.mark.unit


def simulated_step_seconds(bs: int, k: int) -> float:
    """A CPU-like server (SmolLM2's step profile on the 2-core CPU, roughly): a decode step's fixed cost and
    per-request cost, a draft forward for k > 1, a verify growing with its rows."""
    draft = 0.015 + 0.004 * bs if k > 1 else 0.0
    return 0.055 + 0.008 * bs + draft + 0.003 * bs * (k - 1)


ACCEPT = [1.0, 0.7, 0.45, 0.25, 0.12, 0.05, 0.02, 0.01]  # P(at least j drafts accepted), j = 0 … 7


def throughput(bs: int, k: int) -> float:
    """Tokens per second of steps of window k at batch size bs."""
    return bs * (1 + sum(ACCEPT[1:k])) / simulated_step_seconds(bs, k)


def best_window(bs: int, K: int) -> int:
    return max(range(1, K + 1), key=lambda k: throughput(bs, k))


def run(policy: AdaptiveWindow, bs: int, steps: int, rng: random.Random) -> list[int]:
    chosen = []
    for _ in range(steps):
        k = policy.choose(bs)
        chosen.append(k)
        accepted = []
        for _ in range(bs):  # each request accepts a prefix of its k-1 drafts with the ACCEPT rates
            n = 0
            while n < k - 1 and rng.random() < ACCEPT[n + 1] / ACCEPT[n]:
                n += 1
            accepted.append(n)
        policy.observe_accepts(accepted, k)
        policy.observe_step(bs, k, simulated_step_seconds(bs, k) * rng.uniform(0.9, 1.1))
    return chosen


def test_a_bucket_climbs_the_anchors_from_plain_decoding():
    policy = AdaptiveWindow(8)
    firsts = []
    for _ in range(4):  # every draft accepted, every window as costly: each next anchor could win
        firsts.append(policy.choose(4))
        policy.observe_accepts([firsts[-1] - 1] * 4, firsts[-1])
        policy.observe_step(4, firsts[-1], 0.1)
    assert firsts == [1, 2, 4, 8]
    assert policy.choose(4) == 8
    assert policy.bucket_of(4) == policy.bucket_of(7) != policy.bucket_of(8)
    assert policy.choose(8) == 1  # a new bucket starts again from a plain decode step


def bfloat16_cpu_seconds(k: int) -> float:
    """Measured on the 2-core AVX2 CPU (SmolLM2, bfloat16, 16 requests, 2026-12-05): a 1-row step 0.43 s, 2 rows
    1.0 s (the draft forward 0.38 s of it), 16 rows 5.3 s."""
    return 0.43 if k == 1 else 0.62 + 0.31 * (k - 1)


def test_a_weak_draft_stops_the_climb_where_exploring_costs_most():
    """Where a 16-row step costs 12 plain ones, a draft that accepts 2 % of its first rows is tried at 2 rows
    (its acceptance is unknown before) and never at 4 or more; what exploring costs over 2,000 steps is
    under 2 % of the time of decoding alone."""
    rng = random.Random(0)
    policy = AdaptiveWindow(16)
    seconds, chosen = 0.0, []
    for _ in range(2000):
        k = policy.choose(16)
        chosen.append(k)
        policy.observe_accepts([int(k > 1 and rng.random() < 0.02) for _ in range(16)], k)
        policy.observe_step(16, k, bfloat16_cpu_seconds(k))
        seconds += bfloat16_cpu_seconds(k)
    assert max(chosen) == 2 and chosen[:2] == [1, 2]
    assert seconds < 1.02 * 2000 * bfloat16_cpu_seconds(1), seconds / (2000 * bfloat16_cpu_seconds(1))


def test_it_climbs_again_when_the_prompts_turn_easy():
    """Settled on plain decoding with a draft that accepts nothing, the policy still checks the next window
    every `refresh` steps; when the requests turn to ones the draft predicts, it climbs (here after four
    such checks of 4 requests each outweigh the 300 steps of evidence against the draft)."""
    policy = AdaptiveWindow(8, refresh=64)
    for _ in range(300):  # nothing accepted
        k = policy.choose(4)
        policy.observe_accepts([0] * 4, k)
        policy.observe_step(4, k, simulated_step_seconds(4, k))
    assert policy.choose(4) == 1
    chosen = []
    for _ in range(400):  # every draft accepted
        k = policy.choose(4)
        chosen.append(k)
        policy.observe_accepts([k - 1] * 4, k)
        policy.observe_step(4, k, simulated_step_seconds(4, k))
    best = best_window_all_accepted(4, 8)
    # 4: the anchor below the choice, measured again every refresh // 4 = 16 steps
    assert best == 8 and [k for k in chosen[-64:] if k != best] == [4] * 4, chosen[-64:]


def best_window_all_accepted(bs: int, K: int) -> int:
    return max(range(1, K + 1), key=lambda k: k / simulated_step_seconds(bs, k))


@pytest.mark.parametrize("bs", [1, 4, 16, 64])
def test_it_settles_on_the_best_window_of_each_batch_size(bs):
    K = 8
    policy = AdaptiveWindow(K, refresh=64)
    rng = random.Random(bs)
    chosen = run(policy, bs, 400, rng)
    late = chosen[200:]  # measuring its anchors again every 64 steps included
    achieved = sum(throughput(bs, k) for k in late) / len(late)
    best = throughput(bs, best_window(bs, K))
    assert achieved > 0.95 * best, (bs, best_window(bs, K), sorted(set(late)), achieved / best)
    assert achieved > 1.05 * min(throughput(bs, 1), throughput(bs, K))  # better than the worse fixed choice


def test_the_simulated_best_window_shrinks_with_load():
    """The premise of the test above: on a CPU-like server a busier batch wants fewer verified rows."""
    best = [best_window(bs, 8) for bs in (1, 4, 16, 64)]
    assert best == sorted(best, reverse=True) and best[0] > 2 and best[-1] <= 2, best


def test_a_weak_draft_falls_back_to_plain_decoding():
    policy = AdaptiveWindow(16)
    for _ in range(300):
        k = policy.choose(8)
        policy.observe_accepts([0] * 8, k)  # nothing is ever accepted
        policy.observe_step(8, k, 0.1 + 0.05 * (k > 1) + 0.002 * k)
    assert policy.choose(8) == 1
    assert policy.accept_rate[1] < 0.05 and policy.accept_rate[0] == 1.0


def test_accept_rates_start_at_the_prior_and_follow_observations():
    policy = AdaptiveWindow(4)
    assert policy.accept_rate[1:] == [PRIOR, PRIOR ** 2, PRIOR ** 3]
    assert policy.expected_tokens(1) == 1.0
    policy.observe_accepts([3, 3, 3, 3], 4)
    assert all(a > p for a, p in zip(policy.accept_rate[1:], [PRIOR, PRIOR ** 2, PRIOR ** 3]))
    before = list(policy.accept_rate)
    policy.observe_accepts([0, 0], 1)  # a plain decode step observes no row
    assert policy.accept_rate == before


def test_with_cuda_graphs_it_chooses_among_measured_anchors_only():
    """On CUDA the verify is graphed for K rows only; a window between two anchors runs eagerly. Interpolating
    between an eager 8 and a graphed 16 prices an eager 12 below what it costs, and 12, no anchor, is never
    measured to correct it. With anchors_only every choice is a measured anchor: here the graphed 16, which
    does commit more per second than an eager 12 would."""
    def step_seconds(k):  # eager: 25 ms + 0.625 ms a row; k = 16 graphed: 32 ms (eager it would be 35)
        return 0.032 if k == 16 else 0.025 + 0.000625 * k

    def tokens_per_second(k):  # every request accepts up to 11 drafts
        return min(k, 12) / step_seconds(k)

    assert tokens_per_second(16) > tokens_per_second(12) > tokens_per_second(8)  # the truth: 16 is best
    for anchors_only in (True, False):
        policy = AdaptiveWindow(16, anchors_only=anchors_only)
        chosen = []
        for _ in range(300):
            k = policy.choose(4)
            chosen.append(k)
            policy.observe_accepts([min(11, k - 1)] * 4, k)
            policy.observe_step(4, k, step_seconds(k))
        settled = max(set(chosen[150:]), key=chosen[150:].count)  # the anchors re-measured every 64 steps aside
        if anchors_only:
            assert set(chosen) <= set(policy.anchors) and settled == 16
        else:  # what anchors_only prevents: an interpolated, eager window taken for cheaper than it is
            assert 8 < settled < 16


def test_one_slow_first_plain_step_does_not_hold_a_bucket_on_a_slower_window():
    """The first plain step of a bucket measured twice its cost (a noisy moment): 2 rows then look cheaper than
    1 with a draft that accepts nothing. The policy measures that first plain step again soon (an anchor
    around the choice measured only once) and is back on plain decoding within `refresh // 16` steps, not
    after `refresh` (128) steps of the slower window."""
    def seconds(k, step):  # 2 rows cost 1.4 plain steps; the first plain step took twice its cost
        return 0.2 if (k, step) == (1, 0) else 0.1 if k == 1 else 0.14 + 0.02 * (k - 2)

    policy, chosen = AdaptiveWindow(16), []
    for step in range(64):
        k = policy.choose(16)
        chosen.append(k)
        policy.observe_accepts([0] * 16, k)
        policy.observe_step(16, k, seconds(k, step))
    assert chosen[1] == 2 and sum(k > 1 for k in chosen) <= 12 and set(chosen[-32:]) == {1}, chosen


def test_a_window_last_measured_at_a_lighter_load_is_not_taken_again_and_again():
    """The load grows: every step costs a little more than the one before, 4 times more after 60 steps. An
    anchor measured early then looks cheaper than the plain steps cost now. When one is taken, its new cost
    replaces the stale estimate, and the bucket is back on plain steps: a 2-row step is not taken again and
    again while its estimate creeps up a quarter of the way per step (7 times after the first, one of them
    at an interpolated 3 rows, before the estimate forgot with its age)."""
    policy, chosen = AdaptiveWindow(16), []
    for step in range(60):
        k = policy.choose(12)
        chosen.append(k)
        policy.observe_accepts([0] * 12, k)
        policy.observe_step(12, k, (0.1 if k == 1 else 0.14 + 0.02 * (k - 2)) * (1 + step / 20))
    assert chosen[:2] == [1, 2] and sum(k in (2, 3) for k in chosen[2:]) <= 3, chosen


def test_a_bucket_visited_again_after_a_while_measures_its_cheaper_anchor_again():
    """A server test's bucket of one request (CI, 2026-12-07): its first steps came while the other requests
    arrived, so its plain steps measured half again their cost and 2 rows looked cheaper. The requests then ran
    at 16 for 80 steps, and when one request ran alone again the bucket took 2 rows for 11 of its 23 steps
    (here: all 24): its plain step's estimate was a few steps old by the bucket's own count, and the anchor
    below a choice was measured again only every `refresh` steps. Ages now count all decode steps, and the
    anchor below the choice, the cheaper one, is measured again once its estimate is `refresh // 4` steps old."""
    def seconds(bs, k, busy):  # 2 rows cost 1.27 plain steps at one request; a busy moment costs 1.5 times
        t = (0.10 if k == 1 else 0.127 + 0.01 * (k - 2)) if bs == 1 else (0.25 if k == 1 else 0.37 + 0.02 * k)
        return t * (1.5 if busy else 1.0)

    policy, late = AdaptiveWindow(16), []
    for phase, (bs, steps) in enumerate([(1, 12), (16, 80), (1, 24)]):
        for _ in range(steps):
            k = policy.choose(bs)
            if phase == 2:
                late.append(k)
            policy.observe_accepts([0] * bs, k)
            policy.observe_step(bs, k, seconds(bs, k, busy=phase == 0 and k == 1))
    assert sum(k > 1 for k in late) <= 2 and set(late[-16:]) == {1}, late


TREE_NODE_ACCEPT = [1.0, 0.7, 0.15, 0.55, 0.1, 0.3, 0.08, 0.25]  # P(node j on the accepted path), best-first order


@pytest.mark.parametrize("bs", [1, 16])
def test_a_tree_budget_settles_where_the_nodes_pay(bs):
    """--speculative-eagle-topk k > 1: the window is a tree's node budget, and a_j the share of requests whose
    path holds node j (observe_nodes; not monotone in j: node 2, a sibling of node 1, is less likely than node
    3, node 1's child). The policy settles on the budget that commits the most tokens per second (8 nodes at
    one request, 4 at 16, each 5-6 % ahead of the next best), and its E(k) is the tree's."""
    def expected(k):
        return 1 + sum(TREE_NODE_ACCEPT[1:k])

    best = max(range(1, 9), key=lambda k: bs * expected(k) / simulated_step_seconds(bs, k))
    policy, rng, chosen = AdaptiveWindow(8, refresh=64, chain=False), random.Random(0), []
    for _ in range(400):
        k = policy.choose(bs)
        chosen.append(k)
        policy.observe_nodes([sum(rng.random() < TREE_NODE_ACCEPT[j] for _ in range(bs)) for j in range(1, k)], bs, k)
        policy.observe_step(bs, k, simulated_step_seconds(bs, k) * rng.uniform(0.9, 1.1))
    settled = max(set(chosen[200:]), key=chosen[200:].count)
    assert settled == best, (best, chosen[200:])
    assert abs(policy.expected_tokens(best) - expected(best)) < 0.25
