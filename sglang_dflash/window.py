"""How many rows each verify step checks, chosen from what steps cost and what they commit.

`--speculative-num-draft-tokens K` alone fixes the verify window: every step checks the bonus token and K-1
drafts per request. Without it (K is then the draft's block B), or with `--speculative-adaptive`, the worker
instead picks, each step, the window k in 1 … K that is expected to commit the most tokens per second at the
batch's size:

    E(k) = 1 + a_1 + … + a_{k-1}     tokens committed per request (a_j = P(at least j drafts accepted))
    T(bs, k)                          seconds per decode step at batch size bs
    k* = argmax_k E(k) / T(bs, k)

k = 1 is a plain decode step (no draft forward): where drafting does not pay, at a busy server or with
a weak draft, the server falls back to decoding as it would without speculation. The output does not
depend on k (greedy: the target's tokens; sampling: the target's distribution), only the speed does.

  - a_j: the fraction of requests that accepted at least j drafts, over the steps that checked more
    than j rows (a step of window k observes a_1 … a_{k-1}), older counts decaying by 1 - RATE for
    each newly observed request (a memory of about 1 / RATE requests, however rarely the row is checked);
    before any, the prior a_j = PRIOR ** j (one request's worth). With --speculative-eagle-topk k > 1 the
    window is a tree's node budget and a_j the fraction whose accepted path holds the tree's j-th node in
    best-first order (observe_nodes); E(k) is then the tree of k nodes' expected commit.
  - T(bs, k): the measured wall time of decode steps (from one decode step's start to the next
    forward's), per batch-size bucket (1, 2-3, 4-7, 8-15, …), at the anchors k = 1, 2, 4, 8, … and K,
    linear in k between neighbouring measured anchors (k = 1 has no draft forward; above it the draft
    costs the same for every k and the verify grows with its rows, not always in proportion).

Exploring costs steps: on this 2-core CPU in bfloat16 a step of 16 rows at 16 requests took 12 times a
1-row step, so a policy that first measures the whole window (as this one did until 2026-12-05) spends a
short run's time on steps that cannot pay with a weak draft. So a bucket climbs the anchors from the
cheapest, and measures the next one only while it could still win:

  - k = 1 first (a plain decode step: what the server would do without speculation);
  - then the next anchor a above the largest measured one p, only if its optimistic value beats the best
    measured window's E(k)/T(k): optimistic in acceptance (each a_j at an upper confidence bound,
    (hits + Z) / (seen + Z), and in a chain never above a row before it, since a_j cannot grow with j) and in cost
    (a step of a rows costs at least the measured T(p)). A weak draft stops the climb at 2; a strong
    one, or a device where rows are nearly free, climbs to K;
  - every `refresh` decode steps, the anchors around a bucket's chosen window (the one below it, the one at
    or below it, and the next one up, which keeps the acceptance of the rows just past the window
    observed) are measured again, so that costs and acceptance follow the load, the prompts and the
    machine; an anchor among them measured only once is measured a second time after `refresh // 16`
    steps, so that one noisy first step does not decide a bucket's window for `refresh` steps; an anchor
    below the choice (a cheaper step) is measured again every `refresh // 4` steps, so that a stale, high
    estimate of it cannot hold a bucket on a slower window (one step in 32 at the lower anchor's speed:
    a bucket of one request, measured while other requests arrived, then visited again after 80 steps of
    others, took 2 rows for 11 of its 23 steps in a CI run). Ages count all decode steps (below), so a
    bucket visited less often than every `refresh // 4` steps measures a lower anchor at each visit: a
    cost on its few steps, and never a step slower than plain decoding (a lower anchor is a cheaper step;
    with the choice at 2, a plain one). With the choice at k = 1 one 2-row step in `refresh` explores.

A step's cost changes within a bucket (its batch sizes differ by up to 2×, the sequences grow, other
processes share the CPU, requests arrive), and an anchor the policy does not choose is not measured: its
cost is stale. So an anchor's estimate forgets 1 - WEIGHT of itself for each decode step since it was
measured, of any bucket (the load moves with time, not with one bucket's steps): one measured every step
moves a quarter of the way to each new step, one re-measured after many steps takes the new step's cost
almost whole. (With a plain moving average, a 2-row step last measured when the
load was light looked cheaper than the plain steps of a busier moment, and was taken again and again
while its estimate crept up a quarter at a time: 28 of 93 steps at 2 rows in one server test.)

Wall times differ between tensor-parallel ranks: the worker takes rank 0's choice.

CUDA graphs (decided here; not yet run on a GPU). SGLang captures the target's verify forward as a CUDA graph
for K rows per request only (speculative_num_draft_tokens); a step of any other window runs that forward
eagerly. The policy needs no special case for this, because it chooses from measured step times: an eager
small window is chosen only where it measured faster than the graphed K. What would mislead it is the
interpolation between anchors: between an eager 8 and a graphed 16 it would take the windows 9 … 15 (eager,
as slow as 8 or slower) to cost between the two. So where graphs run (`anchors_only`, set by the worker on
CUDA unless graphs are disabled) the choice is among the measured anchors only (1, 2, 4, …, K), never an
interpolated window. Capturing a graph for each anchor would make the small windows graphed too; SGLang
0.5.23 does that only for EAGLE's adaptive states, so it is left for when a GPU run shows it pays.
"""

