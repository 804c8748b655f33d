import ctypes
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
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    argv, env = cpu_server_env(["--tp", "2", "--device", "cpu"], {})
    assert argv.count("--device") == 1
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    assert not os.path.exists(env["SGLANG_NCCL_SO_PATH"])
    _, env1 = cpu_server_env(["--tp-size=1"], {})
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in env1
