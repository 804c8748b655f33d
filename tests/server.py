"""The tests' SGLang servers: sglang_dflash.server with small, fixed memory settings; the oracle
draft's environment; a server's KV slots in use."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import requests

from sglang_dflash.server import generate, sglang_server as _server  # noqa: F401  (generate is re-exported)

ORACLE_PLUGIN = Path(__file__).parent / "oracle_plugin"


@contextlib.contextmanager
def sglang_server(model_path, *args: str, env: dict | None = None, timeout: float = 300, log_path: str | None = None):
    with _server(model_path, "--mem-fraction-static", "0.3", "--max-total-tokens", "16384", "--log-level", "info",
                 *args, env=env, timeout=timeout, log_path=log_path) as url:
        yield url


@contextlib.contextmanager
def sglang_servers(*specs: tuple):
    """Several servers, each spec (model_path, args tuple, env dict or None[, log path]); yields their URLs.
    They start one after another: SGLang sizes a CPU server's KV pool from the memory free when it
    measures, and a neighbour loading at that moment left one with no room for its pool (started together,
    the reliability module's four servers failed so, one run in two)."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(sglang_server(model, *args, env=env, log_path=log[0] if log else None))
               for model, args, env, *log in specs]


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
