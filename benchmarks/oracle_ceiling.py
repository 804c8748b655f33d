"""The ceiling of DFLASH on this machine: a side-by-side run of SGLang without speculation and
with this package's DFLASH worker whose draft is an ORACLE (it proposes the target's own greedy
continuation, via tests/oracle_plugin), so that τ is the block size. A trained draft can only
do worse. Both servers: SmolLM2-135M-Instruct, same build, same flags, one after the other.

    .venv/bin/python benchmarks/oracle_ceiling.py [--dtype float32|bfloat16] [--prompts 4] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import MASK_TOKEN, chat_ids, fixture_dir  # noqa: E402
from server import generate, sglang_server  # noqa: E402


def timed(url, inputs, concurrency, tokens):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda ids: generate(url, ids, temperature=0, max_new_tokens=tokens), inputs))
    return outs, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    from sglang_dflash.config import draft_config_for_target
    from sglang_dflash.models.reference import DFlashDraftModel
    from sglang_dflash.train.data import read_jsonl
    from sglang_dflash.targets import prepare_target

    target = prepare_target("smollm2", fixture_dir() / "smollm2")
    tok = AutoTokenizer.from_pretrained(str(target))
    prompts = [row["prompt"] for row in read_jsonl(ROOT / "tests/data/prompts.jsonl")]
    inputs = [chat_ids(tok, p) for p in prompts[: args.prompts]]
    work = Path(tempfile.mkdtemp())
    cfg = draft_config_for_target(AutoConfig.from_pretrained(str(target)), num_layers=2, mask_token_id=MASK_TOKEN["smollm2"])
    DFlashDraftModel.random(cfg).save_pretrained(work / "draft")

    rows = {}
    with sglang_server(target, "--dtype", args.dtype) as url:
        generate(url, inputs[0], temperature=0, max_new_tokens=4)
        for c in args.concurrency:
            base, rows[("base", c)] = timed(url, inputs, c, args.tokens)
    (work / "oracle.json").write_text(json.dumps(
        [{"sequence": ids + b["output_ids"], "prompt_len": len(ids)} for ids, b in zip(inputs, base)]))
    env = {"PYTHONPATH": str(ROOT / "tests/oracle_plugin"), "SGLANG_DFLASH_ORACLE": str(work / "oracle.json")}
    with sglang_server(target, "--dtype", args.dtype, "--speculative-algorithm", "DFLASH",
                       "--speculative-draft-model-path", str(work / "draft"), env=env) as url:
        generate(url, inputs[0], temperature=0, max_new_tokens=4)
        specs = {}
        for c in args.concurrency:
            specs[c], rows[("dflash", c)] = timed(url, inputs, c, args.tokens)
    n = sum(len(b["output_ids"]) for b in base)
    print(f"SmolLM2-135M, {args.dtype}, {args.prompts} prompts x {args.tokens} tokens, oracle draft (block 16)")
    print("| concurrency | no spec tok/s | DFLASH tok/s | speedup | tau | identical |")
    print("| --- | --- | --- | --- | --- | --- |")
    for c in args.concurrency:
        b, s = n / rows[("base", c)], n / rows[("dflash", c)]
        same = all(x["output_ids"] == y["output_ids"] for x, y in zip(specs[c], base))
        tau = n / sum(x["meta_info"]["spec_verify_ct"] for x in specs[c])
        print(f"| {c} | {b:.1f} | {s:.1f} | {s / b:.2f}x | {tau:.2f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
