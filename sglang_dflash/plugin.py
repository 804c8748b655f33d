"""SGLang plugin entry point (group `sglang.srt.plugins`).

SGLang calls `register()` in every process it starts (launch_server, Engine,
schedulers, TP ranks). Taking over `--speculative-algorithm DFLASH` with this
package's worker is the worker issue's job; until then the plugin only logs
that it loaded, so a server shows which package version it runs beside.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("sglang_dflash")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from sglang_dflash import __version__

    logger.info("sglang-dflash %s plugin loaded in pid %d (DFLASH worker: SGLang builtin for now)",
                __version__, os.getpid())
