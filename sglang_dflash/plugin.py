"""SGLang plugin entry point (group `sglang.srt.plugins`): makes `--speculative-algorithm DFLASH`
run this package's worker, in every SGLang process (launch_server, Engine, schedulers, TP ranks).

The name DFLASH is kept, so SGLang's own DFLASH integration points apply (target hidden-state
capture, draft KV sizing, the scheduler's DFLASH branches); what changes:
  - SpeculativeAlgorithm.create_worker returns sglang_dflash.worker.DFlashWorker;
  - DFLASH's argument handling is ours: it checks the draft against the target (a bad draft stops
    the server with one line naming the problem), allows device cpu, and runs synchronously;
  - the torch_native attention backend learns TARGET_VERIFY batches (the CPU engine's backend);
  - on the CPU engine, the sgl-kernel CPU operators the PyPI wheel lacks are registered, and the
    target's float32 linear layers take a faster product inside the verify forward (cpu/gemm.py).
settings.py's IMPL=builtin leaves SGLang's builtin DFLASH untouched (for side-by-side runs).
In every case, with or without DFLASH, requests that would crash a scheduler (an empty prompt, token
ids outside the vocabulary) are refused with a 400 by the front end (request_checks.py).
"""

from __future__ import annotations

import logging
import os

from sglang_dflash.settings import IMPL, settings

logger = logging.getLogger("sglang_dflash")
_registered = False

CREATE_WORKER = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker"
HANDLE_ARGS = "sglang.srt.arg_groups.speculative_hook._handle_dflash"
TORCH_NATIVE_EXTEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
LINEAR_APPLY = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
LM_HEAD = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"
MAYBE_DISABLE_ADAPTIVE = "sglang.srt.arg_groups.speculative_hook._maybe_disable_adaptive"
INIT_ADAPTIVE = "sglang.srt.arg_groups.speculative_hook._init_adaptive_speculative_params"
MAX_DRAFT_TOKENS = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.resolve_max_speculative_num_draft_tokens"


def use_builtin() -> bool:
    return settings().impl == "builtin"


def create_worker(original, self, server_args):
    if self.is_dflash():
        from sglang_dflash.worker import DFlashWorker

        return DFlashWorker
    return original(self, server_args)


