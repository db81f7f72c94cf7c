"""Report the environment like ds_report: torch, CUDA, GPUs, nvcc, fused kernels, Apex, MPI, packages.

`gigatron report` prints aligned sections; `--json` prints one JSON object instead;
`--comm-check` adds an all-reduce bandwidth benchmark across the launched ranks (torchrun,
SLURM, mpirun, `gigatron launch`), or across `--nproc N` local workers it starts itself
through torch's elastic launcher. Under a launcher only rank 0 prints.

JSON schema (version 1; keys are only ever added, with `schema` raised on a breaking change;
"note" fields are human-readable reasons, "" when there is nothing to say):
  schema: 1
  gigatron: {version, path, commit|null}
  python: {version, executable}
  torch: {version, path, cuda|null, hip|null, cuda_available, cuda_note, cudnn|null, cudnn_note}
  gpus: [{index, name, memory_gib, compute_capability ("9.0"), sm_count}]   ([] without one)
  comm: {backends: {distributed, gloo, nccl, mpi, nccl_version|null, note},
         launcher: {launcher ("torchrun"|"slurm"|"mpi"|"none"|null), rank, world_size,
                    local_rank, master ("addr:port"), note},
         env: {NAME: value|null}}          (named variables always; NCCL_*/GIGATRON_* when set)
  mpirun: {found, path, implementation|null ("Open MPI", ...), version|null, note}
  ops: {nvcc: {found, path, version|null, cuda_home|null, note}, ninja: path|null,
        apex: {installed, nvidia, available, path, note}, backend_env (GIGATRON_OPS_BACKEND),
        kernels: [{op, name, built, jit_buildable, runs_with ("kernel"|"apex"|"torch"), note}]}
  packages: [{name, version|null, used_for}]
  comm_check: only with --comm-check: {world_size, launcher, backend, device, dtype, warmup,
        iters, results: [{bytes, time_us, algbw_gbps, busbw_gbps}]}
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

SCHEMA_VERSION = 1
# distribution name -> what gigatron uses it for
PACKAGES = {
    "tensorboard": "--tensorboard-dir; DeepSpeed config's tensorboard section",
    "safetensors": "--ckpt-format safetensors",
    "transformers": "Hugging Face interop (not needed by gigatron itself)",
    "mpi4py": "MPI tooling (not needed: mpirun launches read OMPI_/PMI_ variables)",
    "matplotlib": "gigatron plot",
    "sentencepiece": "SentencePieceTokenizer, gigatron train-tokenizer",
    "tokenizers": "GPT2BPETokenizer, HuggingFaceTokenizer",
    "wandb": "DeepSpeed config's wandb section",
}
Row = Tuple[str, ...]
Section = Tuple[str, Optional[Row], List[Row]]  # (title, column header or None, rows)


def packages() -> List[Dict[str, Any]]:
    """Each optional package's installed version (None when absent) and what it is for."""
    found = []
    for name, used_for in PACKAGES.items():
        try:
            version: Optional[str] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = None
        found.append({"name": name, "version": version, "used_for": used_for})
    return found


def parse_mpirun_version(text: str) -> Tuple[Optional[str], Optional[str]]:
    """(implementation, version) from `mpirun --version`, e.g. ('Open MPI', '4.1.6')."""
    for implementation, pattern in (("Open MPI", r"\(Open MPI\)\s+(\S+)"),
                                    ("MPICH (Hydra)", r"HYDRA build details:.*?Version:\s+(\S+)"),
                                    ("Intel MPI", r"Intel\(R\) MPI Library.*?Version\s+([^\s,]+)")):
        match = re.search(pattern, text, re.S)
        if match:
            return implementation, match.group(1)
    first = text.strip().splitlines()[0] if text.strip() else None
    return first, None


def mpirun() -> Dict[str, Any]:
    """The `mpirun` on PATH: which MPI (Open MPI, MPICH, ...) and its version, or why none."""
    from gigatron.ops.report import run_command

    path = shutil.which("mpirun")
    info: Dict[str, Any] = {"found": path is not None, "path": path, "implementation": None,
                            "version": None, "note": ""}
    if path is None:
        info["note"] = "no mpirun on PATH (optional, for mpirun launches: apt install openmpi-bin)"
        return info
    ok, text = run_command([path, "--version"])
    if ok:
        info["implementation"], info["version"] = parse_mpirun_version(text)
    else:
        info["note"] = f"`mpirun --version` failed: {text.splitlines()[-1] if text else 'no output'}"
    return info


