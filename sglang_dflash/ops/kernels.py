"""The small glue operations of one decode step, each as a plain-torch twin and, on CUDA, the
compiled kernel of csrc/dflash_kernels.cu (the extension `sglang_dflash._C`, built by
`pip install` when nvcc and a CUDA-enabled torch are present).

The twins define what the kernels compute; tests/test_kernels.py checks the twins against
brute-force definitions on random inputs and, on a GPU, the kernels against the twins.
Each public function takes the kernel when its inputs are on CUDA and the extension is
built, the twin otherwise.

Shapes: bs requests, B the draft's block, K ≤ B the rows verified, F feature width, N training blocks,
T sequence length.
"""

from __future__ import annotations

import torch

from sglang_dflash.block import accepted_prefix, make_block

try:
    from sglang_dflash import _C
    EXTENSION_ERROR = None
except ImportError as e:  # not built (no nvcc / CPU-only torch), or built against another torch
    _C = None
    EXTENSION_ERROR = str(e)


def extension_available() -> bool:
    return _C is not None


def _kernel(*tensors: torch.Tensor) -> bool:
    return _C is not None and tensors[0].is_cuda


# ---- build_block ------------------------------------------------------------------------------
def build_block_torch(bonus, seq_lens, req_pool_indices, req_to_token, mask_id: int, K: int, page_size: int = 1):
    """bonus, seq_lens, req_pool_indices [bs] int64; req_to_token [R, L] (int32 or int64)
    -> block_ids [bs, K] ([bonus, MASK, …], block.make_block), positions [bs, K] (seq_len … seq_len + K - 1),
    slots [bs, K] (the KV slots the scheduler reserved for those positions), all int64: the K rows one verify
    step checks.

    With page_size > 1 a page holds page_size contiguous slots, so a position's slot is the
    first slot of its page plus its offset in the page (what SGLang's paged allocators keep).
    """
    block_ids, positions = make_block(bonus, seq_lens, K, mask_id)
    in_page = positions % page_size
    slots = req_to_token[req_pool_indices[:, None], positions - in_page].long() + in_page
    return block_ids, positions, slots


def build_block(bonus, seq_lens, req_pool_indices, req_to_token, mask_id: int, K: int, page_size: int = 1):
    args = (bonus.long().contiguous(), seq_lens.long().contiguous(), req_pool_indices.long().contiguous())
    if _kernel(bonus):
        return tuple(_C.build_block(*args, req_to_token, mask_id, K, page_size))
    return build_block_torch(*args, req_to_token, mask_id, K, page_size)


# ---- gather_context_features --------------------------------------------------------------------
def gather_context_features_torch(hidden, commit_lens, positions, slots):
    """hidden [bs, K, F] (the verify forward's captured features), commit_lens [bs] in 0 … K,
    positions, slots [bs, K] -> rows [bs*K, F], row_positions [bs*K], row_slots [bs*K], total [].

    The committed rows (k < commit_lens[r]) come first, packed in request order, so rows[:total]
    are what the draft context needs; the other rows follow in the same order with slot -1.
    """
    bs, K, F = hidden.shape
    keep = (torch.arange(K, device=hidden.device)[None] < commit_lens[:, None]).reshape(-1)  # [bs*K]
    order = torch.argsort((~keep).to(torch.int8), stable=True)  # committed rows first, order kept
    row_slots = torch.where(keep, slots.reshape(-1), -1)
    return (hidden.reshape(bs * K, F)[order], positions.reshape(-1)[order], row_slots[order],
            keep.sum())


def gather_context_features(hidden, commit_lens, positions, slots):
    args = (hidden.contiguous(), commit_lens.long().contiguous(), positions.long().contiguous(),
            slots.long().contiguous())
    if _kernel(hidden):
        return tuple(_C.gather_context_features(*args))
    return gather_context_features_torch(*args)


# ---- accept_greedy -------------------------------------------------------------------------------
def accept_greedy_torch(draft_tokens, target_tokens):
    """draft_tokens [bs, K-1], target_tokens [bs, K] (the target's argmax at every verified row)
    -> accept_len [bs] (longest prefix with d_i == t_{i-1}: block.accepted_prefix), next_token [bs]
    (the target's token after it)."""
    accept_len = accepted_prefix(draft_tokens == target_tokens[:, :-1])
    next_token = target_tokens.gather(1, accept_len[:, None]).squeeze(1)
    return accept_len, next_token


def accept_greedy(draft_tokens, target_tokens):
    args = (draft_tokens.long().contiguous(), target_tokens.long().contiguous())
    if _kernel(draft_tokens):
        return tuple(_C.accept_greedy(*args))
    return accept_greedy_torch(*args)


# ---- training_block_mask (the CUDA op keeps its first name, block_attention_mask) ------------------
def training_block_mask_torch(anchors, seq_len: int, block_size: int):
    """anchors [N] -> mask [N*B, T + N*B] bool, True where a query row may attend: the training forward's N
    blocks over one sequence's T context rows. Block j sees context columns t < anchors[j] and its own B
    columns, never another block."""
    N, B = anchors.numel(), block_size
    block_of_row = torch.arange(N * B, device=anchors.device) // B  # [Q]
    ctx = torch.arange(seq_len, device=anchors.device)[None, :] < anchors[block_of_row][:, None]  # [Q, T]
    own = block_of_row[:, None] == block_of_row[None, :]  # [Q, Q]
    return torch.cat([ctx, own], dim=1)


def training_block_mask(anchors, seq_len: int, block_size: int):
    if _kernel(anchors):
        return _C.block_attention_mask(anchors.long().contiguous(), seq_len, block_size)
    return training_block_mask_torch(anchors, seq_len, block_size)
