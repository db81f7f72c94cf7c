"""CPU AdamW throughput of the --optimizer-cpu-offload step (issue 21).

With offload the ZeRO optimizer steps fp32 master shards in host memory: one flat tensor per
flat group. This times `torch.optim.AdamW.step` over one such shard with each implementation
torch has on the CPU: the single-tensor loop (torch's CPU default), foreach, and fused (one
vectorised pass, what parallel/zero/optimizers.py builds for CPU shards). Reported per size:
median step time, parameters/s and GB/s of state touched (fp32 param, grad, exp_avg,
exp_avg_sq read + param, exp_avg, exp_avg_sq written = 28 bytes per parameter).

    python bench/bench_cpu_adam.py                      # 1e6, 1e7, 1e8 elements
    python bench/bench_cpu_adam.py --sizes 1e6 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from typing import Dict, List

import torch

BYTES_PER_PARAM = 7 * 4  # 4 fp32 tensors read, 3 written
IMPLEMENTATIONS = {"single-tensor": dict(foreach=False), "foreach": dict(foreach=True),
                   "fused": dict(fused=True)}


def time_step(numel: int, options: Dict[str, bool], repeats: int) -> List[float]:
    """Seconds of each of `repeats` AdamW steps over one fp32 shard of `numel` (one warm-up,
    which also allocates the state)."""
    g = torch.Generator().manual_seed(0)
    master = torch.nn.Parameter(torch.randn(numel, generator=g))
    master.grad = torch.randn(numel, generator=g)
    optimizer = torch.optim.AdamW([master], lr=1e-4, weight_decay=0.1, **options)
    optimizer.step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7, 1e8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS),
                   choices=list(IMPLEMENTATIONS))
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for cpu_adam.json")
    args = p.parse_args()
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")
    print("| elements | implementation | step ms (median) | Mparams/s | GB/s of state |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        numel = int(size)
        for name in args.implementations:
            median = statistics.median(time_step(numel, IMPLEMENTATIONS[name], args.repeats))
            row = dict(elements=numel, implementation=name, step_s=median,
                       params_per_s=numel / median,
                       gb_per_s=numel * BYTES_PER_PARAM / median / 1e9)
            rows.append(row)
            print(f"| {numel:.0e} | {name} | {1e3 * median:.2f} | "
                  f"{row['params_per_s'] / 1e6:,.0f} | {row['gb_per_s']:.2f} |", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cpu_adam.json"), "w") as f:
            json.dump(dict(torch=torch.__version__, threads=torch.get_num_threads(),
                           date=datetime.now(timezone.utc).isoformat(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
