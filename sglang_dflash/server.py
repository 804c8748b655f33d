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


class Server:
    """An SGLang server process for model_path, started at construction: extra args go to launch_server,
    env adds variables. `ready()` waits until it serves and gives its base URL; `stop()` ends it.

    Its output goes to log_path (a temporary file, removed when it stops, when None). Starting several
    before waiting for any lets their start-ups (imports, mostly one core each) overlap.
    """

    def __init__(self, model_path, *args: str, env: dict | None = None, timeout: float = 300,
                 log_path: str | None = None):
        self.args, self.timeout, self.log_path = args, timeout, log_path
        port = free_port()
        self.log = open(log_path, "w+") if log_path else tempfile.NamedTemporaryFile(
            "w+", prefix="sglang-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "sglang_dflash.cli", "serve", "--model-path", str(model_path),
               "--host", "127.0.0.1", "--port", str(port), *args]
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        self.url = f"http://127.0.0.1:{port}"
        self.serving = False

    def ready(self) -> str:
        """The base URL, once /health_generate answers; an error with the log's tail if the process exits
        first or timeout seconds pass from its start."""
        deadline = self.started + self.timeout
        while not self.serving:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready; "
                                   f"log:\n{tail(self.log.name)}")
            try:  # asked before the deadline is: one started long ago may have been serving all along
                self.serving = requests.get(self.url + "/health_generate", timeout=30).status_code == 200
            except requests.RequestException:
                pass
            if not self.serving:
                if time.time() > deadline:
                    raise RuntimeError(f"server not ready after {self.timeout:.0f} s; log:\n{tail(self.log.name)}")
                time.sleep(0.5)
        return self.url

    def print_log_tail(self) -> None:
        print(f"--- tail of the server log ({' '.join(self.args)}):\n{tail(self.log.name, 80)}", file=sys.stderr)

    def stop(self) -> None:
        """Ends the server's processes. SIGTERM to its process group ends the scheduler and the detokenizer at
        once; the launcher then takes their exit for a crash and sleeps 5 s for crash diagnostics before it
        exits (and a SIGTERM to the launcher alone drains for as long), so what is left after a second is
        killed: a server stopped on purpose has nothing to diagnose."""
        if self.log.closed:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # the group's leftovers, the launcher's helpers included
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()
        if not self.log_path:
            os.unlink(self.log.name)


@contextlib.contextmanager
def sglang_server(model_path, *args: str, env: dict | None = None, timeout: float = 300, log_path: str | None = None):
    """Yields the base URL of a Server (see there) once it serves, and stops it afterwards; when the body
    raises, the log's tail is printed to stderr."""
    server = Server(model_path, *args, env=env, timeout=timeout, log_path=log_path)
    with serving(server) as url:
        yield url


@contextlib.contextmanager
def serving(server: Server):
    """Yields a started Server's URL once it serves; stops it afterwards, its log's tail printed to stderr
    when the body raises."""
    try:
        url = server.ready()
        try:
            yield url
        except BaseException:  # a failed or timed-out caller shows what the server said
            server.print_log_tail()
            raise
    finally:
        server.stop()


def generate(url: str, input_ids: list[int], timeout: float = 600, **sampling) -> dict:
    """POST /generate for one tokenized prompt -> SGLang's JSON answer (output_ids, text, meta_info)."""
    r = requests.post(url + "/generate", json={"input_ids": input_ids, "sampling_params": sampling}, timeout=timeout)
    r.raise_for_status()
    return r.json()
