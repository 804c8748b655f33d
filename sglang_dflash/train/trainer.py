"""Fit a DFlash draft to cached target features (train/features.py) with the objective of train/objective.py.

One optimizer step = `seqs_per_step` sequences, each with `blocks_per_seq` random
anchors, all of a sequence's blocks in one draft forward. The loss on block row k
(weight exp(-(k-1)/gamma)) is cross-entropy on the target's token plus `kl_weight` ×
KL(target ‖ draft), both over the training vocabulary: the tokens that occur in the
training sequences (the frozen 49k-row head is most of the cost; the tokens the
target actually emits are a few thousand). The shared embedding and lm_head are
frozen and not part of the draft checkpoint.

Everything needed to resume (weights, AdamW state, step, RNG) is saved in
`work/checkpoint.pt` every `save_every` steps. Every `eval_every` steps the held-out sequences
give two acceptance figures (greedy, full vocabulary): teacher-forced on random anchors,
τ_est = 1 + mean accepted drafts (heldout_tau), and the τ of greedy decoding replayed over them
(heldout_decoding_tau, what eval-draft measures; lower: decoding spends more blocks where the
draft fails). The published-format draft is exported to `out` whenever the decoding τ is the best
so far (more steps on little data overfit: the held-out figure peaks, then falls). Without
held-out sequences, or with keep_best off, it is exported at every checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_dflash.block import accepted_counts, acceptance_by_row
from sglang_dflash.models.reference import DFlashDraftModel
from sglang_dflash.train.features import Sequence
from sglang_dflash.train.objective import (IGNORE, block_inputs, expected_tau, position_weights, sample_anchors,
                                           teacher_forced_accepts, training_block_mask)
from sglang_dflash.train.parallel import all_reduce_grads, rank_and_world, usable_cores

log = logging.getLogger(__name__)


@dataclasses.dataclass
class FitConfig:
    steps: int = 1000
    seqs_per_step: int = 4
    blocks_per_seq: int = 32
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    clip: float = 1.0
    gamma: float = 7.0
    kl_weight: float = 1.0
    heldout: int = 32  # sequences kept out of training for the acceptance figures
    heldout_decode: int = 8  # of them, how many the decoding figure replays (~6 s each for SmolLM2 on a 2-core CPU)
    eval_every: int = 100
    save_every: int = 100
    seed: int = 0
    autocast: str = "auto"  # bf16 autocast: on | off | auto (on where bf16 products are native, see bf16_is_native)
    stop_at: int = 0  # when > 0, pause after this step (checkpointed; the same command resumes)
    keep_best: bool = True  # export the step with the best held-out τ (False: every checkpoint's step)
    workers: int = 1  # data-parallel processes (train/parallel.py): on a CPU each takes cores / workers threads


def lr_at(step: int, cfg: FitConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio × lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def training_vocab(seqs: list[Sequence], vocab_size: int) -> torch.Tensor:
    """Sorted ids of every token in the sequences -> [V']."""
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for s in seqs:
        seen[s.tokens] = True
    return seen.nonzero().view(-1)


class Frozen:
    """The target's embedding and lm_head rows the draft uses, frozen."""

    def __init__(self, embed: torch.Tensor, head: torch.Tensor, vocab: torch.Tensor):
        self.embed = embed.detach()  # [V, H]
        self.head = head.detach()  # [V, H]
        self.vocab = vocab  # [V'] ids
        self.head_sub = self.head[vocab]  # [V', H]
        self.to_sub = torch.full((head.shape[0],), -1, dtype=torch.long)
        self.to_sub[vocab] = torch.arange(vocab.numel())


def draft_hidden(draft: DFlashDraftModel, frozen: Frozen, seq: Sequence, anchors: torch.Tensor, device):
    """All blocks of one sequence in one forward -> hidden [N, B, H], positions [N, B], labels [N, B]."""
    B, T = draft.config.block_size, seq.tokens.numel()
    dtype = next(draft.parameters()).dtype
    ids, positions, labels = block_inputs(seq.tokens, anchors, B, draft.config.mask_token_id)
    embeds = frozen.embed[ids.view(-1)].to(device, dtype)[None]  # [1, Q, H]
    context = draft.context_kv(seq.context.to(device, dtype)[None], torch.arange(T, device=device)[None])
    mask = training_block_mask(anchors.to(device), T, B)[None, None]  # [1, 1, Q, T + Q]
    hidden = draft(embeds, positions.view(1, -1).to(device), context, mask)
    return hidden.view(*ids.shape, -1), positions, labels


def sequence_loss(draft, frozen: Frozen, seq: Sequence, anchors, weights, cfg: FitConfig, device):
    """Weighted CE (+ KL to the target) over the training vocabulary for one sequence's blocks -> (loss, Σw)."""
    hidden, positions, labels = draft_hidden(draft, frozen, seq, anchors, device)
    keep = labels != IGNORE  # [N, B] (on the CPU, like the cached features)
    h = hidden[keep.to(device)]  # [R, H]
    w = weights[None].expand_as(labels)[keep].to(device)  # [R]
    head = frozen.head_sub.to(device, h.dtype)
    logits = (h @ head.T).float()  # [R, V']
    ce = F.cross_entropy(logits, frozen.to_sub[labels[keep]].to(device), reduction="none")
    loss = ce
    if cfg.kl_weight:
        teacher = seq.final[(positions - 1)[keep]].to(device, h.dtype)  # the target's state that predicts each label
        t_logp = torch.log_softmax((teacher @ head.T).float(), dim=-1)
        kl = (t_logp.exp() * (t_logp - torch.log_softmax(logits, dim=-1))).sum(-1)
        loss = ce + cfg.kl_weight * kl
    return (loss * w).sum(), w.sum()


@torch.no_grad()
def heldout_tau(draft, frozen: Frozen, seqs: list[Sequence], device, blocks_per_seq: int = 16, seed: int = 1234):
    """Teacher-forced greedy acceptance with the full head on held-out sequences -> (τ_est, per-row acceptance)."""
    gen = torch.Generator().manual_seed(seed)
    accepted = []
    for seq in seqs:
        anchors = sample_anchors(seq.prompt_len, seq.tokens.numel(), blocks_per_seq, gen)
        if anchors.numel() == 0:
            continue
        hidden, _, labels = draft_hidden(draft, frozen, seq, anchors, device)
        pred = (hidden.float() @ frozen.head.to(device).float().T).argmax(-1).cpu()
        accepted.append(teacher_forced_accepts(pred, labels))
    acc = torch.cat(accepted) if accepted else torch.empty(0, dtype=torch.long)
    return expected_tau(acc), acceptance_by_row(accepted_counts(acc, draft.config.block_size)) if acc.numel() else []


@torch.no_grad()
def heldout_decoding_tau(draft, frozen: Frozen, seqs: list[Sequence], device) -> float:
    """τ of greedy speculative decoding over the held-out responses, replayed from their cached features
    (train/evaluate.py): what eval-draft measures, on each response but its last block_size - 1 tokens
    (whose blocks would be judged against tokens past the cached end)."""
    from sglang_dflash.train.evaluate import replay_walks

    B = draft.config.block_size
    embed, head = frozen.embed.to(device), frozen.head.to(device)
    seqs = [s for s in seqs if s.tokens.numel() - s.prompt_len - (B - 1) > 1]
    if not seqs:
        return 0.0
    walks = replay_walks(draft, lambda ids: embed[ids], head, [s.tokens.to(device) for s in seqs],
                         [s.context for s in seqs], [s.prompt_len for s in seqs],
                         [s.tokens.numel() - s.prompt_len - (B - 1) for s in seqs])
    steps = [n for walk in walks for n in walk]
    return sum(steps) / max(len(steps), 1)


def fit(draft: DFlashDraftModel, frozen: Frozen, seqs: list[Sequence], cfg: FitConfig, work: str | Path,
        out: str | Path, device="cpu", progress: bool = True) -> dict:
    """Train draft in place (resuming from work/checkpoint.pt) and export it to out -> the last metrics.
    Inside a process group (train/parallel.py) each worker computes its share of a step's sequences; the
    lead worker (rank 0) evaluates, exports, checkpoints and logs."""
    rank, world = rank_and_world()
    lead = rank == 0
    work, out = Path(work), Path(out)
    work.mkdir(parents=True, exist_ok=True)
    train_seqs, held = split_heldout(seqs, cfg.heldout, lead)
    draft.to(device).train()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    ckpt = work / "checkpoint.pt"
    step, metrics = resume(draft, opt, ckpt)
    end = min(cfg.steps, cfg.stop_at) if cfg.stop_at > 0 else cfg.steps
    if step >= cfg.steps and not (out / "model.safetensors").is_file():  # a finished run, asked for another out
        if held and cfg.keep_best:  # its export is the best held-out step's weights, which no checkpoint holds
            raise ValueError(f"the run in {work} has already finished (step {step}) and {out} holds no draft: its "
                             "draft is in the --out folder of the run that trained it (or start over with a new --work)")
        if lead:  # its export is the last step's weights: the checkpoint's
            export(draft, metrics, out)
    log_file = open(work / "log.jsonl", "a") if lead else None
    bar = None
    if progress and lead:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="train", dynamic_ncols=True)
    amp = torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=use_autocast(cfg, device))
    weights = position_weights(draft.config.block_size, cfg.gamma)
    t0 = time.time()
    while step < end:
        loss = train_step(draft, frozen, train_seqs, opt, params, weights, cfg, step, device, amp)
        step += 1
        metrics.update(step=step, loss=loss, lr=lr_at(step - 1, cfg), seconds=round(time.time() - t0, 1))
        if lead and held and (step % cfg.eval_every == 0 or step == cfg.steps):
            evaluate_heldout(draft, frozen, held, cfg, device, amp, world, metrics)
            if metrics["heldout_decoding_tau"] > metrics.get("best_heldout_decoding_tau", 0.0):
                metrics.update(best_heldout_decoding_tau=metrics["heldout_decoding_tau"], best_step=step)
                if cfg.keep_best:
                    export(draft, metrics, out)
        if not lead:
            continue
        if step % cfg.save_every == 0 or step == end:
            save_checkpoint(draft, opt, step, metrics, ckpt)
            if not (held and cfg.keep_best):
                export(draft, metrics, out)
        log_file.write(json.dumps(metrics) + "\n")
        log_file.flush()
        if bar:
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics.get('heldout_decoding_tau', float('nan')):.2f}")
    if bar:
        bar.close()
    if log_file:
        log_file.close()
    draft.eval()
    return metrics


