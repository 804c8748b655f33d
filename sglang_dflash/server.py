"""Start a real SGLang server (through `sglang-dflash serve`, so CPU-ready) and talk to it over HTTP.

Used by the tests, the training data generator and the benchmark's --launch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str, n: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


@contextlib.contextmanager
def sglang_server(model_path, *args: str, env: dict | None = None, timeout: float = 300, log_path: str | None = None):
    """Yields the base URL of a server for model_path; extra args go to launch_server, env adds variables.

    The server's output goes to log_path (a temporary file, removed afterwards, when None); when the body
    raises, the log's tail is printed to stderr.
    """
    port = free_port()
    log = open(log_path, "w+") if log_path else tempfile.NamedTemporaryFile(
        "w+", prefix="sglang-server-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "sglang_dflash.cli", "serve", "--model-path", str(model_path),
           "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready; log:\n{tail(log.name)}")
            if time.time() > deadline:
                raise RuntimeError(f"server not ready after {timeout:.0f} s; log:\n{tail(log.name)}")
            try:
                if requests.get(url + "/health_generate", timeout=30).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        try:
            yield url
        except BaseException:  # a failed or timed-out caller shows what the server said
            print(f"--- tail of the server log ({' '.join(args)}):\n{tail(log.name, 80)}", file=sys.stderr)
            raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        if not log_path:
            os.unlink(log.name)


def generate(url: str, input_ids: list[int], timeout: float = 600, **sampling) -> dict:
    """POST /generate for one tokenized prompt -> SGLang's JSON answer (output_ids, text, meta_info)."""
    r = requests.post(url + "/generate", json={"input_ids": input_ids, "sampling_params": sampling}, timeout=timeout)
    r.raise_for_status()
    return r.json()
