"""Data-parallel fit: `workers` processes take turns over each step's sequences and sum their gradients.

Every worker draws the step's sequences and anchors from the same step-seeded generator (trainer.fit),
computes the loss of its share (sequence j of the step goes to worker j % workers), and the gradients
and loss sums are all-reduced before the one AdamW step that every worker applies to its identical copy.
So a run with N workers is the single-process run up to the order of floating-point sums, and either
resumes the other's checkpoint. Worker 0 alone evaluates, exports, checkpoints and logs.

Why on a CPU: the draft's products are too small to keep two cores busy from one process. Measured on
this project's 2-core machines (SmolLM2 draft, 4 sequences x 32 blocks a step, bf16 autocast): one
process with 2 threads 2.6 s a step; --workers 2 (one thread each) 1.41 s, 1.66 s on average over the
2,250 steps of stage 5 it ran, evaluations included.
On CUDA each worker takes one GPU (cuda:RANK) and NCCL (written for it, not yet run on a GPU).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_grads(params: list[torch.Tensor], total: float, wsum: float) -> tuple[float, float]:
    """Sum every worker's gradients (in place) and loss sums -> the summed (total, wsum). A parameter that no
    worker gave a gradient keeps grad None, as in a single process (AdamW then leaves it alone)."""
    device = params[0].device
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=device)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])
    sums = torch.tensor([total, wsum], dtype=torch.float64, device=device)
    for t in (has, flat, sums):
        dist.all_reduce(t)
    offset = 0
    for p, got in zip(params, has.tolist()):
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype) if got else None
        offset += n
    return sums[0].item(), sums[1].item()


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def fit_parallel(workers: int, draft, frozen, features: str | Path, layer_ids: list[int], cfg, work: str | Path,
                 out: str | Path, device: str = "cpu") -> dict:
    """trainer.fit in `workers` processes; each maps the feature cache at `features` itself -> the last metrics."""
    if device.startswith("cuda") and workers > torch.cuda.device_count():
        raise ValueError(f"--workers {workers} asks for one GPU each; this machine has {torch.cuda.device_count()}")
    with socket.socket() as s:  # a free port for the workers' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = {k: v.detach().cpu() for k, v in draft.state_dict().items()}
    torch.multiprocessing.spawn(_worker, nprocs=workers, join=True,
                                args=(workers, port, draft.config, state, frozen, str(features), layer_ids, cfg,
                                      str(work), str(out), device))
    return torch.load(Path(work) / "checkpoint.pt", map_location="cpu", weights_only=False)["metrics"]


def _worker(rank, workers, port, config, state, frozen, features, layer_ids, cfg, work, out, device):
    from sglang_dflash.models.reference import DFlashDraftModel
    from sglang_dflash.train.features import FeatureCache
    from sglang_dflash.train.trainer import fit

    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, usable_cores() // workers))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=workers)
    try:
        draft = DFlashDraftModel(config)
        draft.load_state_dict(state)  # a copy: the spawned state is one shared-memory tensor set for all workers
        seqs = FeatureCache(features).load(layer_ids)
        fit(draft, frozen, seqs, cfg, work, out, device=device, progress=rank == 0)
    finally:
        dist.destroy_process_group()