def split_heldout(seqs: list[Sequence], heldout: int, lead: bool = True) -> tuple[list[Sequence], list[Sequence]]:
    """(training sequences, the last `heldout` kept out for the acceptance figures); none kept out, said in
    the log, when there are not more than twice as many sequences."""
    n_held = heldout if len(seqs) > 2 * heldout else 0
    if heldout and not n_held and lead:
        log.warning("fit: held-out evaluation is off: %d sequences are not more than twice --heldout %d; every "
                    "sequence is trained on and the export is the last step's (more data, or --heldout 0 to say so)",
                    len(seqs), heldout)
    train_seqs, held = seqs[:len(seqs) - n_held], seqs[len(seqs) - n_held:]
    if not train_seqs:
        raise ValueError("no training sequences")
    return train_seqs, held


def resume(draft, opt, ckpt: Path) -> tuple[int, dict]:
    """The step and metrics of work/checkpoint.pt, its weights and optimizer state loaded; (0, {}) without one."""
    if not ckpt.exists():
        return 0, {}
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    draft.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return state["step"], state.get("metrics", {})


def train_step(draft, frozen: Frozen, train_seqs: list[Sequence], opt, params, weights, cfg: FitConfig, step: int,
               device, amp) -> float:
    """One optimizer step at `step` -> its mean weighted loss. The sequences and anchors are a function of the
    step alone (a resumed run repeats nothing); each worker of a process group takes every world-th sequence,
    and the gradients are summed over the workers before the step."""
    rank, world = rank_and_world()
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    picks = torch.randint(len(train_seqs), (cfg.seqs_per_step,), generator=gen).tolist()
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    opt.zero_grad(set_to_none=True)
    total, wsum = 0.0, 0.0
    with amp:
        for j, i in enumerate(picks):
            seq = train_seqs[i]
            # every worker draws every sequence's anchors, so the generator runs as in one process
            anchors = sample_anchors(seq.prompt_len, seq.tokens.numel(), cfg.blocks_per_seq, gen)
            if j % world != rank or anchors.numel() == 0:
                continue
            loss, w = sequence_loss(draft, frozen, seq, anchors, weights, cfg, device)
            loss.backward()
            total, wsum = total + loss.item(), wsum + w.item()
    if world > 1:
        total, wsum = all_reduce_grads(params, total, wsum)
    if wsum:
        for p in params:
            if p.grad is not None:
                p.grad /= wsum
        torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
    return total / max(wsum, 1e-9)


