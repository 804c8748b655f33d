"""The training recipe end to end: target + prompt set -> a DFlash draft in the published format.

    regenerate  the target's greedy responses (SGLang server, or Transformers)   work/responses.jsonl
    features    the target's hidden states at the draft's layers, cached           work/features/
    fit         the DFlash objective, resumable                                    work/checkpoint.pt -> out/

Each phase skips what is already done, so re-running the same command resumes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from sglang_dflash.config import DraftConfig, draft_config_for_target
from sglang_dflash.models.reference import DFlashDraftModel
from sglang_dflash.train import data
from sglang_dflash.train.features import build_feature_cache, stored_layers
from sglang_dflash.train.parallel import fit_parallel
from sglang_dflash.train.sources import training_prompts
from sglang_dflash.train.trainer import FitConfig, Frozen, fit, init_from_target, training_vocab

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Recipe:
    target: str
    prompts: list[str]  # source specs: JSONL files, named sources, NAME=WEIGHT (train/sources.py)
    out: str
    work: str
    num_prompts: int | None = None  # per source; with weights, the size of the mix
    heldout_sets: list[str] = dataclasses.field(default_factory=list)  # more files to decontaminate against
    until: str = "fit"  # regenerate | features | fit: the last phase this run does
    regenerate: bool = True  # False: no new responses; the prompts that have one in the work folder are the data
    self_temperature: float = 1.0  # the self source's sampling temperature
    train_on_evaluation_prompts: bool = False  # no decontamination (logged): the tests' tiny recipes
    max_new_tokens: int = 256
    generator: str = "sglang"  # sglang | hf
    server_url: str | None = None  # use a running server instead of launching one
    gen_dtype: str = "bfloat16"
    gen_concurrency: int = 32
    feature_dtype: str = "bfloat16"
    num_layers: int = 3
    block_size: int = 16
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    init: str = "target"  # target | random | a draft folder (published format) to continue from
    fit: FitConfig = dataclasses.field(default_factory=FitConfig)
    device: str = "cpu"


def load_target(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, tok


def regenerate(r: Recipe, tok, target=None, layer_ids: list[int] | None = None) -> list[dict]:
    """The target's responses to the prompt set; with the hf generator in the feature dtype, the features of
    layer_ids are captured on the way (features.build_feature_cache takes them from work/features/captured)."""
    def self_source(n: int) -> list[dict]:  # the self source samples from the loaded target
        from sglang_dflash.train.self_prompts import sample_self_prompts

        return sample_self_prompts(target if target is not None else load_target(r.target, torch.float32)[0], tok,
                                   n, Path(r.work) / "self-prompts.jsonl", r.fit.seed, r.self_temperature)

    prompts, report = training_prompts(r.prompts, r.num_prompts, r.fit.seed, r.heldout_sets, self_source,
                                       check=not r.train_on_evaluation_prompts)
    Path(r.work).mkdir(parents=True, exist_ok=True)
    (Path(r.work) / "decontamination.json").write_text(json.dumps(report, indent=2) + "\n")
    out = Path(r.work) / "responses.jsonl"
    if not r.regenerate:  # a regeneration stopped part-way (over sittings): train on what it made
        missing = len(data.missing_responses(prompts, out))
        log.info("regenerate: off (--no-regenerate): %d of the %d prompts have a response in %s and are the data; "
                 "%d have none", len(prompts) - missing, len(prompts), out, missing)
        if missing == len(prompts):
            raise ValueError(f"--no-regenerate: none of the {len(prompts)} prompts has a response in {out}")
    elif r.generator == "hf":  # batches of gen_concurrency prompts, in gen_dtype
        dtype = getattr(torch, r.gen_dtype)
        same = target is not None and target.dtype == dtype
        model = target if same else load_target(r.target, dtype)[0].to(r.device)
        capture = (Path(r.work) / "features", layer_ids) if same and layer_ids else None
        data.regenerate_with_hf(model, tok, prompts, out, r.max_new_tokens, batch_size=r.gen_concurrency,
                                capture=capture)
    elif r.server_url:
        data.regenerate_with_server(r.server_url, tok, prompts, out, r.max_new_tokens, r.gen_concurrency)
    elif data.missing_responses(prompts, out):
        from sglang_dflash.server import sglang_server

        # a KV pool for gen_concurrency requests of up to 512 prompt tokens (SGLang's default on a CPU takes
        # most of the machine's memory: 16 GB for SmolLM2 in float32 on the project's 24 GB machines)
        pool = r.gen_concurrency * (512 + r.max_new_tokens)
        with sglang_server(r.target, "--dtype", r.gen_dtype, "--max-running-requests", str(r.gen_concurrency),
                           "--max-total-tokens", str(pool),
                           log_path=str(Path(r.work) / "regenerate-server.log"), timeout=600) as url:
            data.regenerate_with_server(url, tok, prompts, out, r.max_new_tokens, r.gen_concurrency)
    order = {p["id"]: i for i, p in enumerate(prompts)}  # the prompt set's order, whatever order they finished in
    return sorted((row for row in data.read_responses(out) if row["id"] in order), key=lambda row: order[row["id"]])


def draft_config(r: Recipe, target, tok) -> DraftConfig:
    mask = r.mask_token_id if r.mask_token_id is not None else tok.mask_token_id
    if mask is None:
        raise ValueError(f"the tokenizer of {r.target} has no mask token: give --mask-token-id "
                         "(an id the target's text never contains, e.g. an unused special token)")
    return draft_config_for_target(target.config, num_layers=r.num_layers, block_size=r.block_size,
                                   mask_token_id=mask, target_layer_ids=r.target_layer_ids)


def run(r: Recipe) -> dict:
    work = Path(r.work)
    work.mkdir(parents=True, exist_ok=True)
    settings = work / "recipe.json"
    if settings.exists():
        old = json.loads(settings.read_text())
        for key in ("target", "num_layers", "block_size", "target_layer_ids", "mask_token_id"):
            if old.get(key) != dataclasses.asdict(r).get(key):
                raise ValueError(f"{work} was made with {key}={old.get(key)!r}, this run asks {key}="
                                 f"{dataclasses.asdict(r).get(key)!r}: use another --work folder")
    settings.write_text(json.dumps(dataclasses.asdict(r), indent=2) + "\n")

    target, tok = load_target(r.target, getattr(torch, r.feature_dtype))
    target.to(r.device)  # regeneration (hf) and the feature cache run on the training device
    cfg = draft_config(r, target, tok)
    cfg.check_target(target.config)
    torch.manual_seed(r.fit.seed)
    draft = initial_draft(r, cfg, target)  # before the long phases: a bad --init fails at once
    responses = regenerate(r, tok, target, stored_layers(work / "features", cfg.target_layer_ids))
    if r.until == "regenerate":
        return {"phase": "regenerate", "responses": len(responses)}
    cache = build_feature_cache(target, responses, cfg.target_layer_ids, work / "features")
    if r.until == "features":
        return {"phase": "features", "responses": len(responses)}
    seqs = cache.load(cfg.target_layer_ids)

    frozen = Frozen(target.get_input_embeddings().weight.float().cpu(),
                    target.get_output_embeddings().weight.float().cpu(), training_vocab(seqs, cfg.vocab_size))
    del target
    if r.fit.workers > 1:
        metrics = fit_parallel(r.fit.workers, draft, frozen, work / "features", cfg.target_layer_ids, r.fit, work,
                               r.out, device=r.device)
    else:
        metrics = fit(draft, frozen, seqs, r.fit, work, r.out, device=r.device)
    if metrics.get("step") == r.fit.steps:  # finished: a run paused by --stop-at writes no card
        write_card(r, metrics, len(seqs), sum(s.tokens.numel() - s.prompt_len for s in seqs))
    return metrics


def initial_draft(r: Recipe, cfg: DraftConfig, target) -> DFlashDraftModel:
    """The draft training starts from: random, the target's last layers, or an earlier draft (--init PATH),
    which must have exactly the architecture this run asks for."""
    if r.init in ("target", "random"):
        draft = DFlashDraftModel.random(cfg, seed=r.fit.seed)
        if r.init == "target":
            init_from_target(draft, target)
        return draft
    if not (Path(r.init) / "config.json").is_file():
        raise ValueError(f"--init {r.init!r}: neither 'target', 'random' nor a draft folder with a config.json")
    start = DFlashDraftModel.from_pretrained(r.init, dtype=torch.float32)
    theirs, ours = start.config.to_dict(), cfg.to_dict()
    if theirs != ours:
        diff = {k: (v, ours.get(k)) for k, v in theirs.items() if ours.get(k) != v}
        raise ValueError(f"--init {r.init}: its architecture differs from this run's (theirs, ours): {diff}")
    return start


def write_card(r: Recipe, metrics: dict, num_seqs: int, num_tokens: int) -> None:
    """out/TRAINING.json: the recipe, the data's size and the last metrics, written when the run has finished
    (launch/train-smollm2-draft.sh takes it as the sign that a stage is done)."""
    card = Path(r.out) / "TRAINING.json"
    card.write_text(json.dumps({"recipe": dataclasses.asdict(r), "sequences": num_seqs,
                                "response_tokens": num_tokens, "final": metrics}, indent=2) + "\n")
