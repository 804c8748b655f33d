"""The SmolLM2 servers the test session shares (a pytest plugin, loaded by conftest.py): started once,
on first use, by whichever test module needs them first, and stopped at the session's end.

  smol_base_url   the target without speculation, float32, synchronous (the reference)
  trained_server  DFLASH with the shipped trained draft, window 16 (test_smollm2_lossless_float32 only)
  oracle_server   DFLASH whose proposals are the reference's own continuations (tests/oracle_plugin)
  window4_url     the same proposals through a verify window of 4 (the statistical tier's server)

and `smol`: the 40 chat prompts, a random draft, and the reference outputs. A server that needs nothing
from another is started beside it when the session's tests use it (`collected`), so that their start-ups
overlap: the window-4 server beside the oracle's here, test_worker_server's pairs there (`served`). (A start-up
beside a busy server gains nothing: the trained-draft server started while the reference answered the 40
prompts made their test 357 s against 351.)"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import chat_ids, load_target, random_draft
from server import generate, oracle_env, serving, start_server

TRAINED_DRAFT = Path(__file__).parent.parent / "launch" / "drafts" / "SmolLM2-135M-Instruct-DFlash"  # the shipped one
NEW_TOKENS = 128
# the statistical tier's prompts (test_sampling_stats.py): the oracle proposes the first one's greedy continuation
STAT_TEXTS = {"point-mass draft": "The three primary colors are", "random draft": "My favourite animal is the"}


def sixteen_of_forty(rows: list) -> list:
    """16 of the 40 test prompts, every fifth and the one after it: gsm8k_test, humaneval and mt_bench alike."""
    return rows[::5] + rows[1::5]


def save_random_draft(target_path: Path, out: Path, name: str, seed: int = 0) -> Path:
    """A random 2-layer draft for the target, saved in bf16 (the server runs it in its own dtype)."""
    from transformers import AutoConfig

    random_draft(AutoConfig.from_pretrained(str(target_path)), name, seed).to(torch.bfloat16).save_pretrained(out)
    return out


def run_all(url: str, inputs: list[list[int]], concurrency: int, **sampling) -> list[dict]:
    sampling = {"temperature": 0, "max_new_tokens": NEW_TOKENS, **sampling}
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda ids: generate(url, ids, **sampling), inputs))


def dflash_args(draft: Path, *extra: str, window: int = 16) -> tuple[str, ...]:
    return ("--dtype", "float32", "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft),
            "--speculative-num-draft-tokens", str(window), *extra)


@pytest.fixture(scope="session")
def smol_base_url(smollm2_path):
    """The SmolLM2 server without speculation, float32, kept up for the session. Synchronous, as the DFLASH
    server is: SGLang's overlap schedule (its default without speculation) feeds its penalizers the
    prompt's last token at the first decode step and then each output token one step late (the scheduler
    reads req.output_ids before the previous step's result is in), so under penalties its own output
    differs from its synchronous schedule's. Without penalties both schedules give the same tokens."""
    with serving(start_server(smollm2_path, "--dtype", "float32", "--disable-overlap-schedule")) as url:
        yield url
    stop_early()


# servers started before their fixture asks for them: {fixture: (Server, what it yields besides the URL)}
EARLY: dict = {}


def collected(request, fixture: str) -> bool:
    """Whether a test of the session's selection uses the fixture (directly or through another)."""
    return any(fixture in item.fixturenames for item in request.session.items)


def start_early(request, fixture: str, start) -> None:
    """Starts now the server of a fixture that a test of the session will ask for later (start() -> (Server,
    extra)), to be taken there with `take_early(fixture, start)`."""
    if collected(request, fixture) and fixture not in EARLY:
        EARLY[fixture] = start()


def take_early(fixture: str, start):
    """(Server, extra): the one started early for the fixture, or one started now."""
    return EARLY.pop(fixture, None) or start()


def served(request, fixture: str, start, beside: dict | None = None):
    """A fixture's body: yields {"url", **extra} of its server (the one started early, or started now: start()
    -> (Server, extra)) once it serves, and stops it afterwards. Each of `beside` ({fixture: start}) that a test
    of the session will ask for is started now, so that its start-up overlaps this one's."""
    server, extra = take_early(fixture, start)
    for other, start_other in (beside or {}).items():
        start_early(request, other, start_other)
    with serving(server) as url:
        yield {"url": url, **extra}


