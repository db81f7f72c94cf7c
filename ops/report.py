"""What the fused ops can use here: torch's CUDA build, the GPUs, nvcc, the kernels, Apex.

Each probe returns plain data (dicts of str/bool/number/None, ready for JSON) and never
raises for something missing: a missing piece is reported with the reason. `gigatron
report` prints them; `python -m gigatron.ops` is the older, ops-only view.
"""
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from gigatron.ops import apex_backend, backend, build

# op name -> (what users call it, the binding functions it needs from the extension)
KERNELS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "scaled_masked_softmax": ("scaled masked softmax", ("softmax_forward", "softmax_backward")),
    "scaled_upper_triang_masked_softmax": ("causal softmax", ("softmax_forward", "softmax_backward")),
    "layer_norm": ("LayerNorm", ("norm_forward", "norm_backward")),
    "rms_norm": ("RMSNorm", ("norm_forward", "norm_backward")),
}
NOT_PREBUILT = "not prebuilt (pip install with GIGATRON_BUILD_CUDA=1 builds it)"
APEX_HINT = ("NVIDIA Apex is built from github.com/NVIDIA/apex; `pip install apex` installs an "
             "unrelated package")


def run_command(argv: Sequence[str], timeout: float = 20.0) -> Tuple[bool, str]:
    """(ran and exited 0, its stdout+stderr or why it could not run)."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def cudnn_version_string(version: Optional[int]) -> Optional[str]:
    """torch's integer cuDNN version as text: 90100 -> '9.1.0', 8902 -> '8.9.2'."""
    if version is None:
        return None
    if version >= 10000:  # cuDNN 9 encodes major*10000 + minor*100 + patch
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return f"{version // 1000}.{version // 100 % 10}.{version % 100}"


def torch_build() -> Dict[str, Any]:
    """torch's version and what it was built with: CUDA (and whether usable), cuDNN."""
    cuda = torch.version.cuda
    available = bool(cuda) and torch.cuda.is_available()
    if cuda is None:
        why = f"torch {torch.__version__} is a CPU-only build"
    elif not available:
        why = (f"torch has CUDA {cuda} but sees no device (driver, or CUDA_VISIBLE_DEVICES="
               f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})")
    else:
        why = None
    cudnn: Optional[str] = None
    cudnn_note = "needs a CUDA build of torch" if cuda is None else "cuDNN not available"
    try:
        if torch.backends.cudnn.is_available():
            cudnn, cudnn_note = cudnn_version_string(torch.backends.cudnn.version()), ""
    except Exception as exc:  # a broken cuDNN install must not stop the report
        cudnn_note = f"cuDNN check failed ({type(exc).__name__}: {exc})"
    return {"version": torch.__version__, "path": str(Path(torch.__file__).parent),
            "cuda": cuda, "hip": getattr(torch.version, "hip", None),
            "cuda_available": available, "cuda_note": why or "",
            "cudnn": cudnn, "cudnn_note": cudnn_note}


def gpus() -> List[Dict[str, Any]]:
    """Each visible CUDA GPU: index, name, memory (GiB), compute capability, SM count."""
    if torch.version.cuda is None or not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        try:
            props = torch.cuda.get_device_properties(index)
        except Exception as exc:  # one unusable GPU (e.g. in a bad state) must not hide the rest
            found.append({"index": index, "name": f"unreadable ({type(exc).__name__}: {exc})",
                          "memory_gib": None, "compute_capability": None, "sm_count": None})
            continue
        found.append({"index": index, "name": props.name,
                      "memory_gib": round(props.total_memory / 2**30, 1),
                      "compute_capability": f"{props.major}.{props.minor}",
                      "sm_count": props.multi_processor_count})
    return found


def parse_nvcc_version(text: str) -> Optional[str]:
    """The toolkit version in `nvcc --version` output: '... release 13.0, V13.0.88' -> '13.0.88'."""
    match = re.search(r"\bV(\d+\.\d+(?:\.\d+)?)", text) or re.search(r"release (\d+\.\d+)", text)
    return match.group(1) if match else None


