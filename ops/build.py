"""Find the compiled kernels: the extension setup.py built, else a just-in-time ninja build.

The JIT build compiles csrc/ for the GPUs present (or TORCH_CUDA_ARCH_LIST) into torch's
extension cache, so only the first use in a fresh environment pays the build.
"""
import functools
import os
from pathlib import Path
from types import ModuleType
from typing import List, Optional, Tuple

import torch

# csrc/ sits next to ops/ both in a checkout (csrc/, ops/) and in an installed wheel
# (gigatron/csrc, gigatron/ops: setup.py ships it as package data).
CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = ("binding.cpp", "softmax.cu", "norms.cu")
JIT_NAME = "gigatron_fused_kernels"
PREBUILT = "gigatron.ops._fused_kernels"


def source_files() -> List[Path]:
    """The kernel sources, binding first (the only file that includes torch headers)."""
    return [CSRC / name for name in SOURCES]


def toolchain_problem() -> Optional[str]:
    """Why a JIT build cannot run here, or None when torch, a GPU, nvcc and ninja are all present."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "nvcc not found: install the CUDA toolkit and set CUDA_HOME or put nvcc on PATH"
    if not cpp_extension.is_ninja_available():
        return "ninja not found: pip install ninja"
    missing = [str(p) for p in source_files() if not p.is_file()]
    if missing:
        return (f"kernel sources missing ({', '.join(missing)}): reinstall gigatron "
                f"(the wheel ships them as gigatron/csrc)")
    return None


@functools.lru_cache(maxsize=None)
def load_kernels() -> Tuple[Optional[ModuleType], str]:
    """(module, how it was found) or (None, why not); the result is cached per process."""
    try:
        import importlib

        return importlib.import_module(PREBUILT), "prebuilt by setup.py (GIGATRON_BUILD_CUDA=1)"
    except ImportError:
        pass
    problem = toolchain_problem()
    if problem is not None:
        return None, problem
    if os.environ.get("GIGATRON_JIT", "1") == "0":
        return None, "not prebuilt and the JIT build is disabled (GIGATRON_JIT=0)"
    from torch.utils import cpp_extension

    try:
        module = cpp_extension.load(
            name=JIT_NAME,
            sources=[str(p) for p in source_files()],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo"],
            extra_include_paths=[str(CSRC)],
            verbose=os.environ.get("GIGATRON_BUILD_VERBOSE") == "1",
        )
    except Exception as exc:  # a failed build must fall back, not crash training
        return None, f"JIT build failed ({type(exc).__name__}: {exc}); GIGATRON_BUILD_VERBOSE=1 shows the log"
    return module, "built just in time with ninja (cached in torch's extension directory)"
