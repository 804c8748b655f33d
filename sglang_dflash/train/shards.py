"""Regenerated responses kept in git as gzip shards (data/smollm2-general/): a work folder does not outlive
its machine, and regenerating takes hours of a CPU. A shard is `responses-NNN.jsonl.gz`, the recipe's
work/responses.jsonl rows ({id, prompt_ids, output_ids}), gzip with no timestamp (the same bytes every time).

    load_shards(shards, work_file)   every committed response the work file lacks, appended to it
    pack_shard(work_file, shards)    the work file's responses no shard holds -> the next shard
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from sglang_dflash.train.data import jsonl_lines

PATTERN = "responses-*.jsonl.gz"


def shard_lines(shards: Path) -> list[str]:
    """Every response line of every shard in shards, in shard order."""
    return [line for f in sorted(Path(shards).glob(PATTERN))
            for line in jsonl_lines(gzip.open(f, "rt", encoding="utf-8").read())]


def _ids(lines: list[str]) -> set[str]:
    return {json.loads(line)["id"] for line in lines}


def load_shards(shards: Path, work_file: Path) -> int:
    """Append to work_file (created if missing) every committed response it lacks -> how many were added."""
    work_file = Path(work_file)
    work_file.parent.mkdir(parents=True, exist_ok=True)
    have = _ids(jsonl_lines(work_file.read_text(encoding="utf-8"))) if work_file.exists() else set()
    new = [line for line in shard_lines(shards) if json.loads(line)["id"] not in have]
    with open(work_file, "a", encoding="utf-8") as out:
        out.write("".join(line + "\n" for line in new))
    return len(new)


def pack_shard(work_file: Path, shards: Path) -> tuple[Path, int, int] | None:
    """The responses of work_file that no shard holds, written as the next shard -> (its path, responses,
    response tokens); None when there are none."""
    shards = Path(shards)
    shards.mkdir(parents=True, exist_ok=True)
    have = _ids(shard_lines(shards))
    lines = jsonl_lines(Path(work_file).read_text(encoding="utf-8"))
    new = [line for line in lines if json.loads(line)["id"] not in have]
    if not new:
        return None
    out = shards / f"responses-{len(list(shards.glob(PATTERN))) + 1:03d}.jsonl.gz"
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(("\n".join(new) + "\n").encode("utf-8"))
    return out, len(new), sum(len(json.loads(line)["output_ids"]) for line in new)


def main(argv: list[str] | None = None) -> int:
    """python -m sglang_dflash.train.shards load|pack SHARDS WORK_FILE (launch/train-smollm2-general.sh)."""
    import sys

    cmd, shards, work_file = (sys.argv[1:] if argv is None else argv)
    if cmd == "load":
        print(f"shards: {load_shards(Path(shards), Path(work_file))} committed responses loaded into {work_file}")
    elif cmd == "pack":
        packed = pack_shard(Path(work_file), Path(shards))
        print(f"shards: no new responses in {work_file}" if packed is None else
              f"shards: {packed[0]}: {packed[1]} responses, {packed[2]} response tokens, {packed[0].stat().st_size} bytes")
    else:
        raise SystemExit(f"unknown command {cmd!r}: load or pack")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
