"""Soak a DFLASH server: a mix of requests at a fixed concurrency for a fixed time, then check that it
is still serving, holds no KV slot, answers a reference request as at the start, and did not grow.

    .venv/bin/python benchmarks/soak.py --minutes 20 --concurrency 16 --out soak.json

The mix (each request drawn from a seeded generator): greedy short (16-64 tokens) and long (256),
sampled (temperature, top_p, top_k), penalised (repetition, frequency, presence, min_new_tokens),
a JSON schema or a regex, streams the client drops after a few chunks, streams stopped by
/abort_request, and malformed requests (empty, ids outside the vocabulary), which must get a 400.
Anything else (a 5xx, a refused connection, a malformed request answered 200) counts as an error.
Resident memory is the sum over the server's process tree, sampled every 30 s.
Not part of the test suite: it runs for minutes and measures a machine, not a property.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from server import kv_slots_in_use  # noqa: E402  (the tests' helper: slots in use once idle and flushed)

from sglang_dflash.cpu.runtime import cache_dir  # noqa: E402
from sglang_dflash.server import sglang_server  # noqa: E402

SCHEMA = json.dumps({"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]})
KINDS = ["greedy short", "greedy long", "sampled", "penalised", "grammar", "dropped stream", "abort", "malformed"]
WEIGHTS = [4, 1, 3, 2, 1, 1, 1, 1]
REQUEST_TIMEOUT = 1800  # s: a 256-token request among 16 on a 2-core CPU in bf16 took over 600


def load_prompts(tok) -> list[list[int]]:
    from sglang_dflash.train.data import chat_ids, read_jsonl

    rows = []
    for name in ("gsm8k", "humaneval", "mt-bench"):
        rows += read_jsonl(ROOT / "benchmarks" / "data" / f"{name}.jsonl")
    texts = [r.get("prompt") or r.get("question") or r.get("turns", [""])[0] for r in rows]
    return [chat_ids(tok, t) for t in texts if t]


def body_for(kind: str, ids: list[int], rng: random.Random) -> dict:
    sp = {"temperature": 0, "max_new_tokens": rng.randint(16, 64)}
    if kind == "greedy long":
        sp["max_new_tokens"] = 256
    elif kind == "sampled":
        sp.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([-1, 20]))
    elif kind == "penalised":
        sp.update(rng.choice([{"repetition_penalty": 1.3}, {"frequency_penalty": 0.5}, {"presence_penalty": 1.0}]),
                  min_new_tokens=rng.choice([0, 12]))
    elif kind == "grammar":
        sp.update(rng.choice([{"json_schema": SCHEMA}, {"regex": "[0-9]+ (apples|pears)"}]))
    elif kind in ("dropped stream", "abort"):
        sp.update(max_new_tokens=256, ignore_eos=True)
    return {"input_ids": ids, "sampling_params": sp}


def rss_bytes(pid: int) -> int:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def server_pid(port: int) -> int:
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            return conn.pid
    raise RuntimeError(f"no process listens on port {port}")


def one(url: str, kind: str, ids: list[int], rng: random.Random, rid: str) -> str:
    """Send one request of the kind -> 'served', 'aborted', 'refused' (an expected 400) or 'error: …'."""
    if kind == "malformed":
        body = rng.choice([{"text": ""}, {"input_ids": [1, 2, 10_000_000]}, {"input_ids": [-3, 4]}])
        body = {**body, "sampling_params": {"max_new_tokens": 4}}
        r = requests.post(url + "/generate", json=body, timeout=REQUEST_TIMEOUT)
        return "refused" if r.status_code == 400 else f"error: malformed request answered {r.status_code}"
    body = body_for(kind, ids, rng)
    if kind in ("dropped stream", "abort"):
        body = {**body, "stream": True, "rid": rid}
        with requests.post(url + "/generate", json=body, stream=True, timeout=REQUEST_TIMEOUT) as r:
            if r.status_code != 200:
                return f"error: stream answered {r.status_code}"
            for n, _ in enumerate(r.iter_lines()):
                if n == rng.randint(2, 8):
                    if kind == "abort":
                        requests.post(url + "/abort_request", json={"rid": rid}, timeout=60)
                    else:
                        break
        return "aborted"
    r = requests.post(url + "/generate", json=body, timeout=REQUEST_TIMEOUT)
    if r.status_code != 200:
        return f"error: {kind} answered {r.status_code}: {r.text[:200]}"
    out = r.json()
    if not out["output_ids"] or len(out["output_ids"]) > body["sampling_params"]["max_new_tokens"]:
        return f"error: {kind} returned {len(out['output_ids'])} tokens"
    return "served"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(cache_dir() / "fixtures" / "smollm2"))
    ap.add_argument("--draft", default=str(ROOT / "launch" / "drafts" / "SmolLM2-135M-Instruct-DFlash"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="soak.json")
    ap.add_argument("--log", default="soak-server.log")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    prompts = load_prompts(AutoTokenizer.from_pretrained(args.target))
    flags = ["--dtype", args.dtype, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", args.draft,
             "--mem-fraction-static", "0.3", "--max-total-tokens", "16384"]
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
    with sglang_server(args.target, *flags, env=env, log_path=args.log) as url:
        pid = server_pid(int(url.rsplit(":", 1)[1]))
        ref = {"input_ids": prompts[0], "sampling_params": {"temperature": 0, "max_new_tokens": 48}}
        ref_tokens = requests.post(url + "/generate", json=ref, timeout=REQUEST_TIMEOUT).json()["output_ids"]
        rss = [(0.0, rss_bytes(pid))]
        counts: dict[str, int] = {}
        errors: list[str] = []
        lock = threading.Lock()
        start = time.time()
        deadline = start + 60 * args.minutes

        def worker(w: int):
            rng = random.Random(args.seed * 1000 + w)
            n = 0
            while time.time() < deadline:
                kind = rng.choices(KINDS, WEIGHTS)[0]
                try:
                    result = one(url, kind, rng.choice(prompts), rng, f"soak-{w}-{n}")
                except requests.RequestException as e:
                    result = f"error: {kind}: {e!r}"
                n += 1
                with lock:
                    key = result if not result.startswith("error") else "error"
                    counts[key] = counts.get(key, 0) + 1
                    counts[kind] = counts.get(kind, 0) + 1
                    if result.startswith("error"):
                        errors.append(result)

        def sampler():
            while time.time() < deadline:
                time.sleep(30)
                rss.append((time.time() - start, rss_bytes(pid)))

        threading.Thread(target=sampler, daemon=True).start()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(worker, range(args.concurrency)))
        elapsed = time.time() - start
        in_use = kv_slots_in_use(url)
        healthy = requests.get(url + "/health_generate", timeout=120).status_code == 200
        same = requests.post(url + "/generate", json=ref, timeout=REQUEST_TIMEOUT).json()["output_ids"] == ref_tokens
        rss.append((time.time() - start, rss_bytes(pid)))

    result = {"minutes": round(elapsed / 60, 1), "concurrency": args.concurrency, "dtype": args.dtype,
              "counts": counts, "errors": errors[:20], "kv_slots_in_use_after": in_use, "healthy_after": healthy,
              "reference_unchanged": same, "rss_mb": [(round(t), round(b / 2**20)) for t, b in rss],
              "cpu": os.cpu_count()}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rss_mb"}, indent=1))
    mb = [b / 2**20 for _, b in rss]
    print(f"resident memory (MB): start {mb[0]:.0f}, after 1 min {mb[min(2, len(mb) - 1)]:.0f}, end {mb[-1]:.0f}, "
          f"max {max(mb):.0f}")
    ok = not errors and in_use == 0 and healthy and same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
