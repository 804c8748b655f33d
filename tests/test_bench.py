"""The benchmark's bookkeeping without servers: prompt formats, the side-by-side verdict, table, plots.
(tests/test_worker_server.py runs it against live servers.)"""

from __future__ import annotations

import json

import pytest

from sglang_dflash import bench

pytestmark = pytest.mark.unit


def _run(concurrency, tok_s, outputs, tau=None, hist=None):
    per = [{"tokens": len(o), "verify_steps": 4, "tau": tau, "ttft_s": 0.1, "tpot_s": 0.01, "latency_s": 1.0}
           for o in outputs]
    run = {"concurrency": concurrency, "tok_per_s": tok_s, "tau": tau, "output_ids": outputs, "per_request": per}
    if hist:
        run["accept_length_histogram"] = hist
        steps = sum(hist)
        run["accept_rate_by_row"] = [sum(hist[k + 1:]) / steps for k in range(1, len(hist) - 1)]
    return run


def test_side_by_side_verdict_table_and_plots(tmp_path):
    same, other = [[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]
    base = [_run(1, 10.0, same), _run(4, 30.0, same)]
    spec = [_run(1, 25.0, same, 2.5, [0, 5, 3, 2]), _run(4, 45.0, other, 2.5, [0, 5, 3, 2])]
    rows = [bench.side_by_side(b, d) for b, d in zip(base, spec)]
    assert rows[0]["speedup"] == pytest.approx(2.5) and rows[0]["identical"]
    assert not rows[1]["identical"] and rows[1]["differing_requests"] == [1]
    results = {"baseline": {"gsm8k": base}, "dflash": {"gsm8k": spec}, "side_by_side": {"gsm8k": rows}}
    table = bench.markdown(results)
    assert "| gsm8k | 1 | 10.0 | 25.0 | 2.50× | 2.50 | yes |" in table and "NO (1 differ)" in table
    for path in bench.plots(results, tmp_path):
        assert path.read_bytes()[:4] == b"\x89PNG"
    assert spec[0]["accept_rate_by_row"] == [0.5, 0.2]  # row k accepted when a step commits more than k tokens


def test_bf16_differences_must_fall_on_near_ties(monkeypatch):
    """A differing greedy output is judged at its first differing token by the baseline server's own top
    candidates there: in float32 any difference fails; in another dtype only one at a near tie passes."""
    asked = []

    def baseline_server(url, json, timeout):  # the baseline's 5 best after prompt + common prefix
        asked.append(json["input_ids"])
        last = json["input_ids"][-1]
        top = [[-0.1, 7, None], [-0.3, 8, None], [-2.0, 9, None]] if last == 5 else [[-0.1, 7, None], [-1.5, 8, None]]
        return type("R", (), {"raise_for_status": lambda self: None,
                              "json": lambda self: {"meta_info": {"output_top_logprobs": [top]}}})()

    monkeypatch.setattr(bench.requests, "post", baseline_server)
    tie = bench.divergence("u", [1, 2], [5, 7, 3], [5, 8, 4])  # parts at token 1: 8 is 0.2 behind 7, top-2 gap 0.2
    assert tie == {"token": 1, "gap": 0.2, "behind": 0.2, "near_tie": True} and asked == [[1, 2, 5]]
    assert bench.divergence("u", [1, 2], [6, 7], [6, 9])["near_tie"] is False  # gap 1.4: not a tie
    assert bench.divergence("u", [1, 2], [5, 7], [5, 9]) == {"token": 1, "gap": 0.2, "behind": 1.9, "near_tie": False}
    assert bench.divergence("u", [1, 2], [5, 7], [5, 7, 4])["behind"] is None  # the shorter ends: judged where
    assert bench.divergence("u", [1], [3], [3]) is None and len(asked) == 4

    same, other = [[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]
    base, spec = _run(1, 10.0, same), _run(1, 12.0, other)
    at_tie, not_tie = {1: {"token": 1, "near_tie": True}}, {1: {"token": 1, "near_tie": False}}
    rows = [bench.side_by_side(base, spec, at_tie, strict=False), bench.side_by_side(base, spec, at_tie, strict=True),
            bench.side_by_side(base, spec, not_tie, strict=False), bench.side_by_side(base, base, {}, strict=True)]
    assert [r["lossless"] for r in rows] == [True, False, False, True]
    assert [bench.verdict(r) for r in rows] == ["yes (1 differ, all at near ties)", "NO (1 differ, 1 at near ties)",
                                                "NO (1 differ)", "yes"]


def test_prompt_formats_and_local_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "a", "prompt": "2+2?"}) + "\n" + json.dumps({"turns": ["hi", "more"]}) + "\n")
    gsm = bench.load_prompts("gsm8k", 5, str(f))
    assert gsm[0] == {"id": "a", "prompt": "2+2?\nPlease reason step by step, and put your final answer within \\boxed{}."}
    assert bench.load_prompts("mt-bench", 5, str(f))[1]["prompt"] == "hi"  # the first turn
    assert bench.load_prompts("humaneval", 1, str(f))[0]["prompt"].startswith(
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n2+2?")
    with pytest.raises(ValueError, match="unknown dataset"):
        bench.load_prompts("nope", 1, str(f))


def test_shipped_subsets_load_without_reaching_for_the_network(monkeypatch):
    """bench reads the shipped subsets without trying the network (the same prompts on any machine): every
    way out of this process fails here, and the hub is read only when asked for (--from-hub)."""
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError(f"bench tried the network: {args[:2]}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("gsm8k", "humaneval", "mt-bench"):
        rows = bench.load_prompts(name, 24)
        assert len(rows) == 24 and all(r["prompt"] for r in rows)
        assert rows == [{"id": r["id"], "prompt": bench.DATASETS[name][3].format(r["prompt"])}
                        for r in bench.read_prompts(bench.REPO_DATA / f"{name}.jsonl")[:24]]
    with pytest.raises(FileNotFoundError, match="math500.*--from-hub"):
        bench.load_prompts("math500", 4)


def test_asking_for_more_prompts_than_a_set_has_is_said(caplog):
    with caplog.at_level("WARNING", logger="sglang_dflash.bench"):
        assert len(bench.load_prompts("gsm8k", 64)) == 24
    assert "dataset gsm8k has 24 prompts, fewer than the 64 asked for: all 24 run (benchmarks/data/ ships" in caplog.text


def test_greedy_outputs_must_be_identical_in_float32_by_either_name(caplog):
    assert bench.strict_for("float32") and bench.strict_for("float")
    assert not bench.strict_for("bfloat16") and not caplog.text
    with caplog.at_level("WARNING", logger="sglang_dflash.bench"):
        assert not bench.strict_for("auto")
    assert "--dtype auto" in caplog.text


def test_sharegpt_is_the_heldout_split():
    """bench's sharegpt set is the held-out split's first turns, which no training run may use."""
    from sglang_dflash.train.sources import SHAREGPT_HELDOUT, load_source

    rows = bench.load_prompts("sharegpt", 64)
    assert len(rows) == 64 and [r["id"] for r in rows] == [r["id"] for r in load_source(SHAREGPT_HELDOUT, 64)]


def test_stats_file_figures_and_step_profile():
    """The worker's stats file before and after a run -> histogram, per-row acceptance, ms per decode batch."""
    before = {"accept_length_histogram": [0, 2, 1, 0], "decode_batches": 3,
              "phase_seconds": {"build_block": 0.01, "draft": 0.2, "verify": 0.5, "accept": 0.02, "commit": 0.05}}
    after = {"accept_length_histogram": [0, 4, 4, 2], "decode_batches": 7,
             "phase_seconds": {"build_block": 0.05, "draft": 0.6, "verify": 1.7, "accept": 0.06, "commit": 0.13}}
    fig = bench.stats_figures(before, after, wall=3.0)
    assert fig["accept_length_histogram"] == [0, 2, 3, 2] and fig["decode_batches"] == 4
    assert fig["accept_rate_by_row"] == pytest.approx([5 / 7, 2 / 7])
    ms = fig["step_ms"]
    assert ms["draft"] == pytest.approx(100.0) and ms["verify"] == pytest.approx(300.0)
    assert ms["rest"] == pytest.approx((3.0 - 1.76) / 4 * 1e3)  # the phases took 1.76 s of the 3 s
    run = {"concurrency": 4, **fig}
    table = bench.markdown({"side_by_side": {}, "dflash": {"gsm8k": [run]}})
    assert "| gsm8k | 4 | 4 | 10.0 | 100.0 | 300.0 | 10.0 | 20.0 | 310.0 |" in table
    # a server that counts without profiling (the default): the counts, no step profile
    plain = bench.stats_figures({k: v for k, v in before.items() if k != "phase_seconds"},
                                {k: v for k, v in after.items() if k != "phase_seconds"}, wall=3.0)
    assert plain["decode_batches"] == 4 and plain["accept_length_histogram"] == [0, 2, 3, 2] and "step_ms" not in plain
    # a server with an adaptive window: each row's acceptance over the steps whose window reached it, not over
    # the 1-row steps that verified no draft
    windowed = lambda hist4, plain1: {"accept_length_histogram": [0, plain1 + hist4[1], *hist4[2:]],  # noqa: E731
                                      "accept_length_histogram_by_window": [[0] * 4, [0, plain1, 0, 0], [0] * 4,
                                                                            hist4]}
    fig = bench.stats_figures(windowed([0, 2, 1, 0], 5), windowed([0, 4, 4, 2], 50), wall=3.0)
    assert fig["accept_length_histogram"] == [0, 47, 3, 2]
    assert fig["accept_rate_by_row"] == pytest.approx([5 / 7, 2 / 7])  # the 45 plain steps left out


def test_every_bench_setting_is_a_flag_with_the_config_default():
    """`sglang-dflash bench` fills a BenchConfig from its flags: one flag per field, the same defaults."""
    import argparse
    import dataclasses

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args([])
    assert vars(args).keys() == {f.name for f in dataclasses.fields(bench.BenchConfig)}
    assert bench.BenchConfig.from_args(args) == bench.BenchConfig()
    cfg = bench.BenchConfig.from_args(p.parse_args(["--concurrency", "2,8", "--datasets", "sharegpt", "--from-hub"]))
    assert cfg.concurrency == [2, 8] and cfg.datasets == ["sharegpt"] and cfg.from_hub


def test_near_tie_rule():
    """A bf16 divergence is allowed where the baseline's top two are less than NEAR_TIE apart and DFLASH's token
    is one of the tied (within NEAR_TIE of the top); not where it is not among the candidates or had ended."""
    top = [(-0.60, 7, "a"), (-0.85, 9, "b"), (-1.05, 4, "c"), (-3.0, 1, "d")]
    assert bench.near_tie(top, 9) == {"gap": 0.25, "behind": 0.25, "near_tie": True}
    assert bench.near_tie(top, 4) == {"gap": 0.25, "behind": 0.45, "near_tie": True}  # a tie of three
    assert not bench.near_tie(top, 1)["near_tie"]  # behind by 2.4
    assert bench.near_tie(top, 5) == {"gap": 0.25, "behind": None, "near_tie": False}  # not a candidate
    assert not bench.near_tie(top, None)["near_tie"]  # DFLASH's output had ended there
    assert not bench.near_tie([(-0.1, 7, "a"), (-0.7, 9, "b")], 9)["near_tie"]  # a gap of 0.6: no tie
