"""Start a real SGLang server (through `sglang-dflash serve`) for a test, and stop it afterwards."""

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


@contextlib.contextmanager
def sglang_server(model_path, *args: str, env: dict | None = None, timeout: float = 300):
    """Yields the base URL of a server for model_path; extra args go to launch_server, env adds variables."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="sglang-server-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "sglang_dflash.cli", "serve", "--model-path", str(model_path),
           "--host", "127.0.0.1", "--port", str(port), "--mem-fraction-static", "0.3",
           "--max-total-tokens", "16384", "--log-level", "warning", *args]
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
            time.sleep(2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        os.unlink(log.name)


def tail(path: str, n: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def generate(url: str, input_ids: list[int], **sampling) -> dict:
    r = requests.post(url + "/generate", json={"input_ids": input_ids, "sampling_params": sampling}, timeout=600)
    r.raise_for_status()
    return r.json()