def find_nvcc() -> Tuple[Optional[str], Optional[str]]:
    """(nvcc path, CUDA_HOME as set): $CUDA_HOME/bin/nvcc (or $CUDA_PATH) first, else PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        candidate = Path(home) / "bin" / "nvcc"
        if candidate.is_file():
            return str(candidate), home
    return shutil.which("nvcc"), home


def nvcc() -> Dict[str, Any]:
    """nvcc's path and version, and whether its major version matches torch's CUDA."""
    path, home = find_nvcc()
    info: Dict[str, Any] = {"found": path is not None, "path": path, "version": None,
                            "cuda_home": home, "note": ""}
    if path is None:
        where = f"$CUDA_HOME/bin ({home})" if home else "PATH (CUDA_HOME is unset)"
        info["note"] = f"no nvcc on {where}: install the CUDA toolkit to build the kernels"
        return info
    ok, text = run_command([path, "--version"])
    info["version"] = parse_nvcc_version(text) if ok else None
    if info["version"] is None:
        info["note"] = f"`{path} --version` gave no version: {text.splitlines()[-1] if text else 'no output'}"
    elif torch.version.cuda and info["version"].split(".")[0] != torch.version.cuda.split(".")[0]:
        info["note"] = (f"nvcc {info['version']} and torch's CUDA {torch.version.cuda} differ in "
                        f"major version: a JIT build will likely fail")
    return info


def import_prebuilt() -> Tuple[Optional[ModuleType], str]:
    """(the extension setup.py built, where it is) or (None, why not importable)."""
    if importlib.util.find_spec(build.PREBUILT) is None:
        return None, NOT_PREBUILT
    try:
        module = importlib.import_module(build.PREBUILT)
    except Exception as exc:  # e.g. built against another torch or CUDA
        return None, f"prebuilt but not importable ({type(exc).__name__}: {exc})"
    return module, f"prebuilt: {getattr(module, '__file__', build.PREBUILT)}"


def jit_problem() -> Optional[str]:
    """Why the kernels cannot be built just in time here, or None when they can."""
    try:
        problem = build.toolchain_problem()
    except Exception as exc:  # the probe must report, not crash
        return f"toolchain check failed ({type(exc).__name__}: {exc})"
    if problem is None and os.environ.get("GIGATRON_JIT", "1") == "0":
        return "the JIT build is disabled (GIGATRON_JIT=0)"
    return problem


def kernel_rows(prebuilt: Optional[ModuleType], prebuilt_note: str, jit_why: Optional[str],
                apex_ok: bool) -> List[Dict[str, Any]]:
    """Per fused op: built?, buildable just in time here?, which backend runs it, and why."""
    rows = []
    for op, (title, functions) in KERNELS.items():
        missing = [f for f in functions if prebuilt is not None and not hasattr(prebuilt, f)]
        built = prebuilt is not None and not missing
        if built:
            note = prebuilt_note
        elif missing:
            note = f"the prebuilt extension lacks {', '.join(missing)}: rebuild it"
        elif jit_why is None:
            note = "built just in time on first use (ninja; then cached)"
        else:  # a broken prebuilt extension says more than the JIT's reason
            note = jit_why if prebuilt_note == NOT_PREBUILT else prebuilt_note
        kernel = built or jit_why is None
        runs = "kernel" if kernel else "apex" if apex_ok and op in backend.APEX_OPS else "torch"
        rows.append({"op": op, "name": title, "built": built, "jit_buildable": jit_why is None,
                     "runs_with": runs, "note": note})
    return rows


def apex() -> Dict[str, Any]:
    """Whether NVIDIA's Apex (not PyPI's unrelated `apex`) is importable with its fused norms."""
    info: Dict[str, Any] = {"installed": False, "nvidia": False, "available": False,
                            "path": None, "note": ""}
    try:
        spec = importlib.util.find_spec("apex")
    except Exception as exc:  # a broken namespace package raises here
        spec, info["note"] = None, f"apex lookup failed ({type(exc).__name__}: {exc})"
    if spec is None:
        info["note"] = info["note"] or f"not installed (optional). {APEX_HINT}"
        return info
    info.update(installed=True, path=spec.origin or ", ".join(spec.submodule_search_locations or []))
    try:
        nvidia = importlib.util.find_spec("apex.normalization") is not None
    except Exception:  # importing the parent `apex` failed
        nvidia = False
    if not nvidia:
        info["note"] = f"the installed `apex` is not NVIDIA's (no apex.normalization). {APEX_HINT}"
        return info
    module, note = apex_backend.load_apex()
    info.update(nvidia=True, available=module is not None, note=note)
    return info


def kernels_report() -> Dict[str, Any]:
    """The ops section of `gigatron report`: nvcc, ninja, Apex and each fused kernel."""
    apex_info = apex()
    prebuilt, prebuilt_note = import_prebuilt()
    ninja = shutil.which("ninja")
    return {"nvcc": nvcc(), "ninja": ninja, "apex": apex_info,
            "backend_env": os.environ.get(backend.ENV_VAR, "auto"),
            "kernels": kernel_rows(prebuilt, prebuilt_note, jit_problem(), apex_info["available"])}
