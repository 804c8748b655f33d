"""The tests' SGLang servers: sglang_dflash.server with small, fixed memory settings."""

from __future__ import annotations

import contextlib

from sglang_dflash.server import generate, sglang_server as _server  # noqa: F401  (generate is re-exported)


@contextlib.contextmanager
def sglang_server(model_path, *args: str, env: dict | None = None, timeout: float = 300):
    with _server(model_path, "--mem-fraction-static", "0.3", "--max-total-tokens", "16384", "--log-level", "info",
                 *args, env=env, timeout=timeout) as url:
        yield url
