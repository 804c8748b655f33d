"""Tree verification against the chain at equal verify rows: the shipped SmolLM2 draft, float32, the 16 test
prompts of tests/data/prompts.jsonl that the server tests use (every fifth and the one after: gsm8k_test,
humaneval and mt_bench prompts), 64 new tokens, greedy, at concurrency 1 (the first 6) and 16. Each
configuration on its own server, one after the other; τ and output tok/s side by side.

    .venv/bin/python benchmarks/tree_vs_chain.py
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import chat_ids, fixture_dir  # noqa: E402
from server import generate, sglang_server  # noqa: E402
from shared_servers import TRAINED_DRAFT, dflash_args, sixteen_of_forty  # noqa: E402

CONFIGS = {"chain K=8": dflash_args(TRAINED_DRAFT, window=8),
           "tree N=8 k=2": dflash_args(TRAINED_DRAFT, "--speculative-eagle-topk", "2", window=8),
           "chain K=16": dflash_args(TRAINED_DRAFT, window=16),
           "tree N=16 k=2": dflash_args(TRAINED_DRAFT, "--speculative-eagle-topk", "2", window=16)}


def main():
    from transformers import AutoTokenizer

    target = fixture_dir() / "smollm2"
    tok = AutoTokenizer.from_pretrained(str(target))
    rows = [json.loads(line) for line in open(ROOT / "tests" / "data" / "prompts.jsonl") if line.strip()]
    inputs = sixteen_of_forty([chat_ids(tok, row["prompt"]) for row in rows])
    for name, args in CONFIGS.items():
        with sglang_server(target, *args) as url:
            for concurrency in (1, 16):
                batch = inputs[:6] if concurrency == 1 else inputs
                t0 = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    outs = list(pool.map(lambda ids: generate(url, ids, temperature=0, max_new_tokens=64), batch))
                seconds = time.perf_counter() - t0
                tokens = sum(len(o["output_ids"]) for o in outs)
                tau = sum(len(o["output_ids"]) - 1 for o in outs) / sum(o["meta_info"]["spec_verify_ct"] for o in outs)
                print(f"{name:14s} c={concurrency:2d}: τ {tau:.2f}, {tokens / seconds:.1f} tok/s "
                      f"({tokens} tokens, {seconds:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
