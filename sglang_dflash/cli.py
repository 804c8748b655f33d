"""The `sglang-dflash` command: serve, doctor, prepare-target, train, prompt-variants, eval-draft, bench, demo."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def parse_bool(text: str) -> bool:
    """A boolean flag's value: 1/true/yes or 0/false/no (any case); anything else is an error, not False."""
    value = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a boolean: use true or false")
    return value


def cmd_serve(argv: list[str]) -> int:
    """Run `python -m sglang.launch_server ARGS`, prepared for this machine (CPU engine when there is no GPU)."""
    from sglang_dflash.cpu.runtime import serve_setup

    argv, env = serve_setup(argv)
    cmd = [sys.executable, "-m", "sglang.launch_server", *argv]
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


def cmd_doctor(_args) -> int:
    import importlib.metadata as md

    from sglang_dflash import __version__
    from sglang_dflash.cpu.runtime import gpu_present, libcuda_stub_dir

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    gpu = gpu_present()
    print(f"sglang-dflash   {__version__}")
    print(f"python          {sys.version.split()[0]} ({sys.executable})")
    for dist in ("torch", "sglang", "transformers", "sglang-kernel", "flashinfer-python", "triton"):
        print(f"{dist:<15} {version(dist)}")
    print(f"mode            {'GPU (NVIDIA driver found)' if gpu else 'CPU (no NVIDIA driver or device)'}")
    print(f"MKL_CBWR        {os.environ.get('MKL_CBWR')} (cpu/runtime.py: mkl_mode)")
    if not gpu:
        stub = libcuda_stub_dir(build=False)
        print(f"cpu runtime     SGLANG_USE_CPU_ENGINE set by `sglang-dflash serve`; "
              f"libcuda.so.1 stand-in {'built at ' + str(stub) if stub else 'not built yet (built on first serve)'}")
    from sglang_dflash.ops import kernels

    if kernels.extension_available():
        path = "the CUDA kernels run" if gpu else "no GPU here, so the plain-torch twins run"
        print(f"csrc extension  built (sglang_dflash._C): {path}")
    else:
        print(f"csrc extension  not built ({kernels.EXTENSION_ERROR}): the plain-torch twins run")
    plugins = [ep.value for ep in md.entry_points(group="sglang.srt.plugins") if ep.value.startswith("sglang_dflash")]
    print(f"sglang plugin   {plugins[0] if plugins else 'NOT registered (reinstall the package)'}")
    return 0


def cmd_prepare_target(args) -> int:
    from sglang_dflash.targets import prepare_target

    print(prepare_target(args.name, args.out))
    return 0


def cmd_train(args) -> int:
    from sglang_dflash.train.recipe import Recipe, run
    from sglang_dflash.train.trainer import FitConfig

    fit_fields = {f for f in FitConfig.__dataclass_fields__}
    fit = FitConfig(**{k: v for k, v in vars(args).items() if k in fit_fields and v is not None})
    recipe = Recipe(target=args.target, prompts=args.prompts, out=args.out, work=args.work or args.out + ".work",
                    num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, generator=args.generator,
                    server_url=args.server_url, gen_dtype=args.gen_dtype, gen_concurrency=args.gen_concurrency,
                    feature_dtype=args.feature_dtype, num_layers=args.num_layers, block_size=args.block_size,
                    mask_token_id=args.mask_token_id, target_layer_ids=args.target_layer_ids, init=args.init,
                    fit=fit, device=args.device, until=args.until, regenerate=args.regenerate,
                    heldout_sets=args.heldout_sets or [],
                    self_temperature=args.self_temperature,
                    train_on_evaluation_prompts=args.train_on_evaluation_prompts)
    metrics = run(recipe)
    print(json.dumps(metrics, indent=2))
    return 0


def cmd_prompts(args) -> int:
    from sglang_dflash.train.sources import training_prompts

    def self_source(n: int) -> list[dict]:  # loads the target only when a self source asks for prompts
        import torch

        from sglang_dflash.train.recipe import load_target
        from sglang_dflash.train.self_prompts import sample_self_prompts

        model, tok = load_target(args.target, torch.float32)
        cache = Path(args.out).with_suffix(".self.jsonl")
        return sample_self_prompts(model, tok, n, cache, args.seed, args.self_temperature)

    rows, report = training_prompts(args.sources, args.num_prompts, args.seed, args.heldout_sets,
                                    self_source if args.target else None,
                                    check=not args.train_on_evaluation_prompts)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    Path(args.out).with_suffix(".decontamination.json").write_text(json.dumps(report, indent=2) + "\n")
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["source"]] = counts.get(row["source"], 0) + 1
    print(f"{args.out}: {len(rows)} prompts {counts}; decontamination dropped {report['dropped']} "
          f"{report['by_source']} (report: {Path(args.out).with_suffix('.decontamination.json')})")
    return 0


