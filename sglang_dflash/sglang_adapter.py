"""What SGLang's scheduler asks of a speculative worker beyond the algorithm: start-up hooks it calls
(memory pools, attention backends, CUDA graphs), anything else a model worker answers (delegated to the
target's worker), and the dispatch of each forward batch to prefill or decode. worker.py's DFlashWorker
subclasses it and holds the algorithm. (SGLang 0.5.23's interface: docs/sglang-0.5.23-worker-interface.md.)
"""

from __future__ import annotations


def _base():
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

    return BaseSpecWorker


class SGLangSpecWorker(_base()):
    def __init__(self, target_worker):
        super().__init__()
        self._target_worker = target_worker
        self._draft_worker = None

    # ---- what the scheduler calls at start-up: this worker needs none of it --------------------------------
    def init_attention_backends(self):
        pass  # the draft attends through sglang_dflash.ops, not an SGLang attention backend

    def init_cuda_graphs(self):
        pass

    def _draft_model_runners(self):
        return ()

    def weight_update_runners(self):
        return []

    def clear_cache_pool(self):
        pass  # slots are reused through the target's allocator; stale draft K/V is overwritten on reuse

    def __getattr__(self, name):
        # Anything else the scheduler asks of a model worker is the target's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._target_worker, name)

    # ---- every forward ---------------------------------------------------------------------------------------
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None, **kw):
        self.before_forward(batch)
        if batch.forward_mode.is_extend():
            return self.prefill(batch)
        if batch.forward_mode.is_idle():
            raise NotImplementedError("idle batches (data parallel attention) are not supported")
        if grammar_barrier is not None:  # the overlap scheduler's pending grammar advance
            grammar_barrier()
        return self.decode_step(batch)

    def before_forward(self, batch) -> None:
        pass

    def prefill(self, batch):
        raise NotImplementedError

    def decode_step(self, batch):
        raise NotImplementedError
