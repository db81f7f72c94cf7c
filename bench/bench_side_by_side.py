"""Side by side (issue 42): one Llama-style model trained by gigatron (eager, --torch-compile,
FP8 tensorwise and delayed), torchtitan 0.3.0 and megatron-core, same settings; prints
tokens/s, MFU, peak memory and the loss after the timed steps of each.

The model (bench/side_by_side_contenders.py's Shape): RMSNorm, SwiGLU, RoPE (theta 500000),
grouped-query attention, untied embeddings, no biases; on a GPU hidden 2048, 16 layers, 16
heads, 8 key/value groups, ffn 8192, vocab 32000 (1.14 B parameters), sequence 2048, micro =
global batch 4; --toy (the default on a CPU): hidden 64, 2 layers, 4 heads, 2 groups, ffn 256,
vocab 512, sequence 64, batch 2. All: bf16, AdamW (lr 1e-4, betas 0.9/0.95, weight decay 0.1
where the framework takes them: megatron_gpt.py keeps Megatron's 0.999/0.01), gradient
clipping 1.0, random tokens, the same warm-up and timed steps.

Each contender runs in its own process (a crash or an out-of-memory ends only that one, and
peak memory is its own): torch.cuda.max_memory_allocated on a GPU, the process's peak RSS on
a CPU. tokens/s is micro x sequence / the median timed step. MFU counts 6N + 12 L h s FLOPs
per token (training/observe/flops.py, the same count for every contender) against the bf16
peak of training/observe/devices.py for the GPU (FP8 runs too: their MFU is against bf16);
on a CPU it is "n/a". torchtitan is taken from --torchtitan-path (or $TORCHTITAN_PATH) when
it is not installed: `pip install --no-deps --target DIR torchtitan==0.3.0 spmd_types==0.2.3
torch_checkpointing tyro docstring_parser typeguard triton` never touches torch.

    python bench/bench_side_by_side.py                     # GPU: the 1B size
    python bench/bench_side_by_side.py --toy               # CPU (the default there)
    python bench/bench_side_by_side.py --contenders "gigatron eager" megatron-core
    python bench/bench_side_by_side.py --model gpt3-1.3b   # GPT-3 XL (no torchtitan row)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import side_by_side_contenders as contenders  # noqa: E402
from side_by_side_contenders import Shape  # noqa: E402

GPU_SHAPE = Shape(16, 2048, 16, 8, 8192, 32000, 2048, 4)
TOY_SHAPE = Shape(2, 64, 4, 2, 256, 512, 64, 2)
# --model gpt3-1.3b: GPT-3 XL (models/zoo/gpt3-1.3b.json: 24 layers, hidden 2048, 16 heads,
# ffn 8192, GPT-2's vocabulary), micro-batch 8 (it fit on the H200 of issue 33)
GPT_SHAPE = Shape(24, 2048, 16, 16, 8192, 50257, 2048, 8, "gpt")
TOY_GPT_SHAPE = Shape(2, 64, 4, 4, 256, 512, 64, 2, "gpt")
MODELS = {"llama-1b": (GPU_SHAPE, TOY_SHAPE), "gpt3-1.3b": (GPT_SHAPE, TOY_GPT_SHAPE)}
CONTENDERS = list(contenders.GIGATRON_VARIANTS) + ["torchtitan", "torchtitan compiled",
                                                   "megatron-core"]
RESULT = "side-by-side result: "


# ---- one contender, in its own process -------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, shape: Shape, device: torch.device, warmup: int,
            iters: int) -> Dict[str, Any]:
    """Build `name`, run `warmup` steps, time `iters` (host clock around a synchronised step);
    the loss is the last timed step's."""
    from bench_train_gpu import init_single_process

    init_single_process(device)
    torch.manual_seed(1234)
    parameters, step = contenders.build(name, shape, device)
    tokens = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_length + 1),
                           device=device)
    batch = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    for _ in range(warmup):
        step(*batch)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for _ in range(iters):
        start = time.perf_counter()
        loss = step(*batch)
        _sync(device)
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:  # ru_maxrss is KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(contender=name, version=contenders.version(name), parameters=parameters,
                step_s=statistics.median(times),
                tokens_per_s=shape.micro_batch * shape.seq_length / statistics.median(times),
                peak_memory_gib=peak / 2**30, loss=float(loss))


def _child(args: argparse.Namespace) -> int:
    shape = Shape(**json.loads(args.shape))
    result = measure(args.child, shape, torch.device(args.device), args.warmup, args.iters)
    print(RESULT + json.dumps(result), flush=True)
    return 0


# ---- the parent: one process per contender, one table ----------------------------------------

def skip_reason(name: str, torchtitan_path: Optional[str], arch: str = "llama"
                ) -> Optional[str]:
    """Why `name` cannot run here on an `arch` model (None: it can)."""
    import importlib.machinery
    import importlib.util

    if name == "gigatron compiled" and not contenders.has_flag("--torch-compile"):
        return "--torch-compile is not in gigatron's config table yet"
    if name.startswith("torchtitan") and arch == "gpt":
        return "torchtitan 0.3.0 has no GPT-2/3 model (LayerNorm, GeLU, learned positions)"
    if name.startswith("torchtitan"):
        paths = [torchtitan_path] if torchtitan_path else []
        found = any(importlib.machinery.PathFinder.find_spec("torchtitan", [p]) for p in paths)
        if not found and importlib.util.find_spec("torchtitan") is None:
            return "torchtitan is not installed (pip install torchtitan==0.3.0, or " \
                   "--torchtitan-path DIR)"
    if name == "megatron-core" and importlib.util.find_spec("megatron") is None:
        return "megatron-core is not installed"
    return None


