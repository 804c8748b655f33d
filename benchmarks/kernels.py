"""The GPU check of csrc/ and the Triton draft attention: build the extension, check every kernel
against its plain-torch twin, time both, and time a Qwen3-8B-shaped 5-layer DFlash draft forward at
block 16, dense (models/reference.py) and as the server runs it (models/paged.py).

    python benchmarks/kernels.py [--out kernels.md]     # on a machine with an NVIDIA GPU

Needs torch with CUDA and nvcc; not SGLang (it imports only sglang_dflash.ops / models / config,
from this checkout). Each kernel's achieved bandwidth (bytes it must read and write / time) is
printed against the copy bandwidth measured here; the draft forward against the time it takes
to read its weights and the context K/V once at that copy bandwidth (the memory floor).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_dflash.config import DraftConfig  # noqa: E402
from sglang_dflash.models.reference import ContextCache, DFlashDraftModel  # noqa: E402
from sglang_dflash.accept import accept_sampled, accept_sampled_rows, filtered_probs  # noqa: E402
from sglang_dflash.ops import kernels  # noqa: E402


def load_extension():
    """The installed sglang_dflash._C if it imports, else a JIT build of csrc/dflash_kernels.cu."""
    if kernels.extension_available():
        return "installed sglang_dflash._C"
    from torch.utils.cpp_extension import load

    t0 = time.time()
    kernels._C = load(name="sglang_dflash_C", sources=[str(ROOT / "csrc" / "dflash_kernels.cu")],
                      extra_cuda_cflags=["-O3", "--use_fast_math"], extra_cflags=["-O3"], verbose=False)
    return f"JIT-built from csrc/ in {time.time() - t0:.0f} s (installed one: {kernels.EXTENSION_ERROR})"


def cuda_time(fn, iters: int = 200) -> float:
    """Median seconds per call over iters calls, after a warm-up."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = cuda_time(lambda: y.copy_(x), iters=20)
    return 2 * x.numel() / t


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def kernel_rows(bw: float):
    """(name, shape, exact?, kernel µs, twin µs, kernel GB/s, % of copy bandwidth) per case."""
    rows, g = [], torch.Generator(device="cuda").manual_seed(0)
    B, L = 16, 8192
    for bs in (1, 8, 32, 128):
        rtt = torch.randperm((bs + 1) * L, device="cuda", generator=g).view(bs + 1, L).to(torch.int32)
        rpi = torch.arange(1, bs + 1, device="cuda")
        seq = torch.randint(0, L - B, (bs,), device="cuda", generator=g)
        bonus = torch.randint(0, 151936, (bs,), device="cuda", generator=g)
        args = (bonus, seq, rpi, rtt, 151669, B)
        out = kernels.build_block(*args)
        twin = kernels.build_block_torch(*args)
        rows.append(("build_block", f"bs={bs}", all(torch.equal(a, b) for a, b in zip(out, twin)),
                     cuda_time(lambda: kernels.build_block(*args)), cuda_time(lambda: kernels.build_block_torch(*args)),
                     nbytes(*out) + 4 * bs * B + 3 * 8 * bs))

        F = 5 * 4096  # Qwen3-8B: five target layers of width 4096, bf16
        hidden = torch.randn(bs, B, F, device="cuda", dtype=torch.bfloat16, generator=g)
        commit = torch.randint(1, B + 1, (bs,), device="cuda", generator=g)
        pos = seq[:, None] + torch.arange(B, device="cuda")
        slots = rtt[rpi[:, None], pos].long()
        gargs = (hidden, commit, pos, slots)
        out = kernels.gather_context_features(*gargs)
        twin = kernels.gather_context_features_torch(*gargs)
        rows.append(("gather_context_features", f"bs={bs} F={F} bf16", all(torch.equal(a, b) for a, b in zip(out, twin)),
                     cuda_time(lambda: kernels.gather_context_features(*gargs)),
                     cuda_time(lambda: kernels.gather_context_features_torch(*gargs)), 2 * nbytes(hidden)))

        target = torch.randint(0, 4, (bs, B), device="cuda", generator=g)
        draft = torch.where(torch.rand(bs, B - 1, device="cuda", generator=g) < 0.9, target[:, :-1], -1)
        aargs = (draft, target)
        out = kernels.accept_greedy(*aargs)
        twin = kernels.accept_greedy_torch(*aargs)
        rows.append(("accept_greedy", f"bs={bs}", all(torch.equal(a, b) for a, b in zip(out, twin)),
                     cuda_time(lambda: kernels.accept_greedy(*aargs)),
                     cuda_time(lambda: kernels.accept_greedy_torch(*aargs)), nbytes(draft, target, *out)))
    for N, T in ((32, 512), (64, 2048)):
        anchors = torch.randint(0, T, (N,), device="cuda", generator=g).sort().values
        out = kernels.training_block_mask(anchors, T, B)
        twin = kernels.training_block_mask_torch(anchors, T, B)
        rows.append(("training_block_mask", f"N={N} T={T}", torch.equal(out, twin),
                     cuda_time(lambda: kernels.training_block_mask(anchors, T, B)),
                     cuda_time(lambda: kernels.training_block_mask_torch(anchors, T, B)), nbytes(out)))
    return [(n, s, ok, tk * 1e6, tt * 1e6, b / tk / 1e9, 100 * b / tk / bw) for n, s, ok, tk, tt, b in rows]


