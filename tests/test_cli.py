"""The command line's own checks (no command runs here)."""

import pytest

from sglang_dflash.cli import main, parse_bool

pytestmark = pytest.mark.unit


def test_boolean_flags_refuse_what_is_not_a_boolean(capsys):
    assert [parse_bool(s) for s in ("1", "true", "Yes", "0", "FALSE", "no")] == [True, True, True, False, False, False]
    with pytest.raises(SystemExit) as e:  # argparse stops before any work: a typo is not False
        main(["train", "--target", "t", "--prompts", "p.jsonl", "--out", "o", "--keep-best", "treu"])
    assert e.value.code == 2 and "'treu' is not a boolean" in capsys.readouterr().err


def test_demo_runs_the_benchmark_with_the_shipped_draft(monkeypatch, tmp_path, capsys, smollm2_path):
    """`sglang-dflash demo` is bench --launch with small settings: the shipped draft, the server's default
    (adaptive) window, greedy, bfloat16 as users serve; a --draft that is no draft stops it with a message."""
    from sglang_dflash import bench, demo

    seen, lossless = [], [True]

    def fake_bench(cfg):
        seen.append(cfg)
        (tmp_path / "results.md").write_text("table\n")
        return {"dflash": {}, "plots": [], "side_by_side": {"gsm8k": [{"identical": lossless[0],
                                                                       "lossless": lossless[0]}]}}

    monkeypatch.setattr(bench, "bench", fake_bench)
    assert main(["demo", "--target", str(smollm2_path), "--out", str(tmp_path)]) == 0
    assert seen == [bench.BenchConfig(launch=True, target=str(smollm2_path), draft=str(demo.DEFAULT_DRAFT),
                                      datasets=["gsm8k", "humaneval", "mt-bench"], num_prompts=4, concurrency=[1, 4],
                                      max_new_tokens=96, dtype="bfloat16", out=str(tmp_path), num_draft_tokens=None)]
    assert "(identical or parting at near ties (bfloat16)): yes" in capsys.readouterr().out
    lossless[0] = False
    assert main(["demo", "--target", str(smollm2_path), "--out", str(tmp_path), "--dtype", "float32",
                 "--num-draft-tokens", "4"]) == 1
    assert seen[-1].dtype == "float32" and seen[-1].num_draft_tokens == 4
    assert "greedy outputs the server's own without speculation (identical): NO" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no draft at"):
        main(["demo", "--target", str(smollm2_path), "--draft", str(tmp_path / "none")])
