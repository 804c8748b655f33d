"""Target features for training, computed once and cached on disk.

For every regenerated sequence (prompt + response) one target forward gives
  context  [T, F]  hidden states after each of the draft's target_layer_ids, concatenated
                   (what the serving path captures and writes into the draft context)
  final    [T, H]  the target's last hidden state after its final norm: lm_head(final[t])
                   is the target's distribution for token t + 1 (the distillation target)
stored in bf16 safetensors shards of `shard_size` sequences with their token ids,
offsets and prompt lengths. Shards that exist are kept, so a run resumes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from sglang_dflash.generate import target_features


@dataclasses.dataclass
class Sequence:
    tokens: torch.Tensor  # [T] long
    prompt_len: int
    context: torch.Tensor  # [T, F]
    final: torch.Tensor  # [T, H]


class FeatureCache:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.shards = sorted(self.root.glob("shard-*.safetensors"))

    def __len__(self) -> int:
        return sum(self._meta(s)["count"] for s in self.shards)

    def _meta(self, shard: Path) -> dict:
        return json.loads(shard.with_suffix(".json").read_text())

    def load(self) -> list[Sequence]:
        """Every cached sequence (bf16 features), in shard order."""
        from safetensors.torch import load_file

        seqs = []
        for shard in self.shards:
            t = load_file(str(shard))
            off = t["offsets"].tolist()
            for i in range(len(off) - 1):
                a, b = off[i], off[i + 1]
                seqs.append(Sequence(t["tokens"][a:b].long(), int(t["prompt_lens"][i]), t["context"][a:b],
                                     t["final"][a:b]))
        return seqs


@torch.no_grad()
def build_feature_cache(target, responses: list[dict], layer_ids: list[int], root: str | Path,
                        shard_size: int = 256, max_len: int = 2048, progress: bool = True) -> FeatureCache:
    """Run the target over every response (rows of data.regenerate_*) and cache its features."""
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "layers.json").write_text(json.dumps({"target_layer_ids": layer_ids}))
    shards = [responses[i:i + shard_size] for i in range(0, len(responses), shard_size)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(responses), desc="features", dynamic_ncols=True)
    for n, rows in enumerate(shards):
        path = root / f"shard-{n:05d}.safetensors"
        meta_path = path.with_suffix(".json")
        ids = [r["id"] for r in rows]
        if path.exists() and meta_path.exists() and json.loads(meta_path.read_text())["ids"] == ids:
            if bar:
                bar.update(len(rows))
            continue
        tokens, prompt_lens, context, final, offsets = [], [], [], [], [0]
        device = next(target.parameters()).device
        for r in rows:
            seq = torch.tensor((r["prompt_ids"] + r["output_ids"])[:max_len])
            out = target(input_ids=seq[None].to(device), output_hidden_states=True, logits_to_keep=1)
            tokens.append(seq.to(torch.int32))
            prompt_lens.append(len(r["prompt_ids"]))
            context.append(target_features(out.hidden_states, layer_ids)[0].to("cpu", torch.bfloat16))
            final.append(out.hidden_states[-1][0].to("cpu", torch.bfloat16))
            offsets.append(offsets[-1] + seq.numel())
            if bar:
                bar.update(1)
        save_file({"tokens": torch.cat(tokens), "offsets": torch.tensor(offsets), "prompt_lens": torch.tensor(prompt_lens),
                   "context": torch.cat(context).contiguous(), "final": torch.cat(final).contiguous()}, str(path))
        meta_path.write_text(json.dumps({"count": len(rows), "ids": ids}))
    if bar:
        bar.close()
    return FeatureCache(root)
