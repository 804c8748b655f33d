"""Training prompts sampled from the target itself (`--prompts self`), for a target that comes with no data.

The target's chat template opens a user turn with a fixed text (SmolLM2: its default system turn, then
`<|im_start|>user\\n`). Sampling from the target after that text, at a temperature, until the turn's end token,
gives the kind of request its own training taught it to expect. The samples go through the same filters as
ShareGPT's turns (sources.prompt_problem: length, garbling, language) and normalised duplicates are dropped.

The prompts are kept in a file (one JSON row each, ids `self:N`) and a second run adds only what is missing, so
that a work folder's responses, kept by prompt id, stay valid.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from sglang_dflash.train.data import read_jsonl
from sglang_dflash.train.sources import SELF, admit, clean_turn, normalise

log = logging.getLogger(__name__)

MARK = "\u2063SELF-PROMPT\u2063"  # a text no template writes, to find where the user's message goes


def user_turn(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the chat template puts before a user's message, and the ids that can end the message (the
    first token the template puts after it, and the tokenizer's eos)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--prompts self samples user turns after the target's chat template's user-turn prefix, "
                         "and this tokenizer has no chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False,
                                         add_generation_prompt=False)
    if MARK not in text:
        raise ValueError("--prompts self: the chat template does not write the user's message verbatim")
    before, after = text.split(MARK, 1)
    prefix = tokenizer(before, add_special_tokens=False).input_ids
    stops = tokenizer(after.strip(), add_special_tokens=False).input_ids[:1] if after.strip() else []
    if tokenizer.eos_token_id is not None:
        stops.append(tokenizer.eos_token_id)
    if not prefix or not stops:
        raise ValueError(f"--prompts self: cannot tell the user turn's start and end from the chat template "
                         f"(before the message: {before!r}, after: {after!r})")
    return prefix, sorted(set(stops))


def sample_self_prompts(model, tokenizer, num: int, path: str | Path, seed: int = 0, temperature: float = 1.0,
                        top_p: float = 0.95, max_tokens: int = 192, batch_size: int = 32) -> list[dict]:
    """num prompts [{id, prompt, source}] sampled from model after its user-turn prefix, those already in path
    first; new ones are appended to path. Each batch is drawn with its own seed (seed, batch number), so the
    same calls give the same prompts. A sample that does not end its turn within max_tokens is dropped (a cut
    request), as is one that prompt_problem refuses or that repeats a kept one."""
    path = Path(path)
    rows = read_jsonl(path)
    seen = {normalise(r["prompt"]) for r in rows}
    prefix, stops = user_turn(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    dropped: dict[str, int] = {}
    batch_no = max((r["batch"] for r in rows), default=-1) + 1  # a later run draws batches no run drew before
    drawn = 0
    attempts = max(20 * num, 4 * batch_size)  # what the filters may refuse before the run stops
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        while len(rows) < num:
            if drawn >= attempts:
                raise RuntimeError(f"--prompts self: {drawn} samples gave {len(rows)} usable prompts of the {num} "
                                   f"asked for (dropped: {dropped}); try another --self-temperature")
            gen = torch.Generator().manual_seed(seed * 1_000_003 + batch_no)
            ids = torch.tensor([prefix] * batch_size)
            out = sample(model, ids, max_tokens, stops, pad, temperature, top_p, gen)
            batch_no += 1
            drawn += batch_size
            for row_ids in out:
                text, unfinished = _turn_text(tokenizer, row_ids, stops)
                if not admit(text, seen, dropped, unfinished):
                    continue
                row = {"id": f"{SELF}:{len(rows)}", "prompt": text, "source": SELF, "batch": batch_no - 1}
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                if len(rows) == num:
                    break
    if drawn:
        log.info("self prompts: %d sampled, %d kept in %s, dropped %s", drawn, len(rows), path, dropped)
    return rows[:num]


def _turn_text(tokenizer, ids: list[int], stops: list[int]) -> tuple[str, str | None]:
    """The sampled turn's text, and "unfinished" when it has no stop token."""
    end = next((i for i, t in enumerate(ids) if t in stops), None)
    if end is None:
        return "", "unfinished"
    return clean_turn(tokenizer.decode(ids[:end], skip_special_tokens=True)), None


@torch.no_grad()
def sample(model, ids: torch.Tensor, max_tokens: int, stops: list[int], pad: int, temperature: float,
           top_p: float, gen: torch.Generator) -> list[list[int]]:
    """Nucleus sampling of up to max_tokens after ids [N, P] (all rows the same length), with the model's KV
    cache; a row stops at its first stop token (kept) and is padded after it. -> N lists of sampled ids."""
    from transformers import DynamicCache

    cache = DynamicCache()
    n = ids.shape[0]
    done = torch.zeros(n, dtype=torch.bool)
    out = torch.full((n, max_tokens), pad, dtype=torch.long)
    stop = torch.tensor(stops)
    x = ids.to(model.device)
    for t in range(max_tokens):
        logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[:, -1].float().cpu()  # [N, V]
        probs = torch.softmax(logits / temperature, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the smallest set holding top_p of the mass
        sorted_p = sorted_p * keep
        nxt = order.gather(-1, torch.multinomial(sorted_p, 1, generator=gen)).squeeze(-1)  # [N]
        nxt = torch.where(done, torch.tensor(pad), nxt)
        out[:, t] = nxt
        done |= torch.isin(nxt, stop)
        if done.all():
            return out[:, :t + 1].tolist()
        x = nxt[:, None].to(model.device)
    return out.tolist()
