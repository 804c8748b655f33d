"""What SGLang's scheduler carries from one DFLASH step to the next, and the KV slots it reserves
for the next verify block.

The scheduler holds a draft input per batch (its `spec_info`): each request's bonus token and
committed length, filtered and merged with the batch. Before each decode step it calls
`prepare_for_decode`, which must reserve the KV slots of the positions the step will write:
committed … committed + K - 1 (K = --speculative-num-draft-tokens, the largest window a step
verifies), and record them in the request's row of `req_to_token`.

SGLang's own DFLASH input reserves 2K per request, a double buffer for its overlap schedule,
where the committed length the scheduler sees lags the worker by a step. This worker runs
synchronously, so the committed length is exact and K is enough. It also has to be: a row of
`req_to_token` is the context length + K + 4 wide (page size 1), so a reservation of 2K past a
request near the end of its context runs off the row; the slots past the row's end are allocated
but never recorded, and so never freed (issue 24: 8 slots lost per such request, or a crash).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.allocation import alloc_for_spec_decode
from sglang.srt.mem_cache.allocation_sizing import page_aligned_decode_alloc_lens
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2


@dataclass
class DraftInput(DFlashDraftInputV2):
    """SGLang's DFLASH draft input (filter, merge and the fields the scheduler reads are its own);
    only the reservation differs."""

    def prepare_for_decode(self, batch) -> None:
        bs = batch.batch_size()
        if bs == 0:
            return
        batch.maybe_evict_swa()
        K = int(get_spec().speculative_num_draft_tokens)
        page_size = batch.token_to_kv_pool_allocator.page_size
        cur, nxt, needed = page_aligned_decode_alloc_lens(batch.reqs, reserve=K, page_size=page_size)
        width = batch.req_to_token_pool.req_to_token.shape[1]
        if max(nxt) > width:  # cannot happen while a request's length stays within its context
            raise RuntimeError(f"DFLASH reservation of {max(nxt)} KV positions runs past req_to_token's row of {width}")
        cur_cpu, nxt_cpu = torch.tensor(cur, dtype=torch.int32), torch.tensor(nxt, dtype=torch.int32)
        alloc_for_spec_decode(batch.tree_cache, batch.req_to_token_pool, reqs=batch.reqs,
                              req_pool_indices=batch.req_pool_indices, cur_kv_lens=cur_cpu.to(batch.device),
                              cur_kv_lens_cpu=cur_cpu, nxt_kv_lens=nxt_cpu.to(batch.device), nxt_kv_lens_cpu=nxt_cpu,
                              num_needed_tokens=needed, batch=batch)
        committed = [int(req.kv.kv_committed_len) for req in batch.reqs]
        for req in batch.reqs:
            req.decode_batch_idx += 1
        batch.seq_lens_cpu = torch.tensor(committed, dtype=torch.int64)
        batch.seq_lens_sum = sum(committed)
        self.nxt_kv_lens_cpu, self.nxt_kv_lens_sum = nxt_cpu, sum(nxt)


def make_draft_input(bonus_tokens: torch.Tensor, new_seq_lens: torch.Tensor) -> DraftInput:
    """What the scheduler carries to the next step: each request's bonus token and committed length."""
    bs, device = new_seq_lens.numel(), bonus_tokens.device
    return DraftInput(
        topk_p=torch.empty((bs, 0), device=device, dtype=torch.float32),
        topk_index=torch.empty((bs, 0), device=device, dtype=torch.int64),
        bonus_tokens=bonus_tokens.to(torch.int64),
        new_seq_lens=new_seq_lens.to(torch.int64),
        hidden_states=torch.empty((bs, 0), device=device, dtype=torch.float16),
    )
