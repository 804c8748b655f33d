import ctypes
import os
import subprocess
import sys

import pytest

from sglang_dflash.cpu.runtime import cpu_server_env, libcuda_stub_dir


@pytest.mark.process  # compiles the stub with the C compiler when it is not cached
def test_libcuda_stub_builds_and_says_no_device():
    lib = ctypes.CDLL(str(libcuda_stub_dir() / "libcuda.so.1"))
    assert lib.cuInit(0) == 100  # CUDA_ERROR_NO_DEVICE
    count = ctypes.c_int(7)
    assert lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value == 0
    assert hasattr(lib, "cuPointerGetAttribute")


@pytest.mark.process
def test_sgl_kernel_imports_with_the_cpu_env():
    argv, env = cpu_server_env(["--model-path", "x"], {"PATH": "/usr/bin:/bin"})
    assert argv[argv.index("--device") + 1] == "cpu" and env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert "--sleep-on-idle" in argv  # an idle scheduler would otherwise spin a whole core
    r = subprocess.run([sys.executable, "-c", "import sgl_kernel"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.unit
def test_tp_settings_split_cores_and_disable_nccl(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    argv, env = cpu_server_env(["--tp", "2", "--device", "cpu"], {})
    assert argv.count("--device") == 1
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    assert not os.path.exists(env["SGLANG_NCCL_SO_PATH"])
    _, env1 = cpu_server_env(["--tp-size=1"], {})
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in env1


@pytest.mark.unit
def test_mkl_mode_is_set_unless_the_caller_chose():
    from sglang_dflash.cpu.runtime import mkl_mode

    env = {}
    assert "MKL_CBWR=AUTO" in mkl_mode(env) and env == {"MKL_CBWR": "AUTO"}
    env = {"MKL_CBWR": "COMPATIBLE"}
    assert mkl_mode(env) is None and env == {"MKL_CBWR": "COMPATIBLE"}


@pytest.mark.process
def test_mkl_mode_takes_effect_when_set_before_the_first_product():
    """MKL reads MKL_CBWR at a process's first product: set by mkl_mode after torch's import, it is the mode
    MKL runs in (MKL_VERBOSE reports it with each call); without it MKL runs with CNR off."""
    import torch

    if not torch.backends.mkl.is_available():
        pytest.skip("this torch has no MKL")
    code = ("import os, torch\nfrom sglang_dflash.cpu.runtime import mkl_mode\n{}\n"
            "torch.nn.functional.linear(torch.randn(2, 64), torch.randn(32, 64))")
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    for line, mode in (("mkl_mode(os.environ)", "CNR:AUTO"), ("", "CNR:OFF")):
        r = subprocess.run([sys.executable, "-c", code.format(line)], env={**env, "MKL_VERBOSE": "1"},
                           capture_output=True, text=True)
        assert r.returncode == 0 and mode in r.stdout, (line, r.stdout[-500:], r.stderr[-500:])