def stop_early():
    """Stops the servers started early that no fixture took (their tests failed or were not reached)."""
    for server, _ in EARLY.values():
        server.stop()
    EARLY.clear()


def start_with_files(smol, tmp_path_factory, name: str, *args: str, env: dict | None = None):
    """A SmolLM2 server with its own stats file and log: (Server, {"stats", "log"})."""
    folder = tmp_path_factory.mktemp(name)
    files = {"stats": folder / "stats.json", "log": folder / "server.log"}
    return start_server(smol["path"], *args, env={"SGLANG_DFLASH_STATS_FILE": str(files["stats"]), **(env or {})},
                        log_path=str(files["log"])), files


@pytest.fixture
def trained_server(smol, tmp_path_factory):
    """{"url", "stats", "log"}: DFLASH with the shipped trained draft, window 16, for one test (each idle server
    holds about 4 GB of this machine's 24: the session keeps only those that several use). No warm-up request,
    so that its stats file's histogram holds its test's requests only."""
    yield from served(None, "trained_server", lambda: start_with_files(
        smol, tmp_path_factory, "trained", *dflash_args(TRAINED_DRAFT, "--skip-server-warmup")))


@pytest.fixture(scope="session")
def smol(smollm2_path, prompts, tmp_path_factory, smol_base_url):
    """SmolLM2: the 40 chat prompts, a random draft, and the no-speculation server's outputs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    inputs = [chat_ids(tok, p["prompt"]) for p in prompts]
    draft = save_random_draft(smollm2_path, tmp_path_factory.mktemp("smol") / "draft", "smollm2")
    base = run_all(smol_base_url, inputs, 16)
    repeat = run_all(smol_base_url, inputs[:4], 4)
    return dict(path=smollm2_path, tok=tok, inputs=inputs, draft=draft, base=base, repeat=repeat)


@pytest.fixture(scope="session")
def oracle_server(smol, smol_base_url, tmp_path_factory, request):
    """A DFLASH server whose draft proposes the baseline's own continuation of the first 8 prompts
    (tests/oracle_plugin), so that nearly every verify accepts a whole block; and, for one short
    prompt of the statistical tests, its greedy continuation as point-mass proposals."""
    rows = [{"sequence": ids + ref["output_ids"], "prompt_len": len(ids)}
            for ids, ref in zip(smol["inputs"][:8], smol["base"][:8])]
    point_mass = stat_ids(smol, "point-mass draft")  # the statistical tests' prompt with proposals
    greedy = generate(smol_base_url, point_mass, temperature=0, max_new_tokens=32, ignore_eos=True)
    rows.append({"sequence": point_mass + greedy["output_ids"], "prompt_len": len(point_mass)})
    rules, penalties = rule_cases(smol), penalty_cases(smol)
    with ThreadPoolExecutor(16) as pool:
        rule_refs = list(pool.map(lambda c: generate(smol_base_url, c[1], temperature=0, **c[2]), rules + penalties))
    rule_refs, penalty_refs = rule_refs[:len(rules)], rule_refs[len(rules):]
    known = {tuple(r["sequence"][:r["prompt_len"]]) for r in rows}
    # propose the baseline's own output under the rules; for the penalty prompts its output under the first
    # setting (repetition 1.3), which the other settings reject part of
    for (_, ids, _), ref in zip(rules + penalties, rule_refs + penalty_refs):
        if tuple(ids) not in known:
            known.add(tuple(ids))
            rows.append({"sequence": ids + ref["output_ids"], "prompt_len": len(ids)})
    folder = tmp_path_factory.mktemp("oracle")
    file = folder / "sequences.json"
    file.write_text(json.dumps(rows))
    env = {**oracle_env(file), "SGLANG_DFLASH_STATS_FILE": str(folder / "stats.json"),  # read by the benchmark test
           "SGLANG_DFLASH_PROFILE": "1",  # with the step profile (the benchmark test checks its table)
           "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}  # a KV leak, seen when idle, stops the server
    oracle = start_server(smol["path"], *dflash_args(smol["draft"]), env=env)
    start_early(request, "window4_url", lambda: (start_window4(smol, file), {}))
    with serving(oracle) as url:
        yield {"url": url, "stats": folder / "stats.json", "rules": list(zip(rules, rule_refs)), "sequences": file,
               "penalties": list(zip(penalties, penalty_refs))}


JSON_SCHEMA = json.dumps({"type": "object", "properties": {"answer": {"type": "integer"}, "unit": {"type": "string"}},
                          "required": ["answer", "unit"], "additionalProperties": False})


def rule_cases(smol) -> list[tuple[str, list[int], dict]]:
    """Requests with their own logit rules (penalties, min_new_tokens, logit_bias, a JSON schema),
    one prompt each, 64 new tokens, greedy."""
    inputs, base = smol["inputs"], smol["base"]
    frequent = max(set(base[27]["output_ids"]), key=base[27]["output_ids"].count)
    ended = next(i for i, ref in enumerate(base) if ref["meta_info"]["finish_reason"]["type"] == "stop")
    n_end = len(base[ended]["output_ids"])
    return [
        ("frequency_penalty", inputs[24], {"frequency_penalty": 0.5, "max_new_tokens": 64}),
        ("presence_penalty", inputs[25], {"presence_penalty": 0.75, "max_new_tokens": 64}),
        ("repetition_penalty", inputs[26], {"repetition_penalty": 1.3, "max_new_tokens": 64}),
        ("logit_bias", inputs[27], {"logit_bias": {str(frequent): -100.0}, "max_new_tokens": 64}),
        ("json_schema", inputs[28], {"json_schema": JSON_SCHEMA, "max_new_tokens": 64}),
        # the baseline ended this prompt with EOS: now it may not, until 8 tokens later
        ("min_new_tokens", inputs[ended], {"min_new_tokens": n_end + 8, "max_new_tokens": n_end + 24}),
        # an oracle prompt: its proposals are the output WITHOUT the penalty, rejected once it bites
        ("frequency_penalty, stale proposals", inputs[0], {"frequency_penalty": 1.0, "max_new_tokens": 64}),
    ]


PENALTY_SETTINGS = {"repetition 1.3": {"repetition_penalty": 1.3}, "repetition 2.0": {"repetition_penalty": 2.0},
                    "frequency 0.5": {"frequency_penalty": 0.5}, "frequency 1.0": {"frequency_penalty": 1.0},
                    "presence 1.0": {"presence_penalty": 1.0}}
PENALTY_TOKENS = 32


def penalty_prompts(smol) -> list[list[int]]:
    """8 prompts: 6 chat turns from the three sets, and 2 raw texts that invite repetition."""
    tok = smol["tok"]
    return [smol["inputs"][i] for i in (9, 10, 13, 14, 22, 23)] + [tok("Count: 1, 2, 3,").input_ids,
                                                                   tok("Repeat: a a a a").input_ids]


def penalty_cases(smol) -> list[tuple[str, list[int], dict]]:
    """Each penalty setting alone and with min_new_tokens, on each of the 8 prompts, 32 tokens, greedy."""
    cases = []
    for name, params in PENALTY_SETTINGS.items():
        for extra in ({}, {"min_new_tokens": 20}):
            for i, ids in enumerate(penalty_prompts(smol)):
                label = f"{name}{', min_new_tokens 20' if extra else ''}, prompt {i}"
                cases.append((label, ids, {**params, **extra, "max_new_tokens": PENALTY_TOKENS}))
    return cases


@pytest.fixture(scope="session")
def oracle_url(oracle_server):
    return oracle_server["url"]


@pytest.fixture(scope="session")
def window4_url(smol, oracle_server):
    """The oracle server's proposals with --speculative-num-draft-tokens 4 (the draft's block stays 16)."""
    server, _ = take_early("window4_url", lambda: (start_window4(smol, oracle_server["sequences"]), {}))
    with serving(server) as url:
        yield url


def start_window4(smol, sequences: Path):
    # 128 running requests: the statistical tier's cases (then with 2,000 baseline samples each as well)
    # took 55-181 s so, 148-221 s with 1,024
    return start_server(smol["path"], *dflash_args(smol["draft"], "--max-running-requests", "128", window=4),
                        env=oracle_env(sequences))


def stat_ids(smol, prompt: str) -> list[int]:
    return smol["tok"](STAT_TEXTS[prompt]).input_ids


@pytest.fixture(scope="session")
def hf_smol(smol):
    """SmolLM2 in Transformers, float32: the exact distributions the sampled outputs are tested against."""
    return load_target(smol["path"])[0]
