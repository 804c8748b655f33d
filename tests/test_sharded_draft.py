"""The serving draft built from SGLang's tensor-parallel layers (models/sharded.py) computes what the
reference model computes, at world size 1 and 2 (gloo on this CPU, one process per rank), from a
published-format checkpoint, with fewer kv heads than ranks too."""

import multiprocessing as mp
import os

import pytest
import torch

from sglang_dflash.config import DraftConfig
from sglang_dflash.models.reference import DFlashDraftModel
from sglang_dflash.server import free_port

pytestmark = pytest.mark.process


def draft_config(heads: int, kv_heads: int, attention_bias: bool = False, width: int = 96) -> DraftConfig:
    return DraftConfig(hidden_size=64, intermediate_size=width, num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=16, vocab_size=64, block_size=8, num_target_layers=6,
                       target_layer_ids=[1, 3], mask_token_id=63, attention_bias=attention_bias)


def rank_main(rank: int, world: int, port: int, path: str, dtype: torch.dtype, out: str) -> None:
    """One rank: build the sharded draft under SGLang's parallel state, write a context into a paged
    store and draft a block; save its hidden states and its context keys next to the reference's."""
    report = {"rank": rank}
    try:
        from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from sglang.test.test_utils import publish_build_topology

        from sglang_dflash.models.paged import PagedDraft
        from sglang_dflash.models.sharded import ShardedDraftModel

        torch.set_num_threads(1)
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        publish_build_topology(world_rank=rank, tp_size=world, device="cpu")
        initialize_model_parallel(backend="gloo")  # at the published tp_size

        ref = DFlashDraftModel.from_pretrained(path, dtype=dtype)
        model = ShardedDraftModel.from_pretrained(path, dtype=dtype)
        cfg = model.config
        g = torch.Generator().manual_seed(1)
        C, B = 21, cfg.block_size
        features = torch.randn(C, cfg.num_features * cfg.hidden_size, generator=g).to(dtype)
        embeds = torch.randn(1, B, cfg.hidden_size, generator=g).to(dtype)
        positions = torch.arange(C, C + B)[None]
        paged = PagedDraft(model, 64, "cpu", dtype)
        slots = torch.randperm(64, generator=g)[:C]
        paged.write_context(features, torch.arange(C), slots)
        req_to_token = slots[None].int()
        hidden = paged.forward_block(embeds, positions, req_to_token, torch.tensor([0]), torch.tensor([C]))

        ctx = ref.context_kv(features[None], torch.arange(C)[None])
        want = ref(embeds, positions, ctx)
        attn = model.layers[0].self_attn
        replicas = max(1, world // cfg.num_key_value_heads)  # ranks sharing one kv head (padded config)
        first = min(rank // replicas * attn.kvh, ref.config.num_key_value_heads)  # past the real heads: padding
        want_keys = ctx.keys[0][0, first:first + attn.kvh]
        want_keys = torch.cat([want_keys, want_keys.new_zeros(attn.kvh - len(want_keys), *want_keys.shape[1:])])
        report.update(heads=(attn.h, attn.kvh), hidden=hidden.float(), want=want.float(),
                      keys=paged.k[0, slots].transpose(0, 1).float(), want_keys=want_keys.float())
    except BaseException:  # noqa: BLE001  (reported to the test, which fails with it)
        import traceback

        report["error"] = traceback.format_exc()
    torch.save(report, out)
    os._exit(0)  # not SGLang's and gloo's exit handlers: the report is written


@pytest.mark.parametrize("world,heads,kv_heads,bias,width,dtype,local_heads", [
    (1, 4, 2, False, 96, torch.float32, (4, 2)),
    (2, 4, 2, False, 96, torch.float32, (2, 1)),
    (2, 4, 1, True, 96, torch.float32, (2, 1)),  # one kv head, two ranks: each holds a copy
    (2, 9, 3, False, 95, torch.float32, (6, 2)),  # SmolLM2's heads and an odd MLP: padded to 12 / 4 and 96
    (2, 4, 2, False, 96, torch.bfloat16, (2, 1)),
])
def test_sharded_draft_equals_reference(tmp_path, monkeypatch, world, heads, kv_heads, bias, width, dtype,
                                        local_heads):
    monkeypatch.setenv("SGLANG_NCCL_SO_PATH", str(tmp_path / "no-nccl-on-cpu.so"))  # ranks talk over gloo
    # saved in bfloat16 when the server runs in float32 and the other way round: the load converts
    saved = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    DFlashDraftModel.random(draft_config(heads, kv_heads, bias, width), seed=3, dtype=saved).save_pretrained(tmp_path)
    ctx, port = mp.get_context("spawn"), free_port()
    outs = [tmp_path / f"rank{r}.pt" for r in range(world)]
    procs = [ctx.Process(target=rank_main, args=(r, world, port, str(tmp_path), dtype, str(outs[r])))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    for out in outs:
        r = torch.load(out)
        assert "error" not in r, f"rank {r['rank']}:\n{r['error']}"
        assert r["heads"] == local_heads  # this rank's query and kv heads
        torch.testing.assert_close(r["keys"], r["want_keys"], **tol)  # its kv heads of the context
        torch.testing.assert_close(r["hidden"], r["want"], **tol)  # the block's hidden states, all-reduced
