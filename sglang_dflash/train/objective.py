"""The DFlash training objective on one sequence.

A sequence x_0 … x_{T-1} (prompt, then the target's own response from position P)
and its target context rows (features at every position) give N training blocks.
Block j has an anchor a_j in the response, P <= a_j <= T - 2, and is laid out
exactly as at decode time:

    tokens     [x_{a_j}, MASK, …, MASK]          (B tokens)
    positions  a_j … a_j + B - 1
    attends    context rows t < a_j, and its own B rows (bidirectionally)
    labels     block row k (1 <= k < B) predicts x_{a_j + k}  (ignored past the end)

All N blocks run in one draft forward: queries [N*B], keys [T context + N*B block].
Row k of a block is weighted exp(-(k-1)/gamma): early rows decide acceptance.

Shapes: T sequence length, N blocks, B block size, Q = N*B.
"""

from __future__ import annotations

import math

import torch

from sglang_dflash.block import accepted_prefix, make_block
from sglang_dflash.ops.kernels import training_block_mask  # noqa: F401  (the mask lives beside its CUDA kernel)

IGNORE = -100


def sample_anchors(prompt_len: int, seq_len: int, num_blocks: int, generator: torch.Generator | None = None
                   ) -> torch.Tensor:
    """Up to num_blocks distinct anchors drawn uniformly from [prompt_len, seq_len - 2], sorted -> [N]."""
    lo, hi = prompt_len, seq_len - 2
    if hi < lo:
        return torch.empty(0, dtype=torch.long)
    n = min(num_blocks, hi - lo + 1)
    return (torch.randperm(hi - lo + 1, generator=generator)[:n] + lo).sort().values


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """tokens [T], anchors [N] -> block ids [N, B], positions [N, B], labels [N, B] (row 0 and overflow IGNORE)."""
    T = tokens.numel()
    ids, positions = make_block(tokens[anchors], anchors, block_size, mask_token_id)  # [N, B] each
    labels = torch.where(positions < T, tokens[positions.clamp(max=T - 1)], IGNORE)
    labels[:, 0] = IGNORE
    return ids, positions, labels


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] loss weight per block row: 0 for the anchor row, exp(-(k-1)/gamma) for row k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def teacher_forced_accepts(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """pred, labels [N, B] -> [N]: the drafts greedy decoding would accept, rows 1, 2, … up to the first miss
    (a row past the sequence's end, labelled IGNORE, is a miss)."""
    return accepted_prefix((pred[:, 1:] == labels[:, 1:]) & (labels[:, 1:] != IGNORE))


def expected_tau(accepted: torch.Tensor) -> float:
    """Mean accepted drafts + 1 (the target's own token): the teacher-forced estimate of τ."""
    return 1.0 + accepted.float().mean().item() if accepted.numel() else math.nan
