"""Target features for training, computed once and cached on disk.

For every regenerated sequence (prompt + response) one target forward gives
  context  [T, F]  hidden states after each of the draft's target_layer_ids, concatenated
                   (what the serving path captures and writes into the draft context)
  final    [T, H]  the target's last hidden state after its final norm: lm_head(final[t])
                   is the target's distribution for token t + 1 (the distillation target)
stored in bf16 safetensors shards of `shard_size` sequences with their token ids,
offsets and prompt lengths. Shards that exist are kept, so a run resumes.

Features the regeneration already captured (batched_greedy.py, from the forwards that
generated the responses) wait in `captured/`, in the same format, and are taken from there
instead of running the target again; the folder is removed once every shard is built.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from sglang_dflash.generate import target_features

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Sequence:
    tokens: torch.Tensor  # [T] long
    prompt_len: int
    stored: torch.Tensor  # [T, F'] the cache's features (every layer it holds)
    final: torch.Tensor  # [T, H]
    columns: torch.Tensor | None = None  # stored's columns that are the draft's context (None: all of them)

    @property
    def context(self) -> torch.Tensor:
        """[T, F]: the states after the draft's target layers, concatenated."""
        return self.stored if self.columns is None else self.stored[:, self.columns]


class FeatureCache:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.shards = sorted(self.root.glob("shard-*.safetensors"))

    @property
    def layer_ids(self) -> list[int] | None:
        """The target layers whose states the cache holds, in their order in a row; None before it is made."""
        path = self.root / "layers.json"
        return json.loads(path.read_text())["target_layer_ids"] if path.exists() else None

    def __len__(self) -> int:
        return sum(self._meta(s)["count"] for s in self.shards)

    def _meta(self, shard: Path) -> dict:
        return json.loads(shard.with_suffix(".json").read_text())

    def load(self, layer_ids: list[int] | None = None) -> list[Sequence]:
        """Every cached sequence (bf16 features), in shard order, its context the states after layer_ids (any
        of the cache's layers, in any order; default all of them). The features are memory-mapped, not read:
        a cache larger than the machine's memory trains (what a step uses is read from disk then)."""
        held = self.layer_ids
        pick = layer_ids is not None and layer_ids != held
        if pick and not set(layer_ids) <= set(held or []):
            raise ValueError(f"{self.root} holds the states of target layers {held}, not of all of {layer_ids}")
        seqs = []
        for shard in self.shards:
            t = mapped_safetensors(shard)
            off = t["offsets"].tolist()
            H = t["final"].shape[1]
            columns = torch.cat([torch.arange(H) + held.index(i) * H for i in layer_ids]) if pick else None
            for i in range(len(off) - 1):
                a, b = off[i], off[i + 1]
                seqs.append(Sequence(t["tokens"][a:b].long(), int(t["prompt_lens"][i]), t["context"][a:b],
                                     t["final"][a:b], columns))
        return seqs


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32,
           "I64": torch.int64, "U8": torch.uint8}


def mapped_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as read-only views of a memory map of it (copy-on-write: writing
    to them never changes the file). The format: an 8-byte little-endian header length, a JSON header
    naming each tensor's dtype, shape and byte range in the data that follows."""
    path = Path(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    raw = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = (8 + n + o for o in info["data_offsets"])
        dtype = _DTYPES[info["dtype"]]
        data = raw[begin:end]
        if begin % dtype.itemsize:  # a view of another dtype needs an aligned start; copy this one
            data = data.clone()
        out[name] = data.view(dtype).view(info["shape"])
    return out


def save_shard(path: Path, ids: list[str], rows: list[tuple[list[int], int, torch.Tensor, torch.Tensor]]) -> None:
    """rows (token ids, prompt length, context [T, F], final [T, H]) -> a shard file and its index.

    Each file is written under a temporary name and then renamed over the old one: an interrupted write
    leaves no half shard, and a shard hard-linked from an earlier stage's work folder (as
    launch/train-smollm2-draft.sh seeds them) is replaced here, not overwritten there."""
    from safetensors.torch import save_file

    offsets = [0]
    for tokens, *_ in rows:
        offsets.append(offsets[-1] + len(tokens))
    tmp = path.with_name(path.name + ".tmp")
    save_file({"tokens": torch.tensor([t for tokens, *_ in rows for t in tokens], dtype=torch.int32),
               "offsets": torch.tensor(offsets), "prompt_lens": torch.tensor([n for _, n, _, _ in rows]),
               "context": torch.cat([c.to(torch.bfloat16) for _, _, c, _ in rows]).contiguous(),
               "final": torch.cat([f.to(torch.bfloat16) for _, _, _, f in rows]).contiguous()}, str(tmp))
    tmp.replace(path)
    index, tmp = path.with_suffix(".json"), path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"count": len(rows), "ids": ids}))
    tmp.replace(index)  # last: the index names the ids of a complete shard