def graph_time(step) -> float:
    """Median seconds of one replay of step captured in a CUDA graph (after warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return cuda_time(graph.replay, iters=50)


def random_qwen3_8b_draft():
    """(config, bf16 draft with N(0, 0.02) weights, lm_head [V, H]) on the GPU."""
    cfg = qwen3_8b_draft_config()
    with torch.device("cuda"):
        model = DFlashDraftModel(cfg).to(torch.bfloat16).eval()
        head = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in list(model.parameters()) + [head]:
            p.normal_(0, 0.02)
    return cfg, model, head


def qwen3_8b_draft_config() -> DraftConfig:
    return DraftConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, block_size=16, num_target_layers=36,
                       target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669)


def draft_attention_rows(bw: float):
    """The draft's paged attention, one layer at the Qwen3-8B draft's heads (32 query / 8 kv, d 128, block 16,
    bf16), every request's context at random slots of the store: the Triton kernel against its torch twin
    -> (batch, context, splits, max |kernel - twin|, kernel µs, twin µs, kernel GB/s, % of copy bw).
    The bytes are the context K/V the attention must read once (plus the block's q, k, v and the output)."""
    from sglang_dflash.ops import draft_attention as da

    rows, g = [], torch.Generator(device="cuda").manual_seed(3)
    h, kvh, d, B = 32, 8, 128, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bs, ctx in ((1, 1024), (1, 8192), (8, 1024), (8, 4096), (32, 1024), (32, 4096), (128, 1024)):
        P = bs * ctx
        t = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        ks, vs, q, kb, vb = t(P, kvh, d), t(P, kvh, d), t(bs, h, B, d), t(bs, kvh, B, d), t(bs, kvh, B, d)
        req_to_token = torch.randperm(P, device="cuda", generator=g).view(bs, ctx).to(torch.int32)
        rpi, prefix = torch.arange(bs, device="cuda"), torch.full((bs,), ctx, device="cuda")
        args = (q, kb, vb, ks, vs, req_to_token, rpi, prefix, d ** -0.5)
        out, twin = da.draft_attention_triton(*args, max_prefix=ctx), da.draft_attention_torch(*args, max_prefix=ctx)
        err = (out.float() - twin.float()).abs().max().item()
        splits = da.plan_splits(bs * kvh, ctx, 32, 2 * sms)[0]
        tk = cuda_time(lambda: da.draft_attention_triton(*args, max_prefix=ctx), iters=50)
        tt = cuda_time(lambda: da.draft_attention_torch(*args, max_prefix=ctx), iters=20)
        moved = 2 * P * kvh * d * 2 + nbytes(q, kb, vb, out) + 4 * P
        rows.append((bs, ctx, splits, err, tk * 1e6, tt * 1e6, moved / tk / 1e9, 100 * moved / tk / bw))
    return rows


def paged_draft_rows(context: int = 1024):
    """The serving draft (models/paged.py: context K/V in a paged store indexed by KV slots), Qwen3-8B
    shapes, random bf16 weights, + its 15-row lm_head: attention by the Triton kernel against the twin
    -> (batch, kernel eager ms, kernel CUDA graph ms, twin eager ms, max |hidden difference|)."""
    from sglang_dflash.models import paged as paged_module
    from sglang_dflash.ops import draft_attention as da

    cfg, model, head = random_qwen3_8b_draft()
    rows, g = [], torch.Generator(device="cuda").manual_seed(4)
    for bs in (1, 8, 32):
        P = bs * (context + cfg.block_size)
        store = paged_module.PagedDraft(model, P, "cuda", torch.bfloat16)
        store.k.normal_(generator=g)
        store.v.normal_(generator=g)
        req_to_token = torch.randperm(P, device="cuda", generator=g).view(bs, -1).to(torch.int32)
        rpi, prefix = torch.arange(bs, device="cuda"), torch.full((bs,), context, device="cuda")
        embeds = torch.randn(bs, cfg.block_size, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
        positions = context + torch.arange(cfg.block_size, device="cuda")[None].expand(bs, -1)

        @torch.no_grad()
        def step():
            hidden = store.forward_block(embeds, positions, req_to_token, rpi, prefix, context)
            return hidden, (hidden[:, 1:].reshape(-1, cfg.hidden_size) @ head.T).argmax(-1).view(bs, -1)

        kernel_hidden = step()[0]
        eager = cuda_time(step, iters=50)
        graphed = graph_time(step)
        paged_module.draft_attention = da.draft_attention_torch  # the twin, for comparison
        try:
            twin_hidden = step()[0]
            twin = cuda_time(step, iters=20)
        finally:
            paged_module.draft_attention = da.draft_attention
        diff = (kernel_hidden.float() - twin_hidden.float()).abs().max().item()
        rows.append((bs, eager * 1e3, graphed * 1e3, twin * 1e3, diff))
    return rows


def draft_rows(bw: float, context: int = 1024):
    """(batch, eager ms, graph ms, floor ms, graph / floor) for the 5-layer draft + its 15-row lm_head."""
    cfg, model, head = random_qwen3_8b_draft()
    weight_bytes = nbytes(*model.layers.parameters(), head)
    rows = []
    for bs in (1, 8, 32):
        kv = lambda: torch.randn(bs, cfg.num_key_value_heads, context, cfg.head_dim,  # noqa: E731
                                 device="cuda", dtype=torch.bfloat16)
        cache = ContextCache([kv() for _ in model.layers], [kv() for _ in model.layers])
        embeds = torch.randn(bs, cfg.block_size, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        positions = context + torch.arange(cfg.block_size, device="cuda")[None].expand(bs, -1)

        @torch.no_grad()
        def step():
            hidden = model(embeds, positions, cache)[:, 1:].reshape(-1, cfg.hidden_size)  # [bs * (B-1), H]
            return (hidden @ head.T).argmax(-1).view(bs, -1)  # [bs, B-1] draft tokens (one GEMM, not a bmm)

        eager = cuda_time(step, iters=50)
        graphed = graph_time(step)
        floor = (weight_bytes + sum(nbytes(k, v) for k, v in zip(cache.keys, cache.values))) / bw
        rows.append((bs, eager * 1e3, graphed * 1e3, floor * 1e3, graphed / floor))
    return rows, weight_bytes


def sampled_accept_rows(V: int = 151936, B: int = 16):
    """Rejection sampling at temperature 0.7, top_p 0.9 over a Qwen3-sized vocabulary: the target's
    filtered distribution formed for every block row (then accept_sampled) against only for the rows
    acceptance reaches (accept_sampled_rows, one host sync per row), for a weak and a strong draft.
    -> (batch, draft, same tokens?, all rows ms, reached rows ms, rows formed / all rows)."""
    rows, g = [], torch.Generator(device="cuda").manual_seed(1)
    for bs in (8, 64):
        logits = torch.randn(bs, B, V, device="cuda", generator=g) * 4
        temps, top_ks = torch.full((bs,), 0.7, device="cuda"), torch.full((bs,), V, device="cuda")
        top_ps = torch.full((bs,), 0.9, device="cuda")
        for name, sharpen, noise in (("weak", 0.0, 4.0), ("strong", 1.0, 0.1)):
            draft_logits = sharpen * logits[:, :-1] + torch.randn(bs, B - 1, V, device="cuda", generator=g) * noise
            q = torch.softmax(draft_logits / 0.7, -1)
            drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(bs, B - 1)
            flat = lambda: filtered_probs(logits.view(-1, V), temps.repeat_interleave(B),  # noqa: E731
                                          top_ks.repeat_interleave(B), top_ps.repeat_interleave(B)).view(bs, B, V)
            p_row = lambda j, r: filtered_probs(logits[r, j], temps[r], top_ks[r], top_ps[r])  # noqa: E731
            full = lambda: accept_sampled(drafts, q, flat(), generator=torch.Generator(device="cuda").manual_seed(2))  # noqa: E731
            lazy = lambda: accept_sampled_rows(drafts, q, p_row, generator=torch.Generator(device="cuda").manual_seed(2))  # noqa: E731
            same = all(torch.equal(a, b) for a, b in zip(full(), lazy()))
            formed = int((lazy()[0] + 1).sum()) / (bs * B)
            rows.append((bs, name, same, cuda_time(full, iters=20) * 1e3, cuda_time(lazy, iters=20) * 1e3, formed))
    return rows


def table_head(*columns: str) -> list[str]:
    """A markdown table's header and separator rows."""
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the markdown tables here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda})",
             f"extension: {load_extension()}"]
    bw = copy_bandwidth()
    lines.append(f"copy bandwidth: {bw / 1e9:.0f} GB/s (1 GiB device-to-device, read + write)\n")
    lines += table_head("kernel", "shape", "equals twin", "kernel µs", "twin µs", "kernel GB/s", "% of copy bw")
    ok = True
    for name, shape, exact, tk, tt, gbs, pct in kernel_rows(bw):
        ok &= exact
        lines.append(f"| {name} | {shape} | {'yes' if exact else 'NO'} | {tk:.1f} | {tt:.1f} | {gbs:.1f} | {pct:.1f} |")
    rows, wbytes = draft_rows(bw)
    lines += ["", f"Qwen3-8B-shaped draft (5 layers, hidden 4096, block 16, random bf16 weights, context 1024 per "
                  f"request), draft layers + 15-row lm_head: {wbytes / 1e9:.2f} GB of weights",
              "", *table_head("batch", "eager ms", "CUDA graph ms", "memory floor ms", "graph / floor")]
    lines += [f"| {bs} | {e:.3f} | {g:.3f} | {f:.3f} | {r:.2f} |" for bs, e, g, f, r in rows]
    lines += ["", "Draft attention over a paged context (one layer; 32 query / 8 kv heads, d 128, block 16, bf16; "
                  "contexts at random slots): the Triton kernel against its torch twin",
              "", *table_head("batch", "context", "splits", "max abs diff", "kernel µs", "twin µs", "kernel GB/s",
                              "% of copy bw")]
    for bs, ctx, splits, err, tk, tt, gbs, pct in draft_attention_rows(bw):
        ok &= err < 2e-2
        lines.append(f"| {bs} | {ctx} | {splits} | {err:.1e} | {tk:.1f} | {tt:.1f} | {gbs:.0f} | {pct:.1f} |")
    lines += ["", "The serving draft (models/paged.py), same model, context 1024 per request in the paged store, "
                  "+ the 15-row lm_head: attention by the Triton kernel or by the twin",
              "", *table_head("batch", "kernel eager ms", "kernel CUDA graph ms", "twin eager ms", "max abs hidden diff")]
    for bs, e, gr, tw, diff in paged_draft_rows():
        ok &= diff < 5e-2
        lines.append(f"| {bs} | {e:.3f} | {gr:.3f} | {tw:.3f} | {diff:.1e} |")
    lines += ["", "Sampled acceptance (temperature 0.7, top_p 0.9, V = 151,936, block 16): the target's filtered "
                  "distribution for all rows vs only the rows acceptance reaches",
              "", *table_head("batch", "draft", "same tokens", "all rows ms", "reached rows ms", "rows formed")]
    for bs, name, same, tf, tl, formed in sampled_accept_rows():
        ok &= same
        lines.append(f"| {bs} | {name} | {'yes' if same else 'NO'} | {tf:.2f} | {tl:.2f} | {100 * formed:.0f}% |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not ok:
        print("a kernel differs from its twin", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
