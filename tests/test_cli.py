"""The command line's own checks (no command runs here), and the server helper's readiness rule."""

import pytest

from sglang_dflash.cli import main, parse_bool
from sglang_dflash.server import free_port

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


def test_a_server_started_long_ago_is_ready_if_it_serves(tmp_path):
    """Server.ready asks the server before it looks at the clock: one started early (tests/shared_servers.py) and
    first waited for after its start-up timeout has passed is ready if it serves, and not if it does not."""
    import http.server
    import threading
    import time

    from sglang_dflash.server import Server

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health_generate" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    class Running:  # a process that has not exited
        returncode = None

        def poll(self):
            return None

    def started_long_ago(port):
        server = Server.__new__(Server)
        server.proc, server.started, server.timeout, server.serving = Running(), time.time() - 3600, 300, False
        server.url, server.log = f"http://127.0.0.1:{port}", open(tmp_path / "log", "w+")
        return server

    try:
        assert started_long_ago(httpd.server_port).ready() == f"http://127.0.0.1:{httpd.server_port}"
        with pytest.raises(RuntimeError, match="not ready after 300 s"):
            started_long_ago(free_port()).ready()  # nothing listens there
    finally:
        httpd.shutdown()
