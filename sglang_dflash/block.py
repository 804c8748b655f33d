"""The block: what DFlash drafts, what of it is accepted, and acceptance by row. Every backend (the
SGLang worker, the Transformers backend, training, evaluation, bench) uses these three.

B is the draft's block: the positions one draft forward fills (config.block_size, what the draft was
trained on). K ≤ B is the number of rows one verify step checks (the window: the bonus token and K-1
drafts). A block that starts at position s is

    ids        [x_s, MASK, …, MASK]      x_s known: the last committed token (decoding), an anchor (training)
    positions  s, s + 1, …, s + n - 1    n = B for the draft forward, K for the verify forward

Its drafts d_1 … d_{n-1} are accepted while each equals the truth at its row (the target's own token):
the accepted prefix. Row k of the block is accepted in a step when that step accepted at least k drafts.
"""

from __future__ import annotations

import torch


def make_block(first: torch.Tensor, starts: torch.Tensor, n: int, mask_token_id: int):
    """first, starts [m] -> ids [m, n] ([first, MASK, …]) and positions [m, n] (start … start + n - 1), int64."""
    positions = starts.long()[:, None] + torch.arange(n, device=starts.device)[None]
    ids = torch.full_like(positions, mask_token_id)
    ids[:, 0] = first
    return ids, positions


def accepted_prefix(match: torch.Tensor) -> torch.Tensor:
    """match [m, n] bool (draft row k+1 equals the truth) -> [m] int64: how many rows match before the first miss."""
    return match.long().cumprod(-1).sum(-1)


def acceptance_by_row(accepted_counts: list | torch.Tensor) -> list[float | None]:
    """accepted_counts[a]: verify steps that accepted a drafts (a = 0 … n-1) -> for block rows k = 1 … n-1 the
    fraction of steps that accepted at least k (None where there were no steps).

    Or by window, accepted_counts[K][a] (K = 0 … n: steps that verified K rows, the bonus and K-1 drafts): row
    k's fraction is then over the steps whose window reached it (K > k) only. A step of a shorter window (an
    adaptive server's 1-row steps) could not accept row k, and counting it would understate the draft."""
    if _by_window(accepted_counts):
        by_window = [[int(c) for c in row] for row in accepted_counts]
    else:  # every step verified every row: one window of n rows
        counts = [int(c) for c in accepted_counts]
        by_window = [[] for _ in counts] + [counts]
    out = []
    for k in range(1, len(by_window) - 1):
        reached = by_window[k + 1:]  # the steps of windows K > k
        steps = sum(sum(r) for r in reached)
        out.append(sum(sum(r[k:]) for r in reached) / steps if steps else None)
    return out


def _by_window(counts) -> bool:
    if isinstance(counts, torch.Tensor):
        return counts.dim() == 2
    return len(counts) > 0 and isinstance(counts[0], (list, tuple))


def accepted_counts(accepted: torch.Tensor, rows: int) -> list[int]:
    """accepted [steps] (drafts accepted per verify step, each < rows) -> counts [rows] for acceptance_by_row."""
    return torch.bincount(accepted.long().flatten().cpu(), minlength=rows).tolist()
