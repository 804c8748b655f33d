"""What `sglang-dflash serve ARGS` does with its arguments before it starts any server process, for many
argument lists in one interpreter: `python tests/launch_refusals.py` reads a JSON list of argument lists on
stdin and writes, for each, null (the arguments resolve: the server would start) or the error that stops the
launch ("ValueError: …"), as a JSON list on stdout.

The same steps as `sglang-dflash serve` (cli.cmd_serve: serve_setup's arguments, then
`python -m sglang.launch_server`, whose __main__ loads the plugins, parses the arguments and resolves them
in run_server before anything is spawned), so a refusal raised there is the one a launch would stop with.
Run with the environment `sglang-dflash serve` gives launch_server (cpu/runtime.py: serve_setup)."""

from __future__ import annotations

import json
import sys


def main() -> None:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    from sglang_dflash.cpu.runtime import serve_setup

    load_plugins()
    results = []
    for argv in json.load(sys.stdin):
        argv, _ = serve_setup(argv)
        try:
            prepare_server_args(argv).resolve_once()
            results.append(None)
        except Exception as e:  # noqa: BLE001  (every error a launch would stop with)
            results.append(f"{type(e).__name__}: {e}")
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
