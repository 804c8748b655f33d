"""A test-only SGLang plugin: makes the DFLASH worker's draft propose the target's own continuation.

Loaded into a test server by putting this folder on PYTHONPATH (its dist-info declares the
entry point) and SGLANG_DFLASH_ORACLE=file.json, a list of full greedy sequences (prompt ids +
reference output ids). For each request, the draft's proposal at position t is sequence[t]:
every greedy verify step should then accept the whole block. For a sampled request the
proposal is a point mass on that token (q is set to match), which rejection sampling accepts
with probability p(token): the output distribution stays the target's.
"""

import json
import os

_reqs = []


def _remember_reqs(self, batch):
    _reqs[:] = list(batch.reqs)


def _oracle_draft(original, self, block_ids, positions, req_to_token, req_pool_indices, prefix_lens, sampling_info,
                  **kw):
    tokens, q = original(self, block_ids, positions, req_to_token, req_pool_indices, prefix_lens, sampling_info, **kw)
    for i, req in enumerate(_reqs):
        full = _sequences().get(tuple(req.origin_input_ids))
        if full is None:
            continue
        for j, p in enumerate(positions[i, 1:].tolist()):
            if p < len(full):
                tokens[i, j] = full[p]
                if q is not None:  # a sampled request: the proposal is a point mass, and q must say so
                    q[i, j] = 0
                    q[i, j, full[p]] = 1
    return tokens, q


_cache = None


def _sequences():
    """{prompt ids: prompt ids + reference output ids}"""
    global _cache
    if _cache is None:
        with open(os.environ["SGLANG_DFLASH_ORACLE"]) as f:
            _cache = {tuple(r["sequence"][:r["prompt_len"]]): r["sequence"] for r in json.load(f)}
    return _cache


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang_dflash.worker.DFlashWorker.decode_step", _remember_reqs, HookType.BEFORE)
    HookRegistry.register("sglang_dflash.worker.DFlashWorker.draft_forward", _oracle_draft, HookType.AROUND)
