"""A request's own logit rules, applied to every row of a verify block.

Without speculation SGLang transforms a request's logits before it samples each token:
penalties (frequency, presence, repetition, min_new_tokens), then the grammar's vocabulary
mask, then logit_bias (SamplingBatchInfo.apply_logits_bias), then custom logit processors
(the sampler). Each depends on the output generated so far. In a verify block, row j of a
request predicts the token after [its committed output, d_1 … d_j]: if the drafts d_1 … d_j
are accepted, they ARE its output so far. So row j gets exactly the transforms the
non-speculative server would apply at that position, and greedy acceptance (argmax) and
rejection sampling (p) stay lossless. Rows after a draft token the grammar forbids are left
unconstrained: the target can never accept that token (its logit is -inf), so nothing after
it is ever emitted.

SGLang's own speculative paths apply the committed-output penalties to all rows alike (a
"relaxed" version); this module does not.

Only custom logit processors are approximate: they are called once for the block with the
request's committed output (SGLang's own num_tokens_in_batch convention), so a processor
that reads the output so far sees it without the drafts. The worker logs this once.

Shapes: bs requests, B block rows, V vocabulary.
"""

from __future__ import annotations

import torch


def has_penalties(sampling_params) -> bool:
    sp = sampling_params
    return (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0 or sp.repetition_penalty != 1.0
            or sp.min_new_tokens > 0)


def needs_rules(batch) -> bool:
    info = batch.sampling_info
    return (info.logit_bias is not None or info.has_custom_logit_processor or batch.has_grammar
            or any(has_penalties(r.sampling_params) for r in batch.reqs))


def apply_rules(logits: torch.Tensor, block_ids: torch.Tensor, batch) -> None:
    """logits [bs, B, V] (in place), block_ids [bs, B] = [bonus, d_1 … d_{B-1}] per request."""
    bs, B, V = logits.shape
    reqs = batch.reqs
    for i, req in enumerate(reqs):
        if has_penalties(req.sampling_params):
            penalize(logits[i], req.output_ids, block_ids[i, 1:], req.sampling_params, stop_token_ids(req))
    if batch.has_grammar:
        grammar_mask(logits, block_ids[:, 1:].tolist(), [r.grammar for r in reqs])
    if batch.sampling_info.logit_bias is not None:
        logits.add_(batch.sampling_info.logit_bias[:, None, :V])
    if batch.sampling_info.has_custom_logit_processor:
        from sglang.srt.layers.sampler import apply_custom_logit_processor

        apply_custom_logit_processor(logits.view(bs * B, V), batch.sampling_info, num_tokens_in_batch=B)


def output_counts(output_ids: list[int], drafts: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V]: how often each token occurs in the output so far at each block row
    (row 0: the committed output; row j: plus d_1 … d_j)."""
    device = drafts.device
    base = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=device), minlength=vocab)[:vocab]
    steps = torch.nn.functional.one_hot(drafts.long(), vocab).cumsum(0)  # [B-1, V]
    return torch.cat([base[None], base[None] + steps]).float()


def penalize(logits: torch.Tensor, output_ids: list[int], drafts: torch.Tensor, sp, stop_ids: list[int]) -> None:
    """One request's penalties over its block rows, logits [B, V] in place: the additive ones
    (frequency, presence, min_new_tokens), then the multiplicative repetition penalty."""
    B, V = logits.shape
    counts = output_counts(output_ids, drafts, V)
    if sp.frequency_penalty != 0.0:
        logits.sub_(sp.frequency_penalty * counts)
    if sp.presence_penalty != 0.0:
        logits.sub_(sp.presence_penalty * (counts > 0).float())
    if sp.min_new_tokens > 0 and stop_ids:
        n_out = len(output_ids) + torch.arange(B, device=logits.device)  # output length before row j's token
        early = (n_out < sp.min_new_tokens)[:, None]
        stop = torch.zeros(V, dtype=torch.bool, device=logits.device)
        stop[torch.tensor([t for t in stop_ids if 0 <= t < V], dtype=torch.long, device=logits.device)] = True
        logits.masked_fill_(early & stop[None], float("-inf"))
    if sp.repetition_penalty != 1.0:
        seen = counts > 0
        scaled = torch.where(logits < 0, logits * sp.repetition_penalty, logits / sp.repetition_penalty)
        logits.copy_(torch.where(seen, scaled, logits))


def stop_token_ids(req) -> list[int]:
    """The tokens min_new_tokens holds back: as SGLang's min-new-tokens penalizer collects them."""
    tok = req.tokenizer
    ids = set(req.sampling_params.stop_token_ids or ()) | set(req.eos_token_ids or ())
    if tok is not None:
        ids |= set(getattr(tok, "additional_stop_token_ids", None) or ())
        if tok.eos_token_id is not None:
            ids.add(tok.eos_token_id)
    return sorted(t for t in ids if t is not None)


def grammar_mask(logits: torch.Tensor, drafts: list[list[int]], grammars: list) -> None:
    """Mask each row with what the request's grammar allows after [output, d_1 … d_j]: walk the
    grammar along the drafts (stopping at the first one it forbids, or when it terminates),
    fill one mask row per position, then roll the grammar back to where the scheduler left it."""
    bs, B, V = logits.shape
    first = next(g for g in grammars if g is not None)
    mask = first.allocate_vocab_mask(vocab_size=V, batch_size=bs * B, device="cpu")  # all allowed
    for i, g in enumerate(grammars):
        if g is None or g.finished or g.is_terminated():
            continue
        walked = 0
        for j in range(B):
            g.fill_vocab_mask(mask, i * B + j)
            if j == B - 1:
                break
            try:
                g.accept_token(drafts[i][j])
            except ValueError:  # the grammar forbids d_{j+1}: the target rejects it at row j
                break
            walked += 1
            if g.is_terminated():
                break
        if walked:
            g.rollback(walked)
    first.apply_vocab_mask(logits.view(bs * B, V), first.move_vocab_mask(mask, logits.device))
