"""The draft head over a vocabulary-sharded lm_head (tensor parallelism), with the ranks simulated
by threads that meet in an all-gather: every rank's argmax and logits must equal those over the
whole, unsharded vocabulary."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sglang_dflash.draft_head import DraftHead

pytestmark = pytest.mark.unit


class FakeGroup:
    """tp ranks in tp threads: all_gather(t) concatenates every rank's t along the last dim, rank order."""

    def __init__(self, tp: int):
        self.tp, self.slots, self.barrier = tp, [None] * tp, threading.Barrier(tp)

    def gather_for(self, rank: int):
        def all_gather(t):
            self.slots[rank] = t.clone()
            self.barrier.wait()
            out = torch.cat(self.slots, dim=-1)
            self.barrier.wait()  # everyone has read before the next gather overwrites
            return out
        return all_gather


def sharded_heads(weight: torch.Tensor, vocab: int, tp: int) -> list[DraftHead]:
    """Split weight [Vp, H] (Vp = the padded vocabulary, divisible by tp) as SGLang does: rank r holds
    rows [r·Vp/tp, (r+1)·Vp/tp), of which those below vocab are real tokens."""
    per, group = weight.shape[0] // tp, FakeGroup(tp)
    return [DraftHead(weight[r * per:(r + 1) * per], vocab, start=r * per,
                      num_rows=max(0, min(per, vocab - r * per)), all_gather=group.gather_for(r)) for r in range(tp)]


def on_all_ranks(heads, fn):
    with ThreadPoolExecutor(len(heads)) as pool:
        return list(pool.map(fn, heads))


def test_sharded_argmax_and_logits_equal_the_full_vocabulary():
    torch.manual_seed(0)
    vocab, padded, hidden, n = 1000, 1024, 32, 64
    for tp in (1, 2, 4):
        weight = torch.randn(padded, hidden)
        weight[vocab:] = 100.0  # padding rows that would win every argmax if they were not excluded
        rows = torch.randn(n, hidden)
        rows[:8] = rows[:8].abs()  # these rows' logits at the padding are huge
        weight[700] = weight[3]  # two equal best candidates on different ranks for some rows:
        rows[8:16] = weight[3] * 5  # the lower id must win, as in a full argmax
        full = (rows @ weight[:vocab].T).float()
        heads = sharded_heads(weight, vocab, tp) if tp > 1 else [DraftHead(weight[:vocab], vocab)]
        for tokens in on_all_ranks(heads, lambda h: h.argmax(rows)):
            assert torch.equal(tokens, full.argmax(-1)), tp
        assert (full.argmax(-1)[8:16] == 3).all()
        for logits in on_all_ranks(heads, lambda h: h.logits(rows)):
            assert logits.shape == (n, vocab)
            torch.testing.assert_close(logits, full)