def save_captured(root: str | Path, responses: list[dict], features: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Features captured while generating `responses` (rows of data.regenerate_*), kept for build_feature_cache."""
    folder = Path(root) / "captured"
    folder.mkdir(parents=True, exist_ok=True)
    rows = [(r["prompt_ids"] + r["output_ids"], len(r["prompt_ids"]), c, f) for r, (c, f) in zip(responses, features)]
    save_shard(folder / f"batch-{time.time_ns()}.safetensors", [r["id"] for r in responses], rows)


class _Captured:
    """id -> (context, final) from captured/. Every file is memory-mapped once: the cache is built in the
    prompt set's order and the regeneration captured in its own (runs of batches sorted by length), so
    consecutive responses come from different files, and each switch read a whole file again (~20 ms for a
    140 MB file in the page cache, more from disk)."""

    def __init__(self, folder: Path):
        self.where = {}
        for meta in sorted(folder.glob("batch-*.json")):
            for i, id_ in enumerate(json.loads(meta.read_text())["ids"]):
                self.where[id_] = (meta.with_suffix(".safetensors"), i)
        self.files: dict[Path, dict[str, torch.Tensor]] = {}

    def get(self, id_: str, tokens: list[int]):
        if id_ not in self.where:
            return None
        path, i = self.where[id_]
        if path not in self.files:
            self.files[path] = mapped_safetensors(path)
        t = self.files[path]
        a, b = t["offsets"][i].item(), t["offsets"][i + 1].item()
        if t["tokens"][a:b].tolist() != tokens:
            raise ValueError(f"{path}: the captured features of {id_!r} are for other tokens than its response")
        return t["context"][a:b], t["final"][a:b]


def stored_layers(root: str | Path, layer_ids: list[int]) -> list[int]:
    """The layers a feature folder holds, or will hold, for a draft of layer_ids: the folder's own where it
    was made with more (a subset of them serves), else layer_ids."""
    held = FeatureCache(root).layer_ids
    if held is None or held == layer_ids:
        return layer_ids
    if not set(layer_ids) <= set(held):
        raise ValueError(f"{root} holds the states of target layers {held}, not of all of {layer_ids}: "
                         "use another work folder")
    return held


@torch.no_grad()
def build_feature_cache(target, responses: list[dict], layer_ids: list[int], root: str | Path,
                        shard_size: int = 256, max_len: int = 2048, progress: bool = True) -> FeatureCache:
    """Run the target over every response (rows of data.regenerate_*) and cache its features, taking those
    the regeneration captured where they exist. A folder whose layers.json already names more layers than
    layer_ids, all of them among its own, keeps them: a cache made for more layers (or captured with more)
    serves a draft of any subset (FeatureCache.load picks the columns)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    layer_ids = stored_layers(root, layer_ids)
    (root / "layers.json").write_text(json.dumps({"target_layer_ids": layer_ids}))
    captured = _Captured(root / "captured")
    shards = [responses[i:i + shard_size] for i in range(0, len(responses), shard_size)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(responses), desc="features", dynamic_ncols=True)
    device = next(target.parameters()).device
    cut = 0  # sequences longer than max_len, kept to their first max_len tokens
    for n, rows in enumerate(shards):
        path = root / f"shard-{n:05d}.safetensors"
        meta_path = path.with_suffix(".json")
        ids = [r["id"] for r in rows]
        if path.exists() and meta_path.exists() and json.loads(meta_path.read_text())["ids"] == ids:
            if bar:
                bar.update(len(rows))
            continue
        out_rows = []
        for r in rows:
            tokens = r["prompt_ids"] + r["output_ids"]
            got = captured.get(r["id"], tokens)
            if got is not None and got[0].shape[1] != len(layer_ids) * got[1].shape[1]:
                raise ValueError(f"the captured features of {r['id']!r} hold {got[0].shape[1] // got[1].shape[1]} "
                                 f"layers, the cache {len(layer_ids)} ({layer_ids})")
            if got is None:
                out = target(input_ids=torch.tensor(tokens[:max_len])[None].to(device), output_hidden_states=True,
                             logits_to_keep=1)
                got = (target_features(out.hidden_states, layer_ids)[0].to("cpu", torch.bfloat16),
                       out.hidden_states[-1][0].to("cpu", torch.bfloat16))
            out_rows.append((tokens[:max_len], len(r["prompt_ids"]), got[0][:max_len], got[1][:max_len]))
            cut += len(tokens) > max_len
            if bar:
                bar.update(1)
        save_shard(path, ids, out_rows)
    if bar:
        bar.close()
    if cut:
        log.warning("features: %d of the %d sequences built now are longer than %d tokens and were cut to their first "
                    "%d (their tails are not trained on)", cut, sum(map(len, shards)), max_len, max_len)
    shutil.rmtree(root / "captured", ignore_errors=True)  # every captured row is in a shard now
    return FeatureCache(root)