def evaluate_heldout(draft, frozen: Frozen, held: list[Sequence], cfg: FitConfig, device, amp, world: int,
                     metrics: dict) -> None:
    """The held-out figures into metrics: teacher-forced τ and per-row acceptance, and the replayed decoding τ."""
    # the other workers wait at the next step's all-reduce: on a CPU their cores are free meanwhile
    threads = torch.get_num_threads()
    if world > 1 and torch.device(device).type == "cpu":
        torch.set_num_threads(usable_cores())
    draft.eval()
    with amp:
        metrics["heldout_tau"], metrics["heldout_accept"] = heldout_tau(draft, frozen, held, device)
        metrics["heldout_decoding_tau"] = heldout_decoding_tau(draft, frozen, held[:cfg.heldout_decode], device)
    draft.train()
    torch.set_num_threads(threads)


def bf16_is_native(device) -> bool:
    """Whether bf16 products run natively: CUDA with bf16 support, or a CPU with AVX512-BF16 or AMX. Elsewhere
    torch emulates them (measured on a 2-core EPYC VM exposing AVX2 only: a [2048, 576] x [576, 1536] product
    takes 121 ms in bf16 against 25 ms in float32), and bf16 autocast would make the products of training
    five times slower."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def use_autocast(cfg: FitConfig, device) -> bool:
    setting = str(cfg.autocast).lower()
    if setting == "auto":
        return bf16_is_native(device)
    if setting in ("on", "true", "1", "yes"):
        return True
    if setting in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"autocast must be on, off or auto, not {cfg.autocast!r}")


def save_checkpoint(draft, opt, step, metrics, ckpt: Path) -> None:
    tmp = ckpt.with_suffix(".tmp")
    torch.save({"model": draft.state_dict(), "optimizer": opt.state_dict(), "step": step, "metrics": metrics}, tmp)
    tmp.replace(ckpt)


def export(draft, metrics, out: Path) -> None:
    """The draft in the published format (bf16) with the metrics of the step it was taken at."""
    model = DFlashDraftModel(draft.config)
    model.load_state_dict({k: v.detach().to(torch.bfloat16) for k, v in draft.state_dict().items()}, assign=True)
    model.save_pretrained(out)
    (out / "training_state.json").write_text(json.dumps(metrics, indent=2) + "\n")


def init_from_target(draft: DFlashDraftModel, target) -> list[str]:
    """Start the draft's layers as copies of the target's last layers (same shapes), its final norm as the
    target's, and the context projection as the identity on the last feature layer -> what was copied."""
    layers = target.model.layers
    n = len(draft.layers)
    copied = []
    with torch.no_grad():
        for i, layer in enumerate(draft.layers):
            src = layers[len(layers) - n + i]
            for name, p in layer.named_parameters():
                sp = dict(src.named_parameters()).get(name)
                if sp is not None and sp.shape == p.shape:
                    p.copy_(sp.float())
                    copied.append(f"layers.{i}.{name}")
        draft.norm.weight.copy_(target.model.norm.weight.float())
        H = draft.config.hidden_size
        draft.fc.weight.normal_(0, 0.02 / math.sqrt(draft.config.num_features))
        draft.fc.weight[:, -H:] += torch.eye(H)
    return copied
