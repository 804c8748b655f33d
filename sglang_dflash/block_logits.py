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

A tree's block (tree.py) is the same with paths in place of prefixes: node m's row predicts the token
after [its committed output, the tokens on m's path below the root], so it gets the transforms for
that output. The chain is the tree whose every node's parent is the row before (parents None).

SGLang's own speculative paths apply the committed-output penalties to all rows alike (a
"relaxed" version); this module does not.

Only custom logit processors are approximate: they are called once for the block with the
request's committed output (SGLang's own num_tokens_in_batch convention), so a processor
that reads the output so far sees it without the drafts. The worker logs this once.

Shapes: bs requests, N block rows (a chain's window K, or a tree's nodes), V vocabulary.
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


def apply_rules(logits: torch.Tensor, block_ids: torch.Tensor, batch, parents: torch.Tensor | None = None) -> None:
    """logits [bs, N, V] (in place), block_ids [bs, N]: per request the bonus token, then the drafts; parents
    [bs, N]: a tree's (node m's row follows m's path), or None: the chain (row j follows d_1 … d_j)."""
    bs, N, V = logits.shape
    if parents is None:  # built on the host, where the path masks and the grammar walk read it (no device sync)
        parents = torch.arange(-1, N - 1).expand(bs, N)
    reqs = batch.reqs
    for i, req in enumerate(reqs):
        if has_penalties(req.sampling_params):
            penalize(logits[i], req.output_ids, block_ids[i], parents[i], req.sampling_params, stop_token_ids(req))
    if batch.has_grammar:
        grammar_mask(logits, block_ids.tolist(), parents.tolist(), [r.grammar for r in reqs])  # host lists
    if batch.sampling_info.logit_bias is not None:
        logits.add_(batch.sampling_info.logit_bias[:, None, :V])
    if batch.sampling_info.has_custom_logit_processor:
        from sglang.srt.layers.sampler import apply_custom_logit_processor

        apply_custom_logit_processor(logits.view(bs * N, V), batch.sampling_info, num_tokens_in_batch=N)


def output_counts(output_ids: list[int], tokens: torch.Tensor, on_path: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, V]: how often each token occurs in the output so far at each block row: the committed output plus
    the tokens of the row's path below the root (on_path [N, N]: tree.ancestor_mask; the chain's: d_1 … d_j)."""
    device = tokens.device
    base = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=device), minlength=vocab)[:vocab]
    drafts = torch.nn.functional.one_hot(tokens[1:].long(), vocab).float()  # [N-1, V]
    return base[None].float() + on_path[:, 1:].float() @ drafts


def penalize(logits: torch.Tensor, output_ids: list[int], tokens: torch.Tensor, parents: torch.Tensor, sp,
             stop_ids: list[int]) -> None:
    """One request's penalties over its block rows, logits [N, V] in place (tokens, parents [N]: the block's, as
    apply_rules takes them): the additive ones (frequency, presence, min_new_tokens), then the multiplicative
    repetition penalty."""
    from sglang_dflash.tree import ancestor_mask

    V = logits.shape[1]
    on_path = ancestor_mask(parents.cpu()).to(logits.device)  # [N, N]: node m's path, the root and m included
    counts = output_counts(output_ids, tokens, on_path, V)
    if sp.frequency_penalty != 0.0:
        logits.sub_(sp.frequency_penalty * counts)
    if sp.presence_penalty != 0.0:
        logits.sub_(sp.presence_penalty * (counts > 0).float())
    if sp.min_new_tokens > 0 and stop_ids:
        n_out = len(output_ids) + on_path.sum(1) - 1  # output length before row m's token: + m's depth
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


def grammar_mask(logits: torch.Tensor, tokens: list[list[int]], parents: list[list[int]], grammars: list) -> None:
    """Mask each row with what the request's grammar allows after [output, the row's path below the root]: walk
    the grammar depth first along the block's nodes (a chain: along the drafts), fill a node's mask row, accept
    each child's token in turn (skipping one the grammar forbids: the target rejects it at the node's row, and
    nothing below it is emitted; not going below a token that terminates it), and roll back one token after each
    child, so the grammar ends where the scheduler left it."""
    bs, N, V = logits.shape
    first = next(g for g in grammars if g is not None)
    mask = first.allocate_vocab_mask(vocab_size=V, batch_size=bs * N, device="cpu")  # all allowed
    for i, g in enumerate(grammars):
        if g is None or g.finished or g.is_terminated():
            continue
        children = [[] for _ in range(N)]
        for m in range(1, N):
            children[parents[i][m]].append(m)

        def visit(m: int, i=i, g=g, children=children):
            g.fill_vocab_mask(mask, i * N + m)
            for c in children[m]:
                try:
                    g.accept_token(tokens[i][c])
                except ValueError:  # the grammar forbids c's token: the target rejects it at row m
                    continue
                if not g.is_terminated():
                    visit(c)
                g.rollback(1)

        visit(0)
    first.apply_vocab_mask(logits.view(bs * N, V), first.move_vocab_mask(mask, logits.device))