def cmd_sharegpt_file(args) -> int:
    from sglang_dflash.train.sources import write_sharegpt_heldout

    n = write_sharegpt_heldout(Path(args.out))
    print(f"{args.out}: {n} held-out ShareGPT conversations; serve them with `python -m sglang.bench_serving "
          f"--dataset-name sharegpt --dataset-path {args.out} --num-prompts {n} ...`")
    return 0


def cmd_prompt_variants(args) -> int:
    from sglang_dflash.train.data import number_variants, read_prompts

    rows = number_variants(read_prompts(args.prompts, args.num_prompts), args.copies, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{args.out}: {len(rows)} prompts (up to {args.copies} variants of each prompt with a number in it)")
    return 0


def cmd_eval_draft(args) -> int:
    import torch

    from sglang_dflash.models.reference import DFlashDraftModel
    from sglang_dflash.train.evaluate import eval_drafts
    from sglang_dflash.train.recipe import load_target
    from sglang_dflash.train.sources import load_source

    dtype = getattr(torch, args.dtype)
    target, tok = load_target(args.target, dtype)
    target.to(args.device)
    drafts = [DFlashDraftModel.from_pretrained(path, dtype=dtype, device=args.device) for path in args.draft]
    for draft in drafts:
        draft.config.check_target(target.config)
    report = {path: {} for path in args.draft}  # draft -> prompt set -> summary
    for path in args.prompts:
        prompts = load_source(path, args.num_prompts)
        method = args.method or ("replay" if args.temperature == 0 else "decode")
        results = eval_drafts(target, tok, drafts, prompts, args.max_new_tokens, temperature=args.temperature,
                              method=method)
        for draft_path, r in zip(args.draft, results):
            report[draft_path][path] = r
            who = f"{draft_path} on " if len(drafts) > 1 else ""
            print(f"{who}{path}: τ {r['tau']:.3f} over {r['verify_steps']} verify steps, {r['prompts']} prompts "
                  f"({method}); acceptance by row {r['accept_rate_by_row']}")
    if args.json:  # one draft: prompt set -> summary; several: draft -> prompt set -> summary
        Path(args.json).write_text(json.dumps(report[args.draft[0]] if len(drafts) == 1 else report, indent=2) + "\n")
    return 0


def cmd_bench(args) -> int:
    from sglang_dflash.bench import BenchConfig, bench

    results = bench(BenchConfig.from_args(args))
    print((Path(args.out) / "results.md").read_text(), end="")
    print(f"results: {Path(args.out) / 'results.json'}" + "".join(f"\nplot: {p}" for p in results["plots"]))
    return 0 if all(r["lossless"] is not False for rows in results["side_by_side"].values() for r in rows) else 1


def cmd_demo(args) -> int:
    from sglang_dflash.demo import run_demo

    return run_demo(args)


def _prompt_flags(p) -> None:
    p.add_argument("--self-temperature", type=float, default=1.0,
                   help="the temperature the self source samples user turns at")
    p.add_argument("--train-on-evaluation-prompts", action="store_true",
                   help="keep prompts that are in (or near) an evaluation set: no decontamination (the tests' "
                        "tiny recipes train on test prompts on purpose)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from sglang_dflash.cpu.runtime import mkl_mode

    said = mkl_mode(os.environ)  # before any product: for this process and every one it starts
    if said and argv[:1] != ["doctor"]:
        print(said, file=sys.stderr)
    if argv[:1] == ["serve"]:  # everything after `serve` belongs to launch_server
        return cmd_serve(argv[1:])
    from sglang_dflash.bench import add_arguments as add_bench_arguments
    from sglang_dflash.demo import add_demo_arguments
    from sglang_dflash.train.trainer import FitConfig

    parser = argparse.ArgumentParser(prog="sglang-dflash", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="launch an SGLang server (any launch_server arguments), CPU-ready")
    sub.add_parser("doctor", help="print what this environment has").set_defaults(func=cmd_doctor)
    p = sub.add_parser("prepare-target", help="build an offline target model folder")
    p.add_argument("name", choices=["smollm2", "tiny-qwen3"])
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_prepare_target)
    p = sub.add_parser("train", help="train a DFlash draft for a target (resumable: re-run the same command)")
    p.add_argument("--target", required=True, help="the target model folder")
    p.add_argument("--prompts", nargs="+", required=True,
                   help="prompt sources: JSONL files (field 'prompt') or named sources (sharegpt: ShareGPT V3's "
                        "human turns; self: user turns sampled from the target), each optionally NAME=WEIGHT to "
                        "mix them (train/sources.py); decontaminated against the evaluation sets")
    p.add_argument("--out", required=True, help="where the draft checkpoint (published format) goes")
    p.add_argument("--work", default=None, help="responses, feature cache, optimizer state (default OUT.work)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="at most this many prompts per source; with weights, the size of the mix")
    p.add_argument("--heldout-sets", nargs="*", default=None,
                   help="more evaluation prompt files to keep out of training (benchmarks/data, the shared test "
                        "sets and ShareGPT's held-out split always are)")
    p.add_argument("--until", choices=["regenerate", "features", "fit"], default="fit",
                   help="stop after this phase (a long regeneration can run alone, over several sittings)")
    p.add_argument("--no-regenerate", dest="regenerate", action="store_false",
                   help="make no new responses: the prompts that have one in the work folder are the data (a "
                        "regeneration stopped part-way, e.g. committed shards loaded into --work)")
    _prompt_flags(p)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--generator", choices=["sglang", "hf"], default="sglang",
                   help="who regenerates the responses: an SGLang server (launched, or --server-url) or Transformers")
    p.add_argument("--server-url", default=None)
    p.add_argument("--gen-dtype", default="bfloat16")
    p.add_argument("--gen-concurrency", type=int, default=32,
                   help="requests in flight (sglang), or prompts per batch (hf)")
    p.add_argument("--feature-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-layers", type=int, default=3)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
    p.add_argument("--init", default="target",
                   help="target (copies of its last layers), random, or a draft folder to continue training from")
    p.add_argument("--device", default="cpu")
    for name, f in FitConfig.__dataclass_fields__.items():  # every fit setting is a flag
        kind = type(f.default)
        if kind is bool:
            p.add_argument("--" + name.replace("_", "-"), type=parse_bool, default=None, help=f"default {f.default}")
        else:
            p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=f"default {f.default}")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("prompts", help="write a training prompt set: sources mixed and decontaminated")
    p.add_argument("--sources", nargs="+", required=True,
                   help="as train's --prompts: JSONL files, sharegpt, self, each optionally NAME=WEIGHT")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="at most this many prompts per source; with weights, the size of the mix")
    p.add_argument("--seed", type=int, default=0, help="the mix's shuffle and the self source's sampling")
    p.add_argument("--heldout-sets", nargs="*", default=None, help="more evaluation prompt files to keep out")
    p.add_argument("--target", default=None, help="the target model folder (the self source samples from it)")
    p.add_argument("--out", required=True, help="the prompt file (JSONL); self prompts are kept beside it")
    _prompt_flags(p)
    p.set_defaults(func=cmd_prompts)
    p = sub.add_parser("sharegpt-file", help="ShareGPT's held-out conversations as a JSON file for SGLang's "
                                             "bench_serving (--dataset-name sharegpt --dataset-path FILE)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_sharegpt_file)
    p = sub.add_parser("prompt-variants", help="more training prompts: copies of a prompt set with other numbers")
    p.add_argument("--prompts", required=True)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--copies", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_prompt_variants)
    p = sub.add_parser("eval-draft", help="τ and per-row acceptance of a draft (Transformers backend)")
    p.add_argument("--target", required=True)
    p.add_argument("--draft", nargs="+", required=True,
                   help="one draft folder, or several of the same target: replayed, they walk the same greedy "
                        "continuations, made once (the --json report is then by draft, then by prompt set)")
    p.add_argument("--prompts", nargs="+", required=True,
                   help="JSONL prompt files, or sharegpt-heldout (ShareGPT's conversations kept out of training)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy acceptance; > 0: rejection sampling (seeded, reproducible)")
    p.add_argument("--method", choices=["decode", "replay"], default=None,
                   help="decode: real speculative decoding, prompt by prompt; replay (greedy only, the default at "
                        "temperature 0, faster): the same steps replayed from the target's batched greedy "
                        "continuation (train/evaluate.py)")
    p.add_argument("--json", default=None, help="write the full report here")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_eval_draft)
    p = sub.add_parser("bench", help="τ and speedup, DFLASH against no speculation, side by side on real servers")
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("demo", help="DFLASH vs no speculation side by side on SGLang servers (SmolLM2 by default)")
    add_demo_arguments(p)
    p.set_defaults(func=cmd_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
