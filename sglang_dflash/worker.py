"""The DFLASH speculative worker inside SGLang: one decode step is

    build_block -> draft -> verify -> accept -> commit

over a batch of requests, run synchronously by SGLang's scheduler (no overlap).
Prefill runs the target with hidden-state capture and writes the draft context
K/V of every prompt token. The draft's context K/V live in a paged store
indexed by the target's own KV slots (see models/paged.py).

Tensor parallelism: the target is sharded as SGLang shards it, and so is the draft (its heads
and MLP split over the ranks by SGLang's parallel linears, models/sharded.py; its context store
holds the rank's kv heads); it proposes through the target's vocabulary-sharded lm_head
(draft_head.py). Every rank must feed the target's collectives the same tokens and commit the
same lengths: greedy decisions are made from inputs that are identical on every rank (the
gathered verify logits, the all-reduced hidden states of target and draft), so they agree by
construction; random draws (sampled drafts, rejection sampling) are taken from rank 0
(`tp_broadcast`).

Tree verification (--speculative-eagle-topk k > 1, tree.py): the same step with a tree of N nodes in place of
the chain's K rows (tree_step): the best-first tree of the draft's top-k tokens per row, verified in one
forward with each node seeing its ancestors, the longest root path of the target's own tokens accepted.

Shapes: bs requests, B the draft's block size, K ≤ B the verify window (--speculative-num-draft-tokens;
adaptive by default or with --speculative-adaptive: chosen each step from 1 … K, or 1 … B, window.py; K = 1
is a plain decode step), N ≤ B a tree's nodes (the root included), V vocabulary, F = features × hidden.
"""

from __future__ import annotations

import logging

import torch

from sglang_dflash import __version__, block_logits
from sglang_dflash.accept import (SALT_DRAFT, SALT_TREE, accept_greedy, accept_sampled_rows, draw, filtered_probs,
                                   sample_inverse_cdf, seeded_uniform)
from sglang_dflash.block import make_block
from sglang_dflash.config import load_checked
from sglang_dflash.cpu import gemm
from sglang_dflash.draft_head import DraftHead
from sglang_dflash.draft_input import make_draft_input
from sglang_dflash.models.paged import PagedDraft
from sglang_dflash.models.sharded import ShardedDraftModel
from sglang_dflash.ops import kernels
from sglang_dflash.settings import settings
from sglang_dflash.sglang_adapter import SGLangSpecWorker
from sglang_dflash.step_stats import NO_STATS, StepStats
from sglang_dflash.tree import (TREE_MASK_ATTR, accept_trees_greedy, accept_trees_sampled, ancestor_mask, build_trees,
                                path_order)
from sglang_dflash.window import AdaptiveWindow

logger = logging.getLogger(__name__)


