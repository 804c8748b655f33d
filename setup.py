"""Builds the optional CUDA extension sglang_dflash._C (csrc/) when nvcc and a CUDA-enabled torch
are present; everything else is in pyproject.toml. The package works without the extension
(plain-torch twins). SGLANG_DFLASH_BUILD_CUDA=0 skips it, =1 makes a missing toolchain an error.
TORCH_CUDA_ARCH_LIST picks the GPU architectures (default: A100, H100/H200, B200, PTX beyond)."""

import os
import shutil

from setuptools import setup


def cuda_extension():
    want = os.environ.get("SGLANG_DFLASH_BUILD_CUDA", "auto")
    if want == "0":
        return {}
    if "CUDA_HOME" not in os.environ and os.path.isfile("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"  # before torch looks for it
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as e:
        reason = f"torch is not importable ({e})"
    else:
        nvcc = CUDA_HOME and shutil.which(os.path.join(CUDA_HOME, "bin", "nvcc"))
        if torch.version.cuda and nvcc:
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0;10.0+PTX")
            ext = CUDAExtension("sglang_dflash._C", ["csrc/dflash_kernels.cu"],
                                extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math"]})
            return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}
        reason = "torch has no CUDA" if not torch.version.cuda else "nvcc not found"
    if want == "1":
        raise SystemExit(f"SGLANG_DFLASH_BUILD_CUDA=1 but the CUDA extension cannot be built: {reason}")
    print(f"sglang-dflash: not building the CUDA extension ({reason}); the plain-torch twins will be used")
    return {}


setup(**cuda_extension())
