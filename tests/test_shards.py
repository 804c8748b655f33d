"""train/shards.py: committed response shards in and out of a work folder."""

import gzip
import json

import pytest

from sglang_dflash.train.shards import load_shards, pack_shard

pytestmark = pytest.mark.unit


def row(i):
    return json.dumps({"id": f"p{i}", "prompt_ids": [1, 2], "output_ids": list(range(i))})


def test_pack_then_load_round_trip(tmp_path):
    shards, work = tmp_path / "shards", tmp_path / "work" / "responses.jsonl"
    work.parent.mkdir()
    work.write_text("".join(row(i) + "\n" for i in range(3)))
    path, n, tokens = pack_shard(work, shards)
    assert path.name == "responses-001.jsonl.gz" and (n, tokens) == (3, 0 + 1 + 2)
    first = path.read_bytes()
    assert pack_shard(work, shards) is None  # nothing new
    with open(work, "a") as f:
        f.write(row(3) + "\n\n")
    path2, n2, _ = pack_shard(work, shards)
    assert path2.name == "responses-002.jsonl.gz" and n2 == 1
    assert gzip.decompress(path2.read_bytes()).decode() == row(3) + "\n"

    # a fresh machine: the work file is rebuilt from the shards, in order, and loading twice adds nothing
    fresh = tmp_path / "fresh" / "responses.jsonl"
    assert load_shards(shards, fresh) == 4 and load_shards(shards, fresh) == 0
    assert fresh.read_text() == "".join(row(i) + "\n" for i in range(4))
    # the same bytes for the same rows (no gzip timestamp)
    again = tmp_path / "again"
    work.write_text("".join(row(i) + "\n" for i in range(3)))
    assert pack_shard(work, again)[0].read_bytes() == first


def test_lines_end_at_newlines_only(tmp_path):
    """A response line whose JSON holds U+2028 unescaped (a text field written with ensure_ascii=False) stays
    one line through pack and load."""
    line = json.dumps({"id": "u", "prompt": "a\u2028b\x85c", "prompt_ids": [1], "output_ids": [2]},
                      ensure_ascii=False)
    work, shards = tmp_path / "responses.jsonl", tmp_path / "shards"
    work.write_text(line + "\n", encoding="utf-8")
    assert pack_shard(work, shards)[1:] == (1, 1)
    fresh = tmp_path / "fresh.jsonl"
    assert load_shards(shards, fresh) == 1 and fresh.read_text(encoding="utf-8") == line + "\n"
