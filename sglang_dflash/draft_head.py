"""The draft's output head: the target's own lm_head, which under tensor parallelism is split by
vocabulary over the ranks (each rank holds rows [start, start + n) of the padded vocabulary).

Greedy proposals need only the argmax: each rank takes the best of its own rows, the ranks
exchange (best logit, token id) pairs, and every rank picks the same winner. Ties go to the
lowest rank, which holds the lower ids, so the result is exactly the argmax over the full
vocabulary. Sampled proposals need the whole distribution: the ranks gather their logits.

Shapes: N rows, H hidden, V vocabulary (unpadded), S = this rank's shard of the padded vocabulary.
"""

from __future__ import annotations

from typing import Callable

import torch

from sglang_dflash.cpu import gemm

AllGather = Callable[[torch.Tensor], torch.Tensor]  # [N, k] on every rank -> [N, tp·k], rank order


class DraftHead:
    def __init__(self, weight: torch.Tensor, vocab_size: int, start: int = 0, num_rows: int | None = None,
                 all_gather: AllGather | None = None):
        """weight [S, H]: this rank's rows of the lm_head; start: the vocabulary id of its first row;
        num_rows: how many of its rows are real tokens (the rest pad the vocabulary);
        all_gather: the TP group's gather along the last dimension (None on one rank)."""
        self.weight = weight
        self.vocab_size = vocab_size
        self.start = start
        self.num_rows = weight.shape[0] if num_rows is None else num_rows
        self.all_gather = all_gather

    @classmethod
    def of_target(cls, lm_head: torch.nn.Module, vocab_size: int, tp_size: int) -> "DraftHead":
        """The draft head over SGLang's ParallelLMHead (or the tied VocabParallelEmbedding)."""
        if tp_size == 1:
            return cls(lm_head.weight[:vocab_size], vocab_size)
        from sglang.srt.distributed import tensor_model_parallel_all_gather

        shard = lm_head.shard_indices
        if shard.num_added_elements:
            raise ValueError("the target's lm_head has added (LoRA) vocabulary rows: DFLASH under tensor "
                             "parallelism does not handle them")
        return cls(lm_head.weight, vocab_size, shard.org_vocab_start_index, shard.num_org_elements,
                   lambda t: tensor_model_parallel_all_gather(t.contiguous(), dim=-1))

    def local_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, S] float32 logits of this rank's rows (one GEMM, on a CPU in the faster orientation)."""
        return gemm.linear(rows.to(self.weight.dtype), self.weight).float()

    def argmax(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N] the argmax over the whole vocabulary, the same on every rank."""
        local = self.local_logits(rows)[:, : self.num_rows]
        if self.all_gather is None:
            return local.argmax(-1)
        best, index = local.max(-1, keepdim=True)  # [N, 1] each
        return pick_best(self.all_gather(best), self.all_gather(index + self.start))

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32 logits over the whole vocabulary, on every rank."""
        local = self.local_logits(rows)
        if self.all_gather is not None:
            local = self.all_gather(local)  # [N, tp·S]: the padded vocabulary in order
        return local[:, : self.vocab_size]


def pick_best(best: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each rank's (best logit [N, tp], its token id [N, tp]) -> the overall argmax [N]
    (the first of equal maxima: the lowest rank, so the lowest id)."""
    return index.gather(1, best.argmax(-1, keepdim=True)).squeeze(1)
