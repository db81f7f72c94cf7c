"""Single-device training speed (issue 21): gigatron's trainer beside a torch.compile plain
loop and megatron-core's GPTModel, on the same zoo config (GPT or Llama), sequence length and
micro-batch.

For each size: the largest micro-batch from a descending list that trains a step without
running out of memory (per path), warm-up steps, then N timed steps (device events; the
median step is reported) -> tokens/s, model TFLOP/s (6N + 12 L h s per token,
training/observe/flops.py on the run's own model config) and MFU against training/observe/devices.py's peak, and peak memory.
gigatron's timed steps run under HostSyncCounter (the count is reported; 0 is the goal) and
one profiled step writes a torch profiler trace with its top-10 kernels printed.

    python bench/bench_train_gpu.py --sizes gpt2-124m              # one size per device call
    python bench/bench_train_gpu.py --sizes llama-1b --micro-batches 8 4
    python bench/bench_train_gpu.py --capacity --sizes gpt3-2.7b gpt3-6.7b
    python bench/bench_train_gpu.py --device cpu --tiny             # every path, tiny, on CPU

--capacity: each size in its own process (a host out-of-memory kills only that one) with
--optimizer-cpu-offload, bf16, full recompute, micro-batch 1, 2 steps; the largest that
trains is reported with its TFLOP/s, step time and host bytes per parameter (the process's
peak RSS over its parameters). Output: a markdown table on stdout and results.json
under --out (default $OUT, else bench_out/).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_gpt  # noqa: E402
from train_paths import (DTYPES, Built, Step, build_gigatron,  # noqa: E402,F401
                         gigatron_flags, model_config, path_builders)

from gigatron.training.observe import flops as metrics  # noqa: E402
from gigatron.training.observe.host_syncs import HostSyncCounter  # noqa: E402

SIZES = {"gpt2-124m": "gpt2-124m", "gpt3-350m": "gpt2-355m", "gpt3-1.3b": "gpt3-1.3b",
         "gpt3-2.7b": "gpt3-2.7b", "gpt3-6.7b": "gpt3-6.7b", "gpt3-13b": "gpt3-13b",
         "llama-1b": "llama3.2-1b", "llama-8b": "llama3-8b"}
# --tiny keeps the zoo architecture and shrinks it; hidden grows with the size's order
TINY = dict(num_layers=2, vocab_size=256)
MICRO_BATCHES = (32, 24, 16, 12, 8, 6, 4, 3, 2, 1)


# ---- one measured path ---------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Step, batch: tuple, device: torch.device, warmup: int, iters: int,
               counter: Optional[HostSyncCounter] = None) -> List[float]:
    """Seconds of each of `iters` steps after `warmup` (CUDA events: no host wait between
    steps; the host reads the events once at the end)."""
    for _ in range(warmup):
        step(*batch)
    _sync(device)
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        events[0].record()
        with counter or contextlib.nullcontext():
            for i in range(iters):
                step(*batch)
                events[i + 1].record()
        torch.cuda.synchronize(device)
        return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(iters)]
    times = []
    with counter or contextlib.nullcontext():
        for _ in range(iters):
            start = time.perf_counter()
            step(*batch)
            times.append(time.perf_counter() - start)
    return times


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _batch(micro: int, seq: int, vocab: int, device: torch.device) -> tuple:
    tokens = torch.randint(0, vocab, (micro, seq + 1), device=device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def largest_fitting(build: Callable[[int], Built], micro_batches: List[int], batch_for,
                    device: torch.device) -> tuple:
    """(micro, parameters, step, batch) for the first micro-batch (descending) whose build and
    two steps fit."""
    errors = []
    for micro in micro_batches:
        try:
            parameters, step = build(micro)
            batch = batch_for(micro)
            step(*batch)
            step(*batch)
            _sync(device)
            return micro, parameters, step, batch
        except torch.OutOfMemoryError as err:
            errors.append(f"{micro}: {str(err).splitlines()[0]}")
        step = batch = None  # type: ignore[assignment]
        _free(device)  # outside the except: its traceback holds the failed try's tensors
    raise RuntimeError("no micro-batch fits: " + "; ".join(errors))


# ---- profiling -------------------------------------------------------------------------------

def profile_top_kernels(step: Step, batch: tuple, device: torch.device, trace: str,
                        top: int = 10) -> List[Dict[str, Any]]:
    """One profiled step: the Chrome trace written to `trace` (gzipped when it ends in .gz:
    the device tool returns files up to 16 MiB), the top kernels by device time (CPU ops on a
    CPU run)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        step(*batch)
        _sync(device)
    prof.export_chrome_trace(trace)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [{"name": e.key[:90], "us": getattr(e, key), "calls": e.count} for e in rows]


# ---- one size --------------------------------------------------------------------------------