def handle_dflash_args(original, server_args):
    """Our DFLASH argument handling (replaces SGLang's, which refuses device cpu)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.runtime_context import attn_dp_enabled_of

    from sglang_dflash.config import load_checked

    cfg = resolving_view(server_args)
    if cfg.pp_size != 1:
        raise ValueError("DFLASH supports only --pp-size 1")
    if attn_dp_enabled_of(cfg) or cfg.attn_cp_size != 1:
        raise ValueError("sglang-dflash's DFLASH worker does not support data-parallel or context-parallel attention "
                         "(plain --tp N works)")
    if cfg.speculative_draft_window_size is not None:
        raise ValueError("sglang-dflash's DFLASH worker keeps each request's whole draft context: "
                         "--speculative-draft-window-size is not supported")
    if cfg.enable_unified_memory:
        raise ValueError("sglang-dflash's DFLASH worker indexes its draft context by the target's physical KV "
                         "slots: --enable-unified-memory is not supported")
    if cfg.speculative_draft_model_path is None:
        raise ValueError("DFLASH needs --speculative-draft-model-path")
    if cfg.enable_lora or (cfg.enable_lora is None and cfg.lora_paths):
        raise ValueError("sglang-dflash's DFLASH worker does not run LoRA adapters (its draft carries none, and its "
                         "verify forward has never been tested with one): --enable-lora / --lora-paths are not "
                         f"supported. {IMPL}=builtin runs SGLang's own DFLASH, which does")
    if cfg.grammar_backend not in (None, "xgrammar", "none"):
        raise ValueError(f"--grammar-backend {cfg.grammar_backend}: sglang-dflash's DFLASH worker walks a request's "
                         "grammar along the drafts and rolls it back, which needs a rejected token to leave the "
                         "grammar unchanged and rollback to work (xgrammar, SGLang's default, does both): use "
                         "--grammar-backend xgrammar")
    topk = 1 if cfg.speculative_eagle_topk is None else int(cfg.speculative_eagle_topk)
    if topk < 1:
        raise ValueError(f"--speculative-eagle-topk {cfg.speculative_eagle_topk}: give 1 (the draft's top-1 chain) "
                         "or k > 1 (a tree of its top-k tokens per row)")
    if topk > 1:  # tree verification (worker.tree_step): what it has been run and checked on
        import torch

        device = str(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))  # SGLang's own default
        tree_refusals = [
            (not device.startswith("cpu"), "has not run on a GPU yet (its verify must not replay "
             "the chain's CUDA graph, and SGLang's CUDA backends must read its custom mask: "
             "docs/tree-verification-plan.md, step 4): run it on a CPU or verify the chain (k = 1)"),
            (cfg.tp_size > 1, "has not been run with tensor parallelism yet: give --tp 1"),
        ]
        for refused, why in tree_refusals:
            if refused:
                raise ValueError(f"--speculative-eagle-topk {topk}: sglang-dflash's tree verification {why}")
    if cfg.speculative_num_steps is not None and int(cfg.speculative_num_steps) != 1:
        logger.warning("DFLASH drafts a block in one forward: --speculative-num-steps %s is EAGLE's, taken as 1",
                       cfg.speculative_num_steps)
    if cfg.speculative_adaptive_config is not None:
        raise ValueError("--speculative-adaptive-config holds EAGLE's step counts per batch size; DFLASH's adaptive "
                         "window measures its own step times and acceptance (sglang_dflash/window.py) and takes no "
                         "config: give --speculative-adaptive alone")
    draft = load_checked(cfg.speculative_draft_model_path, cfg.model_path, cfg.speculative_num_draft_tokens,
                         cfg.trust_remote_code)
    if cfg.speculative_dflash_block_size is not None and int(cfg.speculative_dflash_block_size) != draft.block_size:
        raise ValueError(f"--speculative-dflash-block-size {cfg.speculative_dflash_block_size} does not match "
                         f"the draft's block_size {draft.block_size}")
    # --speculative-num-draft-tokens K is the verify window: each step verifies the bonus token and the
    # first K-1 of the draft's B-1 proposals (a smaller K costs less per step when the draft's later
    # proposals are rarely accepted). Without it the window is adaptive, 1 … B, chosen each step from
    # measured step times and acceptance (window.py): the fastest setting by default. With it the window
    # is fixed at K, unless --speculative-adaptive is given too (then adaptive, 1 … K). With k > 1 the window
    # is a tree's node budget N (the root, the bonus token, included), chosen in 1 … N the same way.
    window = cfg.speculative_num_draft_tokens or draft.block_size
    adaptive = bool(cfg.speculative_adaptive) or cfg.speculative_num_draft_tokens is None
    decided = dict(speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=window,
                   speculative_adaptive=adaptive, disable_overlap_schedule=True)
    # SGLang caps every speculative server at 48 running requests. A fixed window keeps that cap; an adaptive one
    # does not need it (at a large batch it verifies one row, a plain decode step), and the server then runs as
    # many requests as it would without speculation (with the cap, a bench_serving run at concurrency 64 on
    # 2026-12-05 ran 48 requests at a time against the baseline's 64; that run is not recorded in benchmarks/).
    if cfg.max_running_requests is None and not adaptive:
        decided["max_running_requests"] = 48
        logger.info("DFLASH with a fixed verify window of %d: at most 48 running requests, SGLang's setting for "
                    "speculative servers (--max-running-requests overrides it)", window)
    declare_resolution(server_args, "sglang_dflash", **decided)


def keep_dflash_adaptive(original, server_args):
    """Around SGLang's _maybe_disable_adaptive and _init_adaptive_speculative_params, which run before the
    algorithm's own argument handling: SGLang's adaptive speculation is EAGLE's (it turns itself off for any
    other algorithm, and sets EAGLE's step counts and num_draft_tokens from its candidate steps). For DFLASH
    --speculative-adaptive means this worker's adaptive window, decided in handle_dflash_args."""
    from sglang.srt.arg_groups.overrides import resolving_view

    if resolving_view(server_args).speculative_algorithm == "DFLASH":
        return None
    return original(server_args)


