"""What a machine with no GPU needs before SGLang's CPU engine can start.

Facts behind each item are in the project's notes on SGLang 0.5.23 on CPU:
  1. SGLANG_USE_CPU_ENGINE=1, or `--device cpu` is not treated as the CPU engine;
  2. a libcuda.so.1 stand-in on LD_LIBRARY_PATH, or `import sgl_kernel` fails;
  3. for --tp N: one core set per rank (SGLANG_CPU_OMP_THREADS_BIND) and no NCCL
     (SGLANG_NCCL_SO_PATH pointing nowhere), so ranks talk over gloo.
LD_LIBRARY_PATH is read when a process starts, so these settings are applied
to a new process (see `cpu_server_env`), never patched into a running one.

And, on any machine, for the CPU's float32 products: oneMKL's MKL_CBWR (`mkl_mode`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path

STUB_SOURCE = "libcuda_stub.c"


def cache_dir() -> Path:
    from sglang_dflash.settings import settings

    return settings().home


def gpu_present() -> bool:
    """True when a real NVIDIA driver answers with at least one device."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    if lib.cuInit(0) != 0:
        return False
    count = ctypes.c_int(0)
    return lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def libcuda_stub_dir(build: bool = True) -> Path | None:
    """The folder holding the built stand-in `libcuda.so.1` (built on first use).

    The build is keyed by the hash of the C source, so an edited source is rebuilt.
    Returns None when build=False and it has not been built yet.
    """
    source = resources.files("sglang_dflash.cpu").joinpath(STUB_SOURCE).read_bytes()
    out_dir = cache_dir() / "libcuda-stub" / hashlib.sha256(source).hexdigest()[:12]
    lib = out_dir / "libcuda.so.1"
    if lib.exists():
        return out_dir
    if not build:
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) found: it is needed to build the libcuda.so.1 stand-in")
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / STUB_SOURCE
    src.write_bytes(source)
    tmp = out_dir / f"libcuda.so.1.{os.getpid()}"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(src)], check=True)
    tmp.replace(lib)
    return out_dir


# oneMKL's conditional numerical reproducibility mode, set by the CLI for itself and every process it starts
# (cli.main) unless the caller set it. Unset (CNR off), MKL's float32 products of a few rows take a slower
# path: measured on a 2-core AMD EPYC (Zen 4, AVX-512) with torch 2.14's MKL 2024.2, SmolLM2-135M's linear
# layers and lm_head per forward, weights cycled through memory (ms; F.linear, i.e. x @ Wᵀ):
#
#     rows            1     2     4     8    16    64   256
#     unset          43    78    79    57    68   133   440
#     MKL_CBWR=AUTO  45    40    35    40    52   127   413
#
# SGLang's float32 decode of the tests' 40 prompts at concurrency 16 took 58.0 s against 73.7 s unset; a
# Transformers forward of 8 tokens 55 against 92 ms. AUTO is MKL's own choice of code path for the CPU; only
# the order of float32 additions changes, as it does between any two product kernels (cpu/gemm.py).
MKL_MODE = ("MKL_CBWR", "AUTO")


def mkl_mode(env) -> str | None:
    """Sets MKL_CBWR=AUTO in env (os.environ: before the process's first product, when MKL reads it) unless
    it is set; returns the line that says so, or None when the caller's value stands."""
    name, value = MKL_MODE
    if name in env:
        return None
    env[name] = value
    return (f"sglang-dflash: {name}={value} (oneMKL picks its code path for this CPU: float32 products of a few rows "
            f"run up to twice as fast; set {name} to choose otherwise)")


def _tp_size(argv: list[str]) -> int:
    for i, arg in enumerate(argv):
        for flag in ("--tp-size", "--tp", "--tensor-parallel-size"):
            if arg == flag and i + 1 < len(argv):
                return int(argv[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return 1


def _has_flag(argv: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def serve_setup(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """What `sglang-dflash serve ARGS` hands launch_server: on a machine without a GPU the CPU engine's
    arguments and environment (cpu_server_env), else the arguments and this process's environment unchanged."""
    if gpu_present():
        return list(argv), dict(os.environ)
    return cpu_server_env(argv)


def cpu_server_env(argv: list[str], env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The launch_server arguments and environment for SGLang's CPU engine.

    Adds `--device cpu` unless a device is given, and `--sleep-on-idle` (an idle SGLang
    scheduler otherwise polls at 100% of a core, which starves every other process on a
    small CPU machine); with --tp N splits this machine's cores into N groups, one per
    rank. The caller's own settings always win.
    """
    env = dict(os.environ if env is None else env)
    argv = list(argv)
    env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    stub = str(libcuda_stub_dir())
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (stub, env.get("LD_LIBRARY_PATH", "")) if p)
    if not _has_flag(argv, "--device"):
        argv += ["--device", "cpu"]
    if not _has_flag(argv, "--sleep-on-idle"):
        argv += ["--sleep-on-idle"]
    tp = _tp_size(argv)
    if tp > 1:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < tp:
            raise RuntimeError(f"--tp {tp} needs at least {tp} CPU cores, this machine offers {len(cores)}")
        per = len(cores) // tp
        groups = [cores[r * per:(r + 1) * per] for r in range(tp)]
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, g)) for g in groups))
        env.setdefault("SGLANG_NCCL_SO_PATH", str(cache_dir() / "no-nccl-on-cpu.so"))
    return argv, env
