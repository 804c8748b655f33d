"""SGLang's own benchmark, side by side: `python -m sglang.benchmark.serving` (bench_serving) with its
default dataset, ShareGPT, against a server without speculation and a DFLASH server, one after the other on
the same target and build, at each concurrency and in each dtype asked for. The prompts are ShareGPT's
held-out conversations (`sglang-dflash sharegpt-file`), which no training run uses.

    .venv/bin/python benchmarks/serving.py --target DIR --draft DIR [--dtypes bfloat16,float32]
        [--concurrency 1,4,16,64] [--prompts-per-concurrency 2] [--output-len 128] [--out serving-results]

Per run, from bench_serving's own JSONL: request throughput, output tok/s, median TTFT and ITL, and the
accept length SGLang reports. Both servers get the same flags (--server-arg adds one to both); the DFLASH
server also gets --speculative-algorithm DFLASH and the draft (its window: adaptive unless --num-draft-tokens).
bench_serving's defaults stand except: its ShareGPT file is ours, each request's output length is
--output-len (bench_serving then ignores EOS, as by default), the chat template is applied, the seed is 0,
and each concurrency c sends c × --prompts-per-concurrency requests (at least --min-prompts).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from sglang_dflash.server import sglang_server

METRICS = ("request_throughput", "output_throughput", "median_ttft_ms", "median_itl_ms", "accept_length")


def bench_serving(url: str, tokenizer: str, dataset: Path, concurrency: int, prompts: int, output_len: int,
                  out: Path) -> dict:
    """One bench_serving run -> its result record (the last line of its JSONL output)."""
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", url,
           "--tokenizer", tokenizer, "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--sharegpt-output-len",
           str(output_len), "--apply-chat-template", "--seed", "0", "--disable-tqdm", "--output-file", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text().splitlines()[-1])


def run_server(target: str, server_args: list[str], label: str, args, dataset: Path, out: Path) -> dict[int, dict]:
    rows = {}
    with sglang_server(target, *server_args, log_path=str(out / f"{label}-server.log"), timeout=900) as url:
        for c in args.concurrency:
            n = max(c * args.prompts_per_concurrency, args.min_prompts)
            t0 = time.perf_counter()
            record = bench_serving(url, target, dataset, c, n, args.output_len, out / f"{label}-c{c}.jsonl")
            rows[c] = {k: record.get(k) for k in (*METRICS, "completed", "total_output_tokens", "duration")}
            print(f"{label} c={c}: {n} requests, {record['output_throughput']:.1f} output tok/s "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def table(results: dict) -> str:
    lines = ["| dtype | concurrency | requests | baseline req/s | DFLASH req/s | baseline out tok/s | DFLASH out tok/s "
             "| speedup | TTFT ms (median) base / DFLASH | ITL ms (median) base / DFLASH | accept length |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |"]
    for dtype, runs in results["runs"].items():
        for c, b in runs["baseline"].items():
            d = runs["dflash"][c]
            accept = f"{d['accept_length']:.2f}" if d.get("accept_length") else "-"
            lines.append(f"| {dtype} | {c} | {d['completed']} | {b['request_throughput']:.3f} | "
                         f"{d['request_throughput']:.3f} | {b['output_throughput']:.1f} | {d['output_throughput']:.1f} | "
                         f"{d['output_throughput'] / b['output_throughput']:.2f}× | {b['median_ttft_ms']:.0f} / "
                         f"{d['median_ttft_ms']:.0f} | {b['median_itl_ms']:.0f} / {d['median_itl_ms']:.0f} | {accept} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["bfloat16", "float32"])
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--prompts-per-concurrency", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=None, help="a fixed verify window (default: adaptive)")
    p.add_argument("--server-arg", action="append", default=[], help="an extra launch_server argument for both")
    p.add_argument("--out", default="serving-results")
    args = p.parse_args(argv)

    from sglang_dflash.bench import machine
    from sglang_dflash.train.sources import write_sharegpt_heldout

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dataset = out / "sharegpt-heldout.json"
    write_sharegpt_heldout(dataset)
    spec = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", args.draft,
            *(["--speculative-num-draft-tokens", str(args.num_draft_tokens)] if args.num_draft_tokens else [])]
    results = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "runs": {}}
    for dtype in args.dtypes:
        common = ["--dtype", dtype, *args.server_arg]
        results["runs"][dtype] = {
            "dflash": run_server(args.target, [*common, *spec], f"{dtype}-dflash", args, dataset, out),
            "baseline": run_server(args.target, common, f"{dtype}-baseline", args, dataset, out)}
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    md = table(results)
    (out / "results.md").write_text(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