from __future__ import annotations

import collections
import dataclasses
import time

PRIOR = 0.5  # a_j before any step observed it
RATE = 0.02  # the decay of older counts per newly observed request
Z = 2.0  # the upper confidence bound of a_j counts Z more requests that all accepted
WEIGHT = 0.25  # a new step's share in an anchor's cost estimate measured one step before


@dataclasses.dataclass
class Bucket:
    """Measured step seconds at the anchors of one batch-size bucket, and when each was measured."""
    seconds: dict[int, float] = dataclasses.field(default_factory=dict)  # anchor k -> moving average
    measured_at: dict[int, int] = dataclasses.field(default_factory=dict)  # anchor k -> the policy's step clock
    samples: dict[int, int] = dataclasses.field(default_factory=dict)  # anchor k -> steps measured
    chosen: dict[int, int] = dataclasses.field(default_factory=dict)  # window k -> steps that chose it
    recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=16))  # last k's
    steps: int = 0


class AdaptiveWindow:
    def __init__(self, max_window: int, refresh: int = 128, anchors_only: bool = False, chain: bool = True):
        assert max_window >= 2
        self.K = max_window
        self.chain = chain  # False: the window is a tree's node budget (see observe_nodes)
        self.refresh = refresh
        self.confirm = max(1, refresh // 16)  # an anchor measured once is measured again this many steps later
        self.recheck = max(1, refresh // 4)  # … and an anchor below the choice once its estimate is this old
        self.clock = 0  # decode steps chosen, all buckets: the age of an estimate (see the docstring)
        self.anchors_only = anchors_only  # choose among measured anchors only (CUDA graphs: see above)
        powers = {1 << i for i in range(max_window.bit_length()) if 1 << i < max_window}
        self.anchors = sorted(powers | {max_window})  # 1, 2, 4, …, K: climbed from the cheapest
        self.hits = [PRIOR ** j for j in range(max_window)]  # decayed count of requests accepting >= j drafts
        self.seen = [1.0] * max_window  # decayed count of requests whose row j was checked
        self.buckets: dict[int, Bucket] = {}
        self.pending: tuple[int, int, float] | None = None  # the decode step being timed: (batch size, k, start)

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        return int(batch_size).bit_length()

    @property
    def accept_rate(self) -> list[float]:
        """a_j for j in 0 … K-1 (a_0 = 1)."""
        return [h / n for h, n in zip(self.hits, self.seen)]

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a request commits in a step of window k."""
        return 1.0 + sum(self.accept_rate[1:k])

    def optimistic_tokens(self, k: int) -> float:
        """E(k) with each a_j at its upper confidence bound, in a chain never above the row before it (a tree's
        node j may be a sibling less likely than node j + 1, a child of node 1)."""
        total, bound = 1.0, 1.0
        for j in range(1, k):
            ucb = (self.hits[j] + Z) / (self.seen[j] + Z)
            bound = min(bound, ucb) if self.chain else ucb
            total += bound
        return total

    def step_seconds(self, bucket: Bucket, k: int) -> float:
        """T(bs, k) from the measured anchors, linear between the two around k."""
        if k in bucket.seconds:
            return bucket.seconds[k]
        hi = min(a for a in self.anchors if a > k)
        lo = max(a for a in self.anchors if a < k)
        t_lo, t_hi = bucket.seconds[lo], bucket.seconds[hi]
        return t_lo + (t_hi - t_lo) * (k - lo) / (hi - lo)

    def priced(self, bucket: Bucket, k: int) -> bool:
        """Whether T(bs, k) is known: k a measured anchor, or both anchors around it measured."""
        if k in self.anchors:
            return k in bucket.seconds
        return (max(a for a in self.anchors if a < k) in bucket.seconds
                and min(a for a in self.anchors if a > k) in bucket.seconds)

    def best(self, bucket: Bucket) -> int:
        """The measured (or interpolated) window of a bucket expected to commit the most tokens per second."""
        top = max(a for a in self.anchors if a in bucket.seconds)
        windows = [a for a in self.anchors if a in bucket.seconds] if self.anchors_only else \
            [k for k in range(1, top + 1) if self.priced(bucket, k)]
        return max(windows, key=lambda k: self.expected_tokens(k) / self.step_seconds(bucket, k))

    def choose(self, batch_size: int) -> int:
        """The window of the next decode step at this batch size."""
        bucket = self.buckets.setdefault(self.bucket_of(batch_size), Bucket())
        bucket.steps += 1
        self.clock += 1
        k = self.next_window(bucket)
        bucket.chosen[k] = bucket.chosen.get(k, 0) + 1
        bucket.recent.append(k)
        return k

    def next_window(self, bucket: Bucket) -> int:
        """The best window of the bucket, or an anchor to climb to or to measure again."""
        measured = [a for a in self.anchors if a in bucket.seconds]  # climbed from 1: 1, 2, 4, … up to some top
        if not measured:
            return 1
        best = self.best(bucket)
        best_value = self.expected_tokens(best) / self.step_seconds(bucket, best)
        if measured[-1] < self.K:  # climb to the next anchor while it could still win
            nxt = min(a for a in self.anchors if a > measured[-1])
            if self.optimistic_tokens(nxt) / bucket.seconds[measured[-1]] > best_value:
                return nxt
        i = measured.index(max(a for a in measured if a <= best))
        for k in measured[max(i - 1, 0): i + 2]:  # the anchor below the choice's, the choice's, the next one up
            limit = self.refresh if bucket.samples[k] > 1 else self.confirm
            if self.clock - bucket.measured_at[k] > (min(limit, self.recheck) if k < best else limit):
                return k
        return best

    def summary(self) -> dict:
        """What the policy knows, for the stats file: a_j, and per batch-size bucket its steps, each measured
        anchor's estimated step seconds and times measured, the windows it chose (in all, and its last 16), and
        the window it would choose now, exploring aside."""
        buckets = {}
        for b, bucket in sorted(self.buckets.items()):
            if bucket.seconds:
                buckets[f"{1 << (b - 1)}-{(1 << b) - 1}"] = {
                    "steps": bucket.steps, "best": self.best(bucket),
                    "seconds": {k: round(t, 6) for k, t in sorted(bucket.seconds.items())},
                    "samples": dict(sorted(bucket.samples.items())), "chosen": dict(sorted(bucket.chosen.items())),
                    "recent": list(bucket.recent)}
        return {"accept_rate": [round(a, 4) for a in self.accept_rate], "buckets": buckets}

    # The step clock. A decode step's wall time runs from its start to the start of the scheduler's next
    # forward, so that it includes the scheduler's own share of the step; hence two calls: start_step when
    # the step's window is set, end_step when the next forward begins (not counted if that forward is not a
    # decode: the time would then include whatever the scheduler did for a prefill).
    def start_step(self, batch_size: int, k: int) -> None:
        self.pending = (batch_size, k, time.perf_counter())

    def end_step(self, next_is_decode: bool) -> None:
        pending, self.pending = self.pending, None
        if pending is not None and next_is_decode:
            batch_size, k, start = pending
            self.observe_step(batch_size, k, time.perf_counter() - start)

    def observe_step(self, batch_size: int, k: int, seconds: float) -> None:
        """A decode step of window k took this long (start to the next forward's start)."""
        if k not in self.anchors:
            return
        bucket = self.buckets.setdefault(self.bucket_of(batch_size), Bucket())
        old = bucket.seconds.get(k)
        # the estimate forgets 1 - WEIGHT of itself per decode step since it was measured (see the docstring)
        weight = 1.0 if old is None else 1 - (1 - WEIGHT) ** max(1, self.clock - bucket.measured_at[k])
        bucket.seconds[k] = seconds if old is None else old + weight * (seconds - old)
        bucket.measured_at[k] = self.clock
        bucket.samples[k] = bucket.samples.get(k, 0) + 1

    def observe_accepts(self, accept_lens: list[int], k: int) -> None:
        """Drafts accepted per request in a chain step of window k (each 0 … k-1): row j was accepted by the
        requests that accepted at least j drafts."""
        self.observe_nodes([sum(a >= j for a in accept_lens) for j in range(1, k)], len(accept_lens), k)

    def observe_nodes(self, accepted: list[int], requests: int, k: int) -> None:
        """accepted[j - 1]: how many of a step's requests accepted node j, for j in 1 … k-1 (a chain's row j, or
        a tree's j-th node in best-first order) -> a_j. E(k) = 1 + a_1 + … + a_{k-1} holds for trees too: a tree
        of budget k' < k is the first k' nodes of the tree of budget k (tree.build_tree adds nodes best first,
        a parent before its children), so a step of budget k shows what every smaller budget would have accepted
        (as a chain's window k shows the smaller windows; the draft's block differs with k, which both ignore)."""
        keep = (1 - RATE) ** requests
        for j in range(1, k):
            self.hits[j] = keep * self.hits[j] + accepted[j - 1]
            self.seen[j] = keep * self.seen[j] + requests