def _size(name: str, tiny: bool) -> Dict[str, Any]:
    """name, zoo model and --tiny's TransformerConfig overrides (the same architecture:
    norm, activation, positions, biases, tying and the heads/groups and ffn/hidden ratios)."""
    from gigatron.models.zoo import model_fields

    if name not in SIZES:
        raise SystemExit(f"--sizes: unknown size {name!r}; use any of {', '.join(SIZES)}")
    if not tiny:
        return dict(name=name, zoo=SIZES[name], overrides={})
    zoo = model_fields(SIZES[name])
    heads = zoo["num_attention_heads"]
    groups = zoo.get("num_query_groups", heads)
    tiny_heads = 4 if groups == heads else 8
    hidden = 32 * (list(SIZES).index(name) + 1)
    overrides = dict(TINY, hidden_size=hidden, num_attention_heads=tiny_heads)
    if groups != heads:
        overrides["num_query_groups"] = max(1, tiny_heads * groups // heads)
    if "ffn_hidden_size" in zoo:
        overrides["ffn_hidden_size"] = 8 * round(hidden * zoo["ffn_hidden_size"]
                                                 / zoo["hidden_size"] / 8)
    return dict(name=f"tiny-{name}", zoo=SIZES[name], overrides=overrides)


def _report(path: str, micro: int, seq: int, times: List[float], flops_token: float,
            peak: Optional[float], device: torch.device, **extra: Any) -> Dict[str, Any]:
    median = statistics.median(times)
    out = metrics.throughput(micro * seq, median, flops_token, 1, peak)
    return dict(path=path, micro_batch=micro, step_s=median, step_s_min=min(times),
                step_s_max=max(times), peak_memory_gib=metrics.peak_memory_bytes(device) / 2**30,
                **out, **extra)


def run_size(name: str, args: argparse.Namespace, device: torch.device) -> List[Dict[str, Any]]:
    """Every path on one size; a path that fails is reported with its error, not raised."""
    size = _size(name, args.tiny)
    arch = model_config(gigatron_flags(size, 1, args, args.gigatron_flags))
    seq, flops_token = args.seq_length, metrics.flops_per_token(arch)
    vocab = metrics.padded_vocab_size(arch.vocab_size, arch.make_vocab_size_divisible_by, 1)
    peak = args.peak_tflops or metrics.device_peak_tflops(device, DTYPES[args.dtype])
    batch_for = lambda micro: _batch(micro, seq, vocab, device)  # noqa: E731
    common = dict(size=size["name"], seq_length=seq, dtype=args.dtype)
    results = []
    for path, build in path_builders(size, args, device, arch).items():
        if path == "megatron-core" and not megatron_gpt.available():
            results.append(dict(common, path=path,
                                error="megatron.core is not importable: carry its wheel"))
            continue
        _free(device)
        try:
            micro, params, step, batch = largest_fitting(build, args.micro_batches, batch_for,
                                                         device)
            counter = HostSyncCounter() if path == "gigatron" else None
            times = time_steps(step, batch, device, args.warmup, args.iters, counter)
            extra: Dict[str, Any] = dict(common, parameters=params)
            if counter is not None:
                extra.update(host_syncs=counter.count, host_sync_sites=dict(counter.sites))
            if path == "gigatron" and args.profile:
                trace = os.path.join(args.out, f"trace_{size['name']}.json.gz")
                extra.update(trace=trace, top_kernels=profile_top_kernels(step, batch, device,
                                                                          trace))
            results.append(_report(path, micro, seq, times, flops_token, peak, device, **extra))
        except Exception as err:  # a path's failure is a result of the bench, not its end
            results.append(dict(common, path=path, error=f"{type(err).__name__}: {err}"[:500]))
        finally:
            step = batch = None  # type: ignore[assignment]
            _free(device)
        # each path's result as soon as it is known: a bench stopped by a time limit keeps it
        print("path result: " + json.dumps({k: v for k, v in results[-1].items()
                                            if k not in ("top_kernels", "host_sync_sites")},
                                           default=str), flush=True)
    return results


# ---- capacity with optimizer offload -----------------------------------------------------------

def capacity_one(name: str, args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    """Two offloaded steps of one size at micro-batch 1 (run in its own process)."""
    size = _size(name, args.tiny)
    flags = gigatron_flags(size, 1, args, [
        "--optimizer-cpu-offload", "--use-distributed-optimizer",
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"] + args.gigatron_flags)
    session, step = build_gigatron(flags, device)
    params = sum(p.numel() for c in session.chunks for p in c.parameters())
    model = session.run.model
    vocab = metrics.padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, 1)
    batch = _batch(1, args.seq_length, vocab, device)
    times = time_steps(step, batch, device, 1, 1)
    peak = args.peak_tflops or metrics.device_peak_tflops(device, DTYPES[args.dtype])
    host = _host_peak_gib()
    return _report("gigatron offload", 1, args.seq_length, times,
                   metrics.flops_per_token(model), peak, device, size=size["name"],
                   parameters=params, host_peak_rss_gib=host,
                   host_bytes_per_param=host * 2**30 / params)


def _host_peak_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def capacity(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Each size (ascending) in a child process; stops at the first that does not train."""
    results = []
    for name in args.sizes:
        cmd = [sys.executable, os.path.abspath(__file__), "--capacity-one", name] + \
            _forwarded(args)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.size_timeout)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        if proc.returncode == 0 and lines:
            results.append(json.loads(lines[-1]))
            print("size result: " + lines[-1], flush=True)  # kept if a time limit stops us
            continue
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        results.append(dict(size=name, path="gigatron offload",
                            error=f"exit {proc.returncode}: " + " | ".join(tail)))
        break
    return results


def _forwarded(args: argparse.Namespace) -> List[str]:
    out = ["--device", args.device, "--seq-length", str(args.seq_length), "--dtype", args.dtype,
           "--out", args.out]
    if args.tiny:
        out.append("--tiny")
    if args.peak_tflops:
        out += ["--peak-tflops", str(args.peak_tflops)]
    return out + [f"--gigatron-flag={f}" for f in args.gigatron_flags]


# ---- output -----------------------------------------------------------------------------------

def markdown(results: List[Dict[str, Any]]) -> str:
    head = ("| size | path | micro-batch | tokens/s | TFLOP/s | MFU | step ms (median) | "
            "peak GiB | host syncs | parameters |\n|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for r in results:
        if "error" in r:
            rows.append(f"| {r['size']} | {r['path']} | failed: {r['error'][:120]} ||||||||")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        rows.append(f"| {r['size']} | {r['path']} | {r['micro_batch']} | "
                    f"{r['tokens_per_s']:,.0f} | {r['tflops_per_device']:.2f} | {mfu} | "
                    f"{1e3 * r['step_s']:.1f} | {r['peak_memory_gib']:.2f} | "
                    f"{r.get('host_syncs', '-')} | {r.get('parameters', 0):,} |")
    return "\n".join([head] + rows)


def _environment(device: torch.device) -> Dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return dict(device=name or device.type, torch=torch.__version__,
                python=platform.python_version(),
                date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                argv=sys.argv[1:])


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["gpt2-124m", "gpt3-350m", "gpt3-1.3b"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU end-to-end check)")
    p.add_argument("--seq-length", type=int, default=None, help="default 2048 (tiny: 32)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--micro-batches", type=int, nargs="+", default=None,
                   help=f"tried in this order (default {MICRO_BATCHES}; tiny: 4 2)")
    p.add_argument("--warmup", type=int, default=None, help="default 5 (tiny: 1)")
    p.add_argument("--iters", type=int, default=None, help="timed steps (default 20; tiny: 3)")
    p.add_argument("--paths", nargs="+", default=["gigatron", "plain", "megatron"])
    p.add_argument("--recompute", action="store_true", help="gigatron: full recompute")
    p.add_argument("--gigatron-flag", dest="gigatron_flags", action="append", default=[],
                   help="extra pretrain flag for gigatron's path (repeat; --gigatron-flag=--x)")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="MFU denominator (default: training/observe/devices.py's for the device)")
    p.add_argument("--capacity", action="store_true",
                   help="largest --sizes that trains 2 steps with --optimizer-cpu-offload")
    p.add_argument("--capacity-one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--size-timeout", type=float, default=540.0,
                   help="--capacity: seconds per size before it counts as failed")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    args = p.parse_args(argv)
    args.seq_length = args.seq_length or (32 if args.tiny else 2048)
    args.micro_batches = args.micro_batches or ([4, 2] if args.tiny else list(MICRO_BATCHES))
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    args.iters = args.iters or (3 if args.tiny else 20)
    return args


def init_single_process(device: torch.device) -> None:
    """A one-rank default process group (the trainer's groups and megatron-core need one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # torch 2.11 wants an index
    # a one-rank group needs no rendezvous: a private TCP store on a free port, so a bench
    # started from a process that holds a group (pytest, another bench) never collides
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0,
                            world_size=1)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    if args.capacity_one:
        init_single_process(device)
        print(json.dumps(capacity_one(args.capacity_one, args, device)), flush=True)
        return 0
    if args.capacity:
        results = capacity(args)
        trained = [r for r in results if "error" not in r]
        summary = {"largest": trained[-1]["size"] if trained else None}
    else:
        init_single_process(device)
        results = [r for name in args.sizes for r in run_size(name, args, device)]
        summary = {}
    report = dict(_environment(device), results=results, **summary)
    name = "capacity.json" if args.capacity else "results.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(markdown(results))
    if summary:
        print(f"largest that trains with --optimizer-cpu-offload: {summary['largest']}")
        for r in results:  # the host side of offload: peak RSS (imports included) per param
            if "error" not in r:
                print(f"  {r['size']}: host peak RSS {r['host_peak_rss_gib']:.1f} GiB = "
                      f"{r['host_bytes_per_param']:.1f} host bytes/param, "
                      f"step {r['step_s']:.2f} s")
    for r in results:
        for k in r.get("top_kernels", []):
            print(f"  {r['size']} top: {k['us'] / 1e3:9.2f} ms x{k['calls']:<4} {k['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