def run_contender(name: str, shape: Shape, args: argparse.Namespace) -> Dict[str, Any]:
    """`name`'s result from its own process; a crash, time-out or skip is a result too."""
    reason = skip_reason(name, args.torchtitan_path, shape.arch)
    if reason:
        return dict(contender=name, skipped=reason)
    env = dict(os.environ)
    if name.startswith("torchtitan") and args.torchtitan_path:
        env["PYTHONPATH"] = os.pathsep.join(
            [args.torchtitan_path] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--shape",
           json.dumps(dataclasses.asdict(shape)), "--device", args.device,
           "--warmup", str(args.warmup), "--iters", str(args.iters)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=args.contender_timeout)
    except subprocess.TimeoutExpired:
        return dict(contender=name, error=f"timed out after {args.contender_timeout:.0f} s")
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = [l for l in (proc.stderr or proc.stdout).strip().splitlines() if l.strip()][-3:]
    return dict(contender=name, error=f"exit {proc.returncode}: " + " | ".join(tail))


def mfu_denominator(device: torch.device, peak_tflops: Optional[float]) -> Optional[float]:
    """Peak bf16 TFLOP/s for MFU: --peak-tflops, else the GPU's from devices.py; None on a
    CPU (MFU printed as n/a)."""
    if peak_tflops:
        return peak_tflops
    if device.type != "cuda":
        return None
    from gigatron.training.observe import flops as metrics

    return metrics.device_peak_tflops(device, torch.bfloat16)


def add_mfu(results: List[Dict[str, Any]], flops_per_token: float,
            peak_tflops: Optional[float]) -> None:
    for r in results:
        if "tokens_per_s" in r:
            tflops = r["tokens_per_s"] * flops_per_token / 1e12
            r["tflops"] = tflops
            r["mfu"] = tflops / peak_tflops if peak_tflops else None


def markdown(results: List[Dict[str, Any]]) -> str:
    rows = ["| contender | version | tokens/s | MFU | peak memory GiB | loss | parameters |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        if "tokens_per_s" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r['error']}"
            rows.append(f"| {r['contender']} | {why[:200]} ||||||")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        rows.append(f"| {r['contender']} | {r['version']} | {r['tokens_per_s']:,.0f} | {mfu} | "
                    f"{r['peak_memory_gib']:.2f} | {r['loss']:.4f} | {r['parameters']:,} |")
    return "\n".join(rows)


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--toy", action=argparse.BooleanOptionalAction, default=None,
                   help="the toy size (default on a CPU)")
    p.add_argument("--model", choices=list(MODELS), default="llama-1b",
                   help="the Llama-style 1.14B (default) or GPT-3 1.3B (torchtitan skipped)")
    p.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    p.add_argument("--seq-length", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None, help="= global batch (one rank)")
    p.add_argument("--warmup", type=int, default=None, help="default 3 (toy: 1)")
    p.add_argument("--iters", type=int, default=None, help="timed steps (default 10; toy: 3)")
    p.add_argument("--peak-tflops", type=float, default=None, help="MFU denominator")
    p.add_argument("--torchtitan-path", default=os.environ.get("TORCHTITAN_PATH"),
                   help="a folder holding torchtitan 0.3.0 (pip install --target)")
    p.add_argument("--contender-timeout", type=float, default=600.0)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.toy is None:
        args.toy = args.device == "cpu"
    args.warmup = args.warmup if args.warmup is not None else (1 if args.toy else 3)
    args.iters = args.iters or (3 if args.toy else 10)
    return args


def shape_of(args: argparse.Namespace) -> Shape:
    gpu, toy = MODELS[args.model]
    shape = toy if args.toy else gpu
    if args.seq_length:
        shape = dataclasses.replace(shape, seq_length=args.seq_length)
    if args.micro_batch:
        shape = dataclasses.replace(shape, micro_batch=args.micro_batch)
    return shape


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    if args.child:
        return _child(args)
    from gigatron.training.observe import flops as metrics

    device, shape = torch.device(args.device), shape_of(args)
    print(f"shape: {dataclasses.asdict(shape)}; warm-up {args.warmup}, timed {args.iters}",
          flush=True)
    results = []
    for name in args.contenders:
        results.append(run_contender(name, shape, args))
        print(RESULT + json.dumps(results[-1]), flush=True)  # kept if a time limit stops us
    add_mfu(results, metrics.flops_per_token(contenders.model_config(shape)),
            mfu_denominator(device, args.peak_tflops))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "side_by_side.json"), "w") as f:
        json.dump(dict(shape=dataclasses.asdict(shape), device=args.device, argv=sys.argv[1:],
                       warmup=args.warmup, iters=args.iters, results=results), f, indent=1)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