class DFlashWorker(SGLangSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__(target_worker)
        self.server_args = server_args
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        self.dtype = self.model_runner.dtype
        from sglang.srt.configs.hybrid_arch import mambaish_config

        if mambaish_config(self.model_runner.model_config) is not None:
            raise ValueError(f"{server_args.model_path} is a hybrid (Mamba / linear-attention) model: sglang-dflash's "
                             "DFLASH worker verifies only attention targets (their state cannot be rolled back "
                             "to the accepted prefix yet)")
        self.config = load_checked(server_args.speculative_draft_model_path, server_args.model_path,
                                   server_args.speculative_num_draft_tokens, server_args.trust_remote_code)
        self.block_size = self.config.block_size  # B: the draft's block (what it was trained to fill)
        # what plugin.handle_dflash_args decided (SGLang keeps resolved values beside the command line's)
        from sglang.srt.arg_groups.overrides import resolved_view

        self.spec_args = resolved_view(server_args)
        self.window = self.spec_args.speculative_num_draft_tokens or self.block_size  # K ≤ B tokens verified per step
        # k > 1: tree verification with N = window nodes. SGLang's own resolved topk stays 1 (plugin.py): its
        # value switches SGLang's attention backends and memory pools into EAGLE's tree layouts
        self.topk = int(server_args.speculative_eagle_topk or 1)
        self.draft_model = ShardedDraftModel.from_pretrained(server_args.speculative_draft_model_path, dtype=self.dtype,
                                                             device=self.device)
        self.draft: PagedDraft | None = None  # allocated once the target's KV pool exists
        target = self.model_runner.model
        self.embed = target.get_input_embeddings()
        self.vocab_size = self.model_runner.model_config.vocab_size
        self.tp_size = server_args.tp_size
        self.head = DraftHead.of_target(target.lm_head, self.vocab_size, self.tp_size)
        self.layer_ids = self.config.target_layer_ids
        self.page_size = server_args.page_size or 1
        self.settings = settings()
        # step statistics for benchmarks (step_stats.py), when the stats file setting is given
        self.stats = StepStats(self.settings.stats_file, self.window, self.device, self.settings.profile) \
            if self.settings.stats_file else NO_STATS
        self.warned_custom = False
        self.adaptive = self.window_policy()
        self.cut_rows = not self.graphs()  # rows_used
        attn = self.draft_model.layers[0].self_attn
        step_ops = "CUDA kernels" if kernels.extension_available() and self.device != "cpu" else "torch twins"
        logger.info("sglang-dflash %s DFLASH worker: draft %s (%d layers, block %d, target layers %s), %s, "
                    "%s %s, step ops: %s, tp %d (draft heads per rank: %d query, %d kv); %s", __version__,
                    server_args.speculative_draft_model_path, len(self.draft_model.layers), self.block_size,
                    self.layer_ids, self.describe_window(), self.device,
                    self.dtype, step_ops, self.tp_size, attn.h, attn.kvh, self.settings.describe())

    def describe_window(self) -> str:
        """The start-up line's words for what each step verifies."""
        if self.topk > 1:
            budget = f"adaptive 1-{self.window}" if self.adaptive else f"{self.window}"
            return f"tree verification of {budget} nodes from the top {self.topk} per row"
        return f"verify window adaptive 1-{self.window}" if self.adaptive else f"verify window {self.window}"

    # ---- what the scheduler calls at start-up (the rest: sglang_adapter.py) ----
    def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None):
        # The draft's context store has one row per target KV slot (the slot ids are shared).
        num_slots = self.model_runner.token_to_kv_pool.get_key_buffer(0).shape[0]
        self.draft = PagedDraft(self.draft_model, num_slots, self.device, self.dtype)

    # ---- every forward ----------------------------------------------------
    def before_forward(self, batch) -> None:
        if self.adaptive is not None:  # the last decode step's wall time ends here (window.py's step clock)
            self.adaptive.end_step(batch.forward_mode.is_decode())

    def prefill(self, batch):
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        out = self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        features = out.logits_output.hidden_states  # [extend tokens, F]
        if features is None or features.shape[-1] != self.draft_model.fc.in_features:
            raise RuntimeError(f"the target captured hidden states of width "
                               f"{None if features is None else features.shape[-1]}, the draft needs "
                               f"{self.draft_model.fc.in_features} (layers {self.layer_ids})")
        positions = torch.cat([torch.arange(p, p + n, device=self.device)
                               for p, n in zip(batch.prefix_lens, batch.extend_lens)])
        slots = batch.out_cache_loc[: positions.numel()]
        self.draft.write_context(features[: positions.numel()], positions, slots)
        out.logits_output.hidden_states = None
        out.new_seq_lens = batch.seq_lens
        out.next_draft_input = make_draft_input(out.next_token_ids, batch.seq_lens)
        return out

    def decode_step(self, batch):
        from sglang.srt.managers.utils import GenerationBatchResult

        K = self.choose_window(batch)  # rows verified per request: the bonus token and K-1 drafts (a tree: K nodes)
        if self.topk > 1 and K > 1:
            return self.tree_step(batch, K)
        prefix_lens = batch.seq_lens.long()  # [bs] committed tokens; the bonus token is not in the KV yet
        req_to_token = batch.req_to_token_pool.req_to_token
        sampling = None if batch.sampling_info.is_all_greedy else batch.sampling_info
        with self.stats.phase("build_block"):  # block_ids, positions, slots [bs, K]
            block_ids, positions, slots = self.build_block(batch.spec_info.bonus_tokens, prefix_lens,
                                                           batch.req_pool_indices, req_to_token, K)
        with self.stats.phase("draft"):  # draft_tokens [bs, K-1]; q [bs, K-1, V] when sampling
            if K == 1:  # a plain decode step: nothing to draft
                draft_tokens, q = block_ids[:, 1:], None
            else:
                draft_tokens, q = self.draft_forward(block_ids, positions, req_to_token, batch.req_pool_indices,
                                                     prefix_lens, sampling, max_prefix=self.host_max(batch))
                if sampling is not None:
                    self.tp_broadcast(draft_tokens)
                block_ids[:, 1:] = draft_tokens
        with self.stats.phase("verify"):  # logits [bs, K, V], features [bs, K, F]
            logits_output, logits, features, graphed = self.verify(batch, block_ids, positions, slots)
        with self.stats.phase("accept"):  # accept_len [bs] in 0 … K-1, next_token [bs]
            accept_len, next_token = self.accept(draft_tokens, q, logits, positions, sampling)
            if sampling is not None:
                self.tp_broadcast(accept_len, next_token)
        commit_lens = accept_len + 1  # the old bonus + accepted drafts enter the KV; next_token is the new bonus
        with self.stats.phase("commit"):
            self.commit(features, positions, slots, commit_lens)
        if self.adaptive is not None:
            self.adaptive.observe_accepts(accept_len.tolist(), K)
        self.stats.record(commit_lens, K, self.adaptive)

        # [bs, K]: row i emits out_tokens[i, :commit_lens[i]] (its accepted drafts, then next_token)
        out_tokens = torch.cat([draft_tokens, next_token[:, None]], dim=1)
        out_tokens.scatter_(1, accept_len[:, None], next_token[:, None])
        new_seq_lens = prefix_lens + commit_lens
        if batch.return_logprob:  # [bs, K] logprobs of out_tokens (+ top-k / token-id lists), as the scheduler reads them
            from sglang.srt.layers.logprob_processor import compute_spec_logprobs

            compute_spec_logprobs(batch, logits_output, out_tokens.reshape(-1), chain_stride=K)
        logits_output.hidden_states = None
        return GenerationBatchResult(
            logits_output=logits_output, next_token_ids=out_tokens.reshape(-1), accept_lens=commit_lens.to(torch.int32),
            new_seq_lens=new_seq_lens, next_draft_input=make_draft_input(next_token, new_seq_lens),
            speculative_num_draft_tokens=K, can_run_cuda_graph=graphed)

    def tree_step(self, batch, N: int):
        """A decode step that verifies a tree of N nodes (--speculative-eagle-topk k > 1; tree.py): the draft's
        rows 1 … N-1 as distributions -> the best-first tree of the N most likely paths of their top-k tokens ->
        one verify forward, node m at position prefix + depth(m) seeing its ancestors -> the longest root path of
        the target's own tokens (greedy; sampled: drawn from the target's distribution node by node, exact) ->
        its K/V at the committed positions (keep_path) and its draft context written. The tree has 2 ≤ N ≤ B
        nodes, one verify row each (a budget of one node is the chain's plain decode step)."""
        from sglang.srt.managers.utils import GenerationBatchResult

        prefix_lens = batch.seq_lens.long()  # [bs]
        rpi, req_to_token = batch.req_pool_indices, batch.req_to_token_pool.req_to_token
        sampling = None if batch.sampling_info.is_all_greedy else batch.sampling_info
        bonus = batch.spec_info.bonus_tokens
        with self.stats.phase("build_block"):  # block_ids, positions (prefix … prefix+N-1), slots [bs, N]
            block_ids, positions, slots = self.build_block(bonus, prefix_lens, rpi, req_to_token, N)
        with self.stats.phase("draft"):  # tokens, parents, depths [bs, N]
            rows = self.draft_rows(block_ids, positions, req_to_token, rpi, prefix_lens, self.host_max(batch))
            logprobs = torch.log_softmax(self.head.logits(rows).float(), dim=-1).view(block_ids.shape[0], N - 1, -1)
            tokens, parents, depths = build_trees(logprobs, self.topk, N, bonus)
            anc = torch.stack([ancestor_mask(row) for row in parents.cpu()]).to(tokens.device)  # [bs, N, N]
        with self.stats.phase("verify"):  # logits [bs, N, V], features [bs, N, F]
            logits_output, logits, features, graphed = self.verify(batch, tokens, prefix_lens[:, None] + depths,
                                                                   slots, parents, anc)
        with self.stats.phase("accept"):  # paths [bs, D+1] (root first), accept_len [bs], next_token [bs]
            if sampling is None:
                paths, accept_len, next_token = accept_trees_greedy(tokens, parents, logits.argmax(-1), anc)
            else:
                paths, accept_len, next_token = accept_trees_sampled(
                    tokens, parents, self.node_probs(logits, sampling), self.tree_uniforms(sampling, prefix_lens,
                                                                                           int(depths.max()) + 1))
        commit_lens = accept_len + 1
        on_path = paths.shape[1]
        with self.stats.phase("commit"):  # the path's K/V at positions prefix … prefix + accept_len, then its context
            kept = self.keep_path(req_to_token, rpi, positions, slots, paths, accept_len)  # [bs, on_path]
            self.commit(features.gather(1, paths[:, :, None].expand(-1, -1, features.shape[-1])),
                        positions[:, :on_path], kept, commit_lens)
        if self.adaptive is not None:  # which nodes each request accepted (paths repeat their last node)
            taken = torch.zeros_like(tokens, dtype=torch.bool).scatter_(1, paths, True)  # [bs, N]
            self.adaptive.observe_nodes(taken[:, 1:].sum(0).tolist(), len(paths), N)
        self.stats.record_tree(tokens, depths, logprobs, paths, accept_len)
        self.stats.record(commit_lens, N, self.adaptive)

        # [bs, N]: row i emits out_tokens[i, :commit_lens[i]] (its path's drafts, then next_token)
        on_path_tokens = torch.cat([tokens.gather(1, paths[:, 1:]), next_token[:, None].expand(-1, N - on_path + 1)], 1)
        past = torch.arange(N, device=paths.device)[None, :] >= accept_len[:, None]  # next_token there and after
        out_tokens = torch.where(past, next_token[:, None], on_path_tokens)
        new_seq_lens = prefix_lens + commit_lens
        if batch.return_logprob:  # token j of row i was predicted at node paths[i, j] (logits row i·N + that node)
            from sglang.srt.layers.logprob_processor import compute_spec_logprobs

            accept_index = torch.arange(len(paths), device=paths.device)[:, None] * N + paths  # [bs, D+1]
            predict = torch.zeros(len(paths) * N, dtype=torch.long, device=paths.device)
            # the padding repeats the path's last node, with the same token (next_token) each time
            predict[accept_index.reshape(-1)] = out_tokens[:, :on_path].reshape(-1)
            compute_spec_logprobs(batch, logits_output, predict, accept_index=accept_index)
        logits_output.hidden_states = None
        return GenerationBatchResult(
            logits_output=logits_output, next_token_ids=out_tokens.reshape(-1), accept_lens=commit_lens.to(torch.int32),
            new_seq_lens=new_seq_lens, next_draft_input=make_draft_input(next_token, new_seq_lens),
            speculative_num_draft_tokens=N, can_run_cuda_graph=graphed)

    def keep_path(self, req_to_token, rpi, positions, slots, paths, accept_len) -> torch.Tensor:
        """Put each request's accepted path where the next steps read the committed tokens: the K/V the verify wrote
        for path node paths[i, j] becomes position prefix + j's -> the slots of positions prefix … prefix + D
        [bs, D+1] from now on.
        Page size 1: the window's req_to_token entries are permuted, the path's slots first (no K/V moves); the
        other slots stay in the row for the next step, as the chain's unaccepted rows do.
        Pages of more than one slot: a row must stay page-aligned (the allocator frees whole pages, the radix cache
        keeps page-aligned prefixes), so node paths[i, j]'s K/V is copied, in every layer, to the slot of position
        prefix + j (SGLang's pool.move_kv_cache), in path order: paths[i, j] ≥ j and increases along the path, so
        no copy reads a slot that an earlier copy of the request wrote, and each reads its node before a later
        one writes there."""
        N, on_path = slots.shape[1], paths.shape[1]
        if self.page_size == 1:
            kept = slots.gather(1, path_order(paths, accept_len, N))  # position prefix + j's slot from now on
            req_to_token[rpi[:, None].long(), positions] = kept.to(req_to_token.dtype)
            return kept[:, :on_path]
        place = torch.arange(on_path, device=paths.device)[None, :]
        moved = (place <= accept_len[:, None]) & (paths != place)  # [bs, D+1] accepted nodes off the first places
        dst, src = slots[:, :on_path], slots.gather(1, paths)  # row-major: each request's copies in path order
        self.model_runner.token_to_kv_pool.move_kv_cache(dst[moved], src[moved])
        return dst

    @staticmethod
    def node_probs(logits, info):
        """p_node(rows, nodes) -> [len(rows), V]: the target's filtered distribution at those nodes (what SGLang's
        sampler would draw from there), formed only for the nodes a sampled walk reaches."""
        temps, min_ps = info.temperatures.view(-1), info.min_ps if info.need_min_p_sampling else None

        def p_node(rows, nodes):
            return filtered_probs(logits[rows, nodes], temps[rows], info.top_ks[rows], info.top_ps[rows],
                                  None if min_ps is None else min_ps[rows])
        return p_node

    @staticmethod
    def tree_uniforms(info, prefix_lens, depths: int) -> torch.Tensor:
        """[bs, depths] uniforms of a sampled tree walk, one per depth: seeded requests (SGLang's sampling_seed,
        --enable-deterministic-inference) hash (seed, the position of the token drawn, SALT_TREE), as the chain's
        draws do; the others draw from torch's generator."""
        bs = prefix_lens.numel()
        if info.sampling_seed is not None:
            positions = prefix_lens[:, None] + 1 + torch.arange(depths, device=prefix_lens.device)
            return seeded_uniform(info.sampling_seed, positions, SALT_TREE)
        return torch.rand(bs, depths, dtype=torch.float64, device=prefix_lens.device).clamp_(min=1e-12)

    def window_policy(self) -> AdaptiveWindow | None:
        """Adaptive (window.py) when the server resolved speculative_adaptive (plugin.handle_dflash_args: no
        --speculative-num-draft-tokens given, or --speculative-adaptive), else every step verifies the window."""
        if not (self.spec_args.speculative_adaptive and self.window >= 2):
            return None
        # with CUDA graphs: measured anchors only (window.py); with k > 1 the window is the tree's node budget
        return AdaptiveWindow(self.window, anchors_only=self.graphs(), chain=self.topk == 1)

    def graphs(self) -> bool:
        """Whether the target's verify forward replays CUDA graphs (captured for the anchor windows)."""
        return str(self.device).startswith("cuda") and not self.spec_args.disable_cuda_graph

    def choose_window(self, batch) -> int:
        """The step's verify window: K, or when adaptive the one expected to commit the most tokens per second
        at this batch size (window.py). Seeded requests keep the fixed window K: their tokens then depend on
        the seed alone, not on the load. A chain's window is then cut to the rows its requests can use
        (rows_used)."""
        if self.adaptive is None or batch.sampling_info.sampling_seed is not None:
            return self.rows_used(batch, self.window)
        bs = batch.batch_size()
        k = self.adaptive.choose(bs)
        if self.tp_size > 1:  # step times differ between ranks: rank 0 decides
            chosen = torch.tensor([k], device=self.device)
            self.tp_broadcast(chosen)
            k = int(chosen)
        k = self.rows_used(batch, k)
        self.adaptive.start_step(bs, k)
        return k

    def rows_used(self, batch, K: int) -> int:
        """K, or fewer rows where no request of the batch can use K: row j decides a request's (j+1)-th new
        token (accepting or rejecting draft j+1, or drawing the target's own), from rows 0 … j alone, so with
        at most n tokens left to any request (max_new_tokens) rows past n + 1 change no token nor its
        distribution, seeded or not: the last steps of short requests verify fewer rows. Not for a tree
        (its budget buys siblings, not depth) nor where the target's CUDA graph, captured for K, would replay."""
        if self.topk > 1 or not self.cut_rows:
            return K
        left = [req.sampling_params.max_new_tokens for req in batch.reqs]
        if None in left:  # no limit given (SGLang sets one from the context length; unreached here)
            return K
        return min(K, max(n - len(req.output_ids) for n, req in zip(left, batch.reqs)) + 1)

    @staticmethod
    def host_max(batch) -> int | None:
        """The longest committed length of the batch from the scheduler's host copy (no device sync), if kept."""
        return int(batch.seq_lens_cpu.max()) if batch.seq_lens_cpu is not None else None

    def tp_broadcast(self, *tensors: torch.Tensor) -> None:
        """Overwrite tensors in place with TP rank 0's values (random draws differ between ranks)."""
        if self.tp_size == 1:
            return
        from sglang.srt.distributed import get_tp_group

        for t in tensors:
            get_tp_group().broadcast(t, src=0)

    # ---- the five steps -------------------------------------------------
    def build_block(self, bonus_tokens, prefix_lens, req_pool_indices, req_to_token, K: int):
        """[bonus, MASK, …] per request, positions prefix … prefix + K - 1, and their KV slots (reserved
        by the scheduler's prepare_for_decode) -> three [bs, K] tensors."""
        return kernels.build_block(bonus_tokens, prefix_lens, req_pool_indices, req_to_token,
                                   self.config.mask_token_id, K, self.page_size)

    def draft_forward(self, block_ids, positions, req_to_token, req_pool_indices, prefix_lens, sampling_info,
                      max_prefix: int | None = None):
        """One non-causal draft forward over the whole block of B positions (the shape the draft was
        trained on), given the window's block_ids [bs, K] (bonus, MASK, …) -> draft tokens [bs, K-1] and,
        when sampling, their distributions q [bs, K-1, V]."""
        bs, K = block_ids.shape
        rows = self.draft_rows(block_ids, positions, req_to_token, req_pool_indices, prefix_lens, max_prefix)
        if sampling_info is None:
            return self.head.argmax(rows).view(bs, K - 1), None
        logits = self.head.logits(rows).view(bs, K - 1, -1)  # [bs, K-1, V]
        greedy = (sampling_info.top_ks == 1).view(-1, 1, 1)
        q = torch.softmax(logits / sampling_info.temperatures.float().view(-1, 1, 1), dim=-1)
        if bool(greedy.any()):  # greedy rows of a mixed batch propose their argmax (q a point mass)
            q = torch.where(greedy, torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float(), q)
        seeds = sampling_info.sampling_seed  # set by SGLang under --enable-deterministic-inference
        if seeds is None:
            tokens = draw(q)
        else:
            tokens = sample_inverse_cdf(q, seeded_uniform(seeds, positions[:, 1:], SALT_DRAFT))
        return tokens, q

    def draft_rows(self, block_ids, positions, req_to_token, req_pool_indices, prefix_lens, max_prefix=None):
        """The draft's hidden states at block rows 1 … K-1 -> [bs·(K-1), H], from one non-causal forward over its
        whole block of B positions (the shape the draft was trained on: [bonus, MASK, …] at prefix … prefix + B-1,
        whatever the window), given the window's block_ids [bs, K] (bonus, MASK, …) at positions [bs, K]."""
        bs, K = block_ids.shape
        B = self.block_size
        block_ids, block_pos = make_block(block_ids[:, 0], positions[:, 0], B, self.config.mask_token_id)  # [bs, B]
        embeds = self.embed(block_ids.reshape(-1)).view(bs, B, -1)
        hidden = self.draft.forward_block(embeds, block_pos, req_to_token, req_pool_indices, prefix_lens, max_prefix)
        return hidden[:, 1:K].reshape(bs * (K - 1), -1)  # one GEMM for the head (a strided 3-D operand: a bmm)

    def verify(self, batch, block_ids, positions, slots, parents=None, ancestors=None):
        """One target forward over every request's block (TARGET_VERIFY), capturing the hidden states at
        the draft's target layers -> (logits output, logits [bs, K, V], features [bs, K, F], whether it
        replayed the target's CUDA graph). The logits are the ones the non-speculative sampler would see at
        each row: the request's penalties, grammar, logit_bias and custom processors applied as if the drafts
        before the row were its output. With a tree's parents [bs, K] and ancestor masks [bs, K, K]: row m is
        node m at its position, seeing its ancestors only (tree.TREE_MASK_ATTR), and its rules follow its path."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.dflash_info import DFlashVerifyInput

        bs, K = block_ids.shape
        verify_input = DFlashVerifyInput(draft_token=block_ids.reshape(-1), positions=positions.reshape(-1),
                                         draft_token_num=K, custom_mask=None,
                                         capture_hidden_mode=CaptureHiddenMode.FULL)
        if ancestors is not None:  # the CPU engine's verify attention reads it (plugin.torch_native_forward_extend)
            setattr(verify_input, TREE_MASK_ATTR, ancestors)
        # The one place the step writes to the scheduler's batch, as SGLang's own verify does (its pools are written
        # by the forward and, for a tree step, by keep_path): out_cache_loc
        # is where the verify forward writes the block's K/V (the slots the scheduler reserved). And the
        # attention backends plan a verify batch from the KV length with the block (seq_lens_cpu + K on the
        # host: FlashInfer's CUDA-graph plan reads it; the device side adds K itself), so the host lengths
        # carry + K while the forward is prepared and are put back at once; the forward must not plan again.
        batch.out_cache_loc = slots.reshape(-1)
        committed_cpu, committed_sum = batch.seq_lens_cpu, batch.seq_lens_sum
        if committed_cpu is not None:
            batch.seq_lens_cpu = committed_cpu + K
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        try:
            forward_batch, graphed = verify_input.prepare_for_verify(batch, self.target_worker)
        finally:
            batch.seq_lens_cpu, batch.seq_lens_sum = committed_cpu, committed_sum
        forward_batch.mark_forward_metadata_ready()
        with gemm.verify_scope():  # on a CPU in float32: the block's rows through the faster product
            result = self.target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch,
                                                                 is_verify=True)
        out = result.logits_output
        logits = out.next_token_logits[: bs * K].view(bs, K, -1)
        if block_logits.needs_rules(batch):
            if batch.sampling_info.has_custom_logit_processor and not self.warned_custom:
                self.warned_custom = True
                logger.warning("custom logit processors run once per verify block with the request's committed "
                               "output: one that reads the output so far does not see the block's drafts")
            block_logits.apply_rules(logits, block_ids, batch, parents)
        return out, logits, out.hidden_states[: bs * K].view(bs, K, -1), graphed

    def accept(self, draft_tokens, q, logits, positions, sampling_info):
        """Greedy: longest matching prefix + the target's token. Sampling: rejection sampling with q.
        The target's filtered distribution p (what SGLang's sampler would sample from) is formed, on
        the CPU, only for the block rows acceptance reaches (the work is proportional to the rows);
        on a GPU for all rows in one pass (there the launches and host syncs of row-by-row cost
        more: benchmarks/kernels.py measures both)."""
        if sampling_info is None:
            return accept_greedy(draft_tokens, logits)
        if q is None:  # a plain decode step: no drafts, the token is drawn from the first row
            q = torch.zeros(logits.shape[0], 0, logits.shape[-1], device=logits.device)
        info = sampling_info
        temps, min_ps = info.temperatures.view(-1), info.min_ps if info.need_min_p_sampling else None
        if logits.device.type == "cpu":
            def p_row(j, rows):  # [len(rows), V]
                return filtered_probs(logits[rows, j], temps[rows], info.top_ks[rows], info.top_ps[rows],
                                      None if min_ps is None else min_ps[rows])
        else:
            bs, K, V = logits.shape
            rep = lambda t: t.repeat_interleave(K)  # noqa: E731  (one row per block position)
            p = filtered_probs(logits.reshape(bs * K, V), rep(temps), rep(info.top_ks), rep(info.top_ps),
                               None if min_ps is None else rep(min_ps)).view(bs, K, V)
            p_row = lambda j, rows: p[rows, j]  # noqa: E731
        return accept_sampled_rows(draft_tokens, q, p_row, seeds=info.sampling_seed, positions=positions)

    def commit(self, features, positions, slots, commit_lens):
        """Write the draft context K/V of the committed block rows (bonus + accepted drafts)."""
        rows, row_positions, row_slots, total = kernels.gather_context_features(features, commit_lens, positions, slots)
        n = int(total)  # one host sync; the scheduler reads the accept lengths on the host every step anyway
        self.draft.write_context(rows[:n], row_positions[:n], row_slots[:n])