def gigatron_info() -> Dict[str, Any]:
    """gigatron's version, where it is imported from, and the git commit of a checkout."""
    import gigatron

    path = Path(list(gigatron.__path__)[0]).resolve()
    try:
        version: Optional[str] = importlib.metadata.version("gigatron")
    except importlib.metadata.PackageNotFoundError:
        version = None
    from gigatron.ops.report import run_command

    root = path.parent  # the checkout, in an editable install
    commit = None
    if (root / ".git").exists() and shutil.which("git"):
        ok, text = run_command(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], timeout=10)
        commit = text if ok and text else None
    return {"version": version, "path": str(root if commit else path), "commit": commit}


def collect() -> Dict[str, Any]:
    """Every probe's data: the `--json` output (schema in the module docstring)."""
    from gigatron.ops import report as ops_report
    from gigatron.parallel import environment

    return {"schema": SCHEMA_VERSION, "gigatron": gigatron_info(),
            "python": {"version": platform.python_version(), "executable": sys.executable},
            "torch": ops_report.torch_build(), "gpus": ops_report.gpus(),
            "comm": environment.comm_report(), "mpirun": mpirun(),
            "ops": ops_report.kernels_report(), "packages": packages()}


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _general(report: Dict[str, Any]) -> Section:
    giga, torch_, py = report["gigatron"], report["torch"], report["python"]
    commit = f" (commit {giga['commit']})" if giga["commit"] else ""
    rows: List[Row] = [
        ("gigatron", giga["version"] or "unknown", giga["path"] + commit),
        ("python", py["version"], py["executable"]),
        ("torch", torch_["version"], torch_["path"]),
        ("torch built with CUDA", torch_["cuda"] or "no", "" if torch_["cuda"] else "CPU-only build"),
        ("CUDA available", _yes(torch_["cuda_available"]), torch_["cuda_note"]),
        ("cuDNN", torch_["cudnn"] or "no", torch_["cudnn_note"])]
    if torch_["hip"]:
        rows.insert(3, ("torch built with ROCm", torch_["hip"], ""))
    return ("general", None, rows)


def _gpus(report: Dict[str, Any]) -> Section:
    rows: List[Row] = [(f"GPU {g['index']}", g["name"],
                        f"{g['memory_gib']} GiB, compute capability {g['compute_capability']}, "
                        f"{g['sm_count']} SMs" if g["memory_gib"] is not None else "")
                       for g in report["gpus"]]
    why = report["torch"]["cuda_note"] or "torch sees no CUDA device"
    return ("GPUs", None, rows or [("GPUs", "none", why)])


def _comm(report: Dict[str, Any]) -> Section:
    backends, launch, mpi = report["comm"]["backends"], report["comm"]["launcher"], report["mpirun"]
    nccl_note = f"version {backends['nccl_version']}" if backends["nccl_version"] else \
        backends["note"] or ("" if backends["nccl"] else "this torch has no NCCL (CPU-only or non-NVIDIA build)")
    where = (f"rank {launch['rank']} of {launch['world_size']}, local rank {launch['local_rank']}, "
             f"master {launch['master']}") if launch["launcher"] else launch["note"]
    if launch["launcher"] == "none":
        where = "not launched: one process (torchrun, srun, mpirun or gigatron launch start ranks)"
    mpi_version = " ".join(v for v in (mpi["implementation"], mpi["version"]) if v)
    return ("communication", None, [
        ("gloo backend", _yes(backends["gloo"]), backends["note"] if not backends["distributed"] else ""),
        ("NCCL backend", _yes(backends["nccl"]), nccl_note),
        ("MPI backend", _yes(backends["mpi"]), "" if backends["mpi"] else
         "torch built without MPI (mpirun launches still work: they use gloo/NCCL)"),
        ("mpirun", mpi_version or _yes(mpi["found"]), mpi["path"] or mpi["note"]),
        ("launcher", launch["launcher"] or "error", where)])


def _kernels(report: Dict[str, Any]) -> List[Section]:
    ops = report["ops"]
    nvcc, apex = ops["nvcc"], ops["apex"]
    home = nvcc["cuda_home"] or "unset (a CUDA torch derives it from the nvcc on PATH)"
    tools: List[Row] = [
        ("nvcc", nvcc["version"] or _yes(nvcc["found"]), " ".join(x for x in (nvcc["path"], nvcc["note"]) if x)),
        ("CUDA_HOME", "", home),
        ("ninja", _yes(bool(ops["ninja"])), ops["ninja"] or "not on PATH: pip install ninja (JIT builds need it)"),
        ("NVIDIA Apex", _yes(apex["available"]), apex["note"]),
        ("GIGATRON_OPS_BACKEND", ops["backend_env"], "auto: kernel, else Apex (norms), else torch")]
    kernels: List[Row] = [(k["name"], _yes(k["built"]), _yes(k["jit_buildable"]), k["runs_with"], k["note"])
                          for k in ops["kernels"]]
    return [("kernel toolchain", None, tools),
            ("fused kernels", ("op", "built", "JIT here", "runs with", "why"), kernels)]


