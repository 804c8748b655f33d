"""The `sglang-dflash` command: serve, doctor, prepare-target, demo."""

from __future__ import annotations

import argparse
import os
import sys


def cmd_serve(argv: list[str]) -> int:
    """Run `python -m sglang.launch_server ARGS`, prepared for this machine (CPU engine when there is no GPU)."""
    from sglang_dflash.cpu.runtime import cpu_server_env, gpu_present

    env = dict(os.environ)
    if not gpu_present():
        argv, env = cpu_server_env(argv, env)
    cmd = [sys.executable, "-m", "sglang.launch_server", *argv]
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


def cmd_doctor(_args) -> int:
    import importlib.metadata as md

    from sglang_dflash import __version__
    from sglang_dflash.cpu.runtime import gpu_present, libcuda_stub_dir

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    gpu = gpu_present()
    print(f"sglang-dflash   {__version__}")
    print(f"python          {sys.version.split()[0]} ({sys.executable})")
    for dist in ("torch", "sglang", "transformers", "sglang-kernel", "flashinfer-python", "triton"):
        print(f"{dist:<15} {version(dist)}")
    print(f"mode            {'GPU (NVIDIA driver found)' if gpu else 'CPU (no NVIDIA driver or device)'}")
    if not gpu:
        stub = libcuda_stub_dir(build=False)
        print(f"cpu runtime     SGLANG_USE_CPU_ENGINE set by `sglang-dflash serve`; "
              f"libcuda.so.1 stand-in {'built at ' + str(stub) if stub else 'not built yet (built on first serve)'}")
    print("csrc extension  not built (no kernels yet: the plain-torch paths are used)")
    plugins = [ep.value for ep in md.entry_points(group="sglang.srt.plugins") if ep.value.startswith("sglang_dflash")]
    print(f"sglang plugin   {plugins[0] if plugins else 'NOT registered (reinstall the package)'}")
    return 0


def cmd_prepare_target(args) -> int:
    from sglang_dflash.targets import prepare_target

    print(prepare_target(args.name, args.out))
    return 0


def cmd_demo(args) -> int:
    from sglang_dflash.demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # everything after `serve` belongs to launch_server
        return cmd_serve(argv[1:])
    parser = argparse.ArgumentParser(prog="sglang-dflash", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="launch an SGLang server (any launch_server arguments), CPU-ready")
    sub.add_parser("doctor", help="print what this environment has").set_defaults(func=cmd_doctor)
    p = sub.add_parser("prepare-target", help="build an offline target model folder")
    p.add_argument("name", choices=["smollm2", "tiny-qwen3"])
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_prepare_target)
    p = sub.add_parser("demo", help="speculative generation on SmolLM2 (Transformers backend)")
    p.add_argument("--out", default=None, help="where to keep the target model (default: the cache)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.set_defaults(func=cmd_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