def max_draft_tokens(original, self, server_args):
    """Around SpeculativeAlgorithm.resolve_max_speculative_num_draft_tokens: SGLang sizes an adaptive server for
    EAGLE's candidate step counts; DFLASH's adaptive window never exceeds --speculative-num-draft-tokens."""
    if self.is_dflash():
        from sglang.srt.arg_groups.overrides import resolving_view

        return resolving_view(server_args).speculative_num_draft_tokens
    return original(self, server_args)


def torch_native_forward_extend(original, self, q, k, v, layer, forward_batch, save_kv_cache=True):
    """TARGET_VERIFY on torch_native: only the block's queries, against prefix + block (causal, or a tree's
    ancestor masks when the verify input carries them: tree.TREE_MASK_ATTR)."""
    if not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, save_kv_cache)
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    from sglang_dflash.ops.attention import paged_block_attention
    from sglang_dflash.tree import TREE_MASK_ATTR

    if save_kv_cache and k is not None and v is not None:
        self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
    causal = not (layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY)
    n = q.shape[0] // forward_batch.batch_size
    block_mask = getattr(forward_batch.spec_info, TREE_MASK_ATTR, None)  # [bs, n, n] in a tree's verify, else None
    if block_mask is not None and tuple(block_mask.shape) != (forward_batch.batch_size, n, n):
        raise ValueError(f"a tree verify mask of shape {tuple(block_mask.shape)} for {forward_batch.batch_size} "
                         f"requests of {n} rows")
    out = paged_block_attention(
        q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
        self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.token_to_kv_pool.get_value_buffer(layer.layer_id),
        self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, n,
        layer.scaling, causal, block_mask)
    return out.reshape(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)


def refuse_dflash(registry, hook_type, error: Exception) -> None:
    """A setting this package cannot honour stops every DFLASH server with its message. Raising it from register()
    would not: SGLang's load_plugins logs a plugin's exception and goes on, and its builtin DFLASH would then run
    in place of this worker. So DFLASH's argument handling raises it (a server without DFLASH is unaffected)."""
    message = f"sglang-dflash cannot run DFLASH: {error}"
    logger.error(message)

    def refuse_args(original, server_args):
        raise ValueError(message)

    def refuse_worker(original, self, server_args):
        if self.is_dflash():
            raise ValueError(message)
        return original(self, server_args)

    registry.register(HANDLE_ARGS, refuse_args, hook_type.AROUND)
    registry.register(CREATE_WORKER, refuse_worker, hook_type.AROUND)


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_dflash import __version__, request_checks

    # with or without DFLASH: an empty prompt or an id outside the vocabulary gets a 400, not a dead server
    HookRegistry.register(request_checks.VALIDATE_REQUEST, request_checks.validate_one_request, HookType.AROUND)
    try:
        builtin = use_builtin()
    except ValueError as e:  # a bad SGLANG_DFLASH_* setting
        refuse_dflash(HookRegistry, HookType, e)
        return
    if builtin:
        logger.warning("sglang-dflash %s: %s: SGLang's own DFLASH runs", __version__, settings().describe())
        return
    HookRegistry.register(CREATE_WORKER, create_worker, HookType.AROUND)
    HookRegistry.register(HANDLE_ARGS, handle_dflash_args, HookType.AROUND)
    HookRegistry.register(MAYBE_DISABLE_ADAPTIVE, keep_dflash_adaptive, HookType.AROUND)
    HookRegistry.register(INIT_ADAPTIVE, keep_dflash_adaptive, HookType.AROUND)
    HookRegistry.register(MAX_DRAFT_TOKENS, max_draft_tokens, HookType.AROUND)
    HookRegistry.register(TORCH_NATIVE_EXTEND, torch_native_forward_extend, HookType.AROUND)
    registered_ops = []
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        from sglang_dflash.ops.cpu_kernels import register_missing_cpu_ops

        registered_ops = register_missing_cpu_ops()
        from sglang_dflash.cpu import gemm  # float32 products of the verify forward (only inside it)

        HookRegistry.register(LINEAR_APPLY, gemm.linear_method_apply, HookType.AROUND)
        HookRegistry.register(LM_HEAD, gemm.compute_lm_head, HookType.AROUND)
    logger.info("sglang-dflash %s plugin loaded in pid %d: DFLASH is sglang-dflash's worker%s", __version__,
                os.getpid(), f"; CPU ops added: {', '.join(registered_ops)}" if registered_ops else "")