def _packages(report: Dict[str, Any]) -> Section:
    return ("optional packages", None,
            [(p["name"], p["version"] or "no", p["used_for"]) for p in report["packages"]])


def _env(report: Dict[str, Any]) -> Section:
    env = report["comm"]["env"]
    rows: List[Row] = [(name, "(unset)" if value is None else value, "") for name, value in env.items()]
    if not any(name.startswith(("NCCL_", "GIGATRON_")) for name in env):
        rows.append(("NCCL_* / GIGATRON_*", "(none set)", ""))
    return ("environment variables", None, rows)


def sections(report: Dict[str, Any]) -> List[Section]:
    """The report's data grouped into titled sections of rows, in reading order."""
    return [_general(report), _gpus(report), _comm(report), *_kernels(report),
            _packages(report), _env(report)]


def render(parts: Sequence[Section]) -> str:
    """Aligned plain-text sections: name column dot-led to one width, then padded columns."""
    width = max(len(row[0]) for _, header, rows in parts for row in rows + ([header] if header else []))
    lines = []
    for title, header, rows in parts:
        lines += ["", f"-- {title} " + "-" * max(3, width + 40 - len(title))]
        table = ([header] if header else []) + rows
        cols = [max(len(row[i]) for row in table if len(row) > i) for i in range(max(map(len, table)))]
        for n, row in enumerate(table):
            leader = " " if header and n == 0 else "."
            cells = [row[0] + " " + leader * (width + 2 - len(row[0]))]
            cells += [cell.ljust(cols[i + 1]) for i, cell in enumerate(row[1:-1])] + list(row[-1:])
            lines.append("  ".join(cells).rstrip())
    return "\n".join(lines[1:])


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, the docstring's schema kept as written."""


def _parser() -> argparse.ArgumentParser:
    from gigatron.parallel.comm_check import DEFAULT_SIZES

    doc = (__doc__ or "").split("\n\n")
    parser = argparse.ArgumentParser(description="\n\n".join(doc[1:2]), epilog="\n\n".join(doc[2:]),
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object (schema 1)")
    parser.add_argument("--comm-check", action="store_true",
                        help="benchmark all-reduce across the launched ranks, or --nproc local ones")
    parser.add_argument("--nproc", type=int, default=None,
                        help="local workers for --comm-check when not launched "
                             "(unset: one per GPU when there are 2 or more, else 2 CPU workers)")
    parser.add_argument("--comm-sizes", default=DEFAULT_SIZES,
                        help="all-reduce buffer sizes in bytes (K/M/G = 1024^n)")
    parser.add_argument("--comm-warmup", type=int, default=3, help="untimed all-reduces per size")
    parser.add_argument("--comm-iters", type=int, default=10, help="timed all-reduces per size (median)")
    return parser


def comm_check(args: argparse.Namespace) -> Tuple[bool, Optional[Dict[str, Any]]]:
    """(this process prints, the benchmark summary): inside a launched job every rank
    joins and rank 0 prints; otherwise `--nproc` local workers are started."""
    from gigatron.parallel import comm_check as check
    from gigatron.parallel.world import read_launch_env

    sizes = check.parse_sizes(args.comm_sizes)
    launch = read_launch_env()
    if launch.world_size > 1:
        if args.nproc is not None:
            raise ValueError(f"already launched with {launch.world_size} ranks "
                             f"({launch.launcher}): drop --nproc")
        summary = check.run_comm_check(sizes, args.comm_warmup, args.comm_iters)
        return launch.rank == 0, summary
    nproc = check.default_nproc() if args.nproc is None else args.nproc
    return True, check.launch_local(nproc, sizes, args.comm_warmup, args.comm_iters)


def _first_rank() -> bool:
    """False on every rank but 0 of a launched job, so a job prints one report."""
    from gigatron.parallel.world import read_launch_env

    try:
        return read_launch_env().rank == 0
    except ValueError:  # a broken launch env is reported in the table, by every rank
        return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`gigatron report [--json] [--comm-check [--nproc N]]`."""
    args = _parser().parse_args(argv)
    summary = None
    if args.comm_check:
        try:
            prints, summary = comm_check(args)
        except (ValueError, RuntimeError) as exc:
            print(f"gigatron report: {exc}", file=sys.stderr)
            return 1
        if not prints:
            return 0
    elif not _first_rank():
        return 0
    report = collect()
    if summary is not None:
        report["comm_check"] = summary
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(render(sections(report)))
    if summary is not None:
        from gigatron.parallel.comm_check import format_comm_check

        print(f"\n-- communication check {'-' * 40}\n{format_comm_check(summary)}")
    return 0
