"""Requests refused at the door: input that would crash SGLang's scheduler gets a 400 instead.

SGLang 0.5.23 checks a request's length against the context, but not whether it has any
tokens, nor whether its token ids are in the vocabulary. On its CPU engine an empty input
(`{"text": ""}`) fails in an empty reshape and an id outside the vocabulary in the embedding's
IndexError (on a GPU: a device-side assert), both inside the scheduler process, which takes the
whole server down with one request, with or without speculation. The plugin wraps the tokenizer
manager's own per-request check (`TokenizerManager._validate_one_request`, where SGLang's
length checks raise ValueError, which its HTTP server answers with 400), so these requests fail
there, in the front-end process, before they reach a scheduler.
"""

from __future__ import annotations

import numbers

VALIDATE_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"


def check_input_ids(input_ids, vocab_size: int) -> None:
    """Raise ValueError naming the problem if a prompt has no tokens or ids outside [0, vocab_size)."""
    if len(input_ids) == 0:
        raise ValueError("the request's input is empty: give at least one token (text or input_ids)")
    bad = [t for t in input_ids if not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input_ids hold {len(bad)} token id(s) outside this model's vocabulary [0, {vocab_size}): "
                         f"{bad[:5]}")


def validate_one_request(original, self, obj, input_ids):
    """SGLang's own checks, after ours. Multimodal prompts and input_embeds are left to SGLang: their
    input_ids carry placeholder values that are not vocabulary ids."""
    multimodal = any(getattr(obj, name, None) is not None for name in ("image_data", "audio_data", "video_data"))
    if input_ids is not None and getattr(obj, "input_embeds", None) is None and not multimodal:
        check_input_ids(input_ids, self.model_config.vocab_size)
    return original(self, obj, input_ids)
