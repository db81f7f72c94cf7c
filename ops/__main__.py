"""Environment report: which fused-op backends are available here, and why not.

Run `python -m gigatron.ops` (add `--build` to trigger the JIT kernel build now).
"""
import argparse
import shutil

import torch

from gigatron.ops import backend
from gigatron.ops.apex_backend import load_apex
from gigatron.ops.build import CSRC, load_kernels, toolchain_problem


def report(build: bool) -> str:
    """The report as text; builds the kernels only when asked (a first build takes minutes)."""
    lines = [f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
             f"GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}",
             f"nvcc: {shutil.which('nvcc') or 'not on PATH'}; kernel sources: {CSRC}",
             f"{backend.ENV_VAR}={backend.requested_backend()} (auto|kernel|apex|torch)"]
    problem = toolchain_problem()
    if build:
        module, note = load_kernels()
        lines.append(f"kernel: {'available' if module else 'unavailable'} - {note}")
    elif problem is not None:
        lines.append(f"kernel: unavailable - {problem}")
    else:
        lines.append("kernel: toolchain present; built on first use (or now with --build)")
    apex, note = load_apex()
    lines.append(f"apex:   {'available (norms only)' if apex else 'unavailable'} - {note}")
    lines.append("torch:  always available (reference math, fp32 compute)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.empty(1, 1, 1, 8, device=device, dtype=torch.bfloat16)
    w = torch.empty(8, device=device, dtype=torch.bfloat16)
    lines.append(f"choice for a bf16 {device} input (kernel only if already built or --build):")
    for op in backend.OPS:
        arg = x if "masked" in op else x.view(1, 8)
        if op.startswith("scaled_upper"):
            arg = x.view(1, 1, 8)
        try:
            if not build and problem is None:
                choice = "kernel (built on first use), else the fallback"
            else:
                choice = backend.chosen_backend(op, arg, None if "softmax" in op else w)
        except ValueError as exc:
            choice = f"error: {exc}"
        lines.append(f"  {op:36s} -> {choice}")
    return "\n".join(lines)


def main() -> None:
    """Print the report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--build", action="store_true", help="build/load the kernels now")
    print(report(parser.parse_args().build))


if __name__ == "__main__":
    main()
