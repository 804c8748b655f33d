"""The tests' SGLang servers: sglang_dflash.server with small, fixed memory settings, alone or started
together; the oracle draft's environment; a server's KV slots in use."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import requests

from sglang_dflash.server import Server, generate, serving  # noqa: F401  (generate is re-exported)

ORACLE_PLUGIN = Path(__file__).parent / "oracle_plugin"


# Every test server's memory settings. --max-total-tokens fixes the KV pool (16,384 slots, 0.7 GB for SmolLM2
# in float32) unless a test gives its own. --mem-fraction-static 0.9: on a CPU, SGLang sizes the pool from
# the memory free after loading, less (1 - fraction) of what was free before loading, and refuses to start
# when nothing is left. With 0.3 that reserve was 70 % of the machine, so a server that measured while a
# neighbour was loading found no room (the reliability module's four servers, started together, failed so one
# run in two); with 0.9 it is a tenth, and servers start together.
MEMORY = ("--mem-fraction-static", "0.9", "--max-total-tokens", "16384")


def start_server(model_path, *args: str, env: dict | None = None, timeout: float = 300,
                 log_path: str | None = None) -> Server:
    """A test server's process, started now (sglang_dflash.server.Server): serve it with `serving`."""
    return Server(model_path, *MEMORY, "--log-level", "info", *args, env=env, timeout=timeout, log_path=log_path)


@contextlib.contextmanager
def sglang_server(model_path, *args: str, env: dict | None = None, timeout: float = 300, log_path: str | None = None):
    with serving(start_server(model_path, *args, env=env, timeout=timeout, log_path=log_path)) as url:
        yield url


@contextlib.contextmanager
def sglang_servers(*specs: tuple):
    """Several servers, each spec (model_path, args tuple, env dict or None[, log path]), started together
    (their start-ups overlap: mostly imports, a core each); yields their URLs once all serve."""
    servers = [start_server(model, *args, env=env, log_path=log[0] if log else None)
               for model, args, env, *log in specs]
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.callback(server.stop)  # every one stopped, whichever failed to start
        yield [stack.enter_context(serving(server)) for server in servers]


def oracle_env(sequences: Path) -> dict:
    """A server's environment for tests/oracle_plugin, proposing the continuations in the sequences file."""
    return {"PYTHONPATH": str(ORACLE_PLUGIN), "SGLANG_DFLASH_ORACLE": str(sequences)}


def kv_slots_in_use(url: str, timeout: float = 60) -> int:
    """KV slots held once the server is idle and its radix cache is flushed: 0 unless slots leaked.
    /flush_cache refuses while requests run (aborted ones may still be winding down), so it is
    retried until it succeeds, within the timeout."""
    deadline = time.time() + timeout
    while requests.post(url + "/flush_cache", timeout=60).status_code != 200:
        if time.time() > deadline:
            raise AssertionError(f"the server did not become idle within {timeout:.0f} s")
        time.sleep(0.5)
    return requests.get(url + "/v1/loads", params={"include": "core"}, timeout=60).json()["loads"][0]["num_used_tokens"]
