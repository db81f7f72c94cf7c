"""A mixture-of-experts layer's time against a dense MLP of equal active size (issue 27 / 33).

For each shape: tokens x hidden through the router (a bias-free linear to E logits, softmax
top-k) and gigatron's RoutedExperts (SwiGLU experts of ffn f), once with the expert matmuls
as one grouped matmul (torch._grouped_mm, --moe-grouped-gemm) and once as a loop over the
experts; beside it a dense SwiGLU MLP of ffn topk x f, which does the same matmul FLOPs per
token as the routed experts. Forward + backward, bf16, median of device-event-timed runs;
TFLOP/s counts the expert (or dense) matmuls only (6 x 3 x h x ffn per token for fwd + bwd).
Correctness first: the grouped and loop paths must agree on fresh random inputs.

    python bench/bench_moe.py                       # GPU shapes (Mixtral-, Qwen3-MoE-like)
    python bench/bench_moe.py --device cpu --tiny   # every path, tiny, on the CPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from gigatron.models.moe.experts import RoutedExperts
from gigatron.models.moe.router import RouterConfig, route

# (name, tokens, hidden, expert ffn, experts, topk)
SHAPES = [("mixtral-like", 8192, 4096, 14336, 8, 2),
          ("qwen3-moe-like", 8192, 2048, 768, 128, 8),
          ("deepseek-like", 8192, 2048, 1408, 64, 6)]
TINY = [("tiny", 64, 32, 48, 4, 2)]


def _timed(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of fn (device events on a GPU, the host clock on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class DenseSwiGLU(torch.nn.Module):
    """The dense reference: one SwiGLU MLP of the given ffn, no biases."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, 2 * ffn, bias=False, dtype=dtype, device=device)
        self.fc2 = torch.nn.Linear(ffn, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


def moe_forward(router: torch.nn.Linear, experts: RoutedExperts, config: RouterConfig,
                x: torch.Tensor) -> torch.Tensor:
    probs, routing_map = route(router(x).float(), config)
    return experts(x, probs.to(x.dtype), routing_map)


def bench_shape(name: str, tokens: int, hidden: int, ffn: int, experts: int, topk: int,
                device: torch.device, dtype: torch.dtype, warmup: int, iters: int) -> Dict:
    torch.manual_seed(0)
    config = RouterConfig(num_experts=experts, topk=topk)
    router = torch.nn.Linear(hidden, experts, bias=False, dtype=dtype, device=device)
    moe = RoutedExperts(experts, hidden, ffn, grouped_gemm=True, params_dtype=dtype,
                        device=device)
    dense = DenseSwiGLU(hidden, topk * ffn, dtype, device)
    x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(tokens, hidden, dtype=dtype, device=device)
    grouped_runs = moe.uses_grouped_mm(x)

    # correctness: grouped and loop agree (forward and the input grad) on fresh inputs
    def out_and_grad(grouped: bool):
        moe.grouped_gemm = grouped
        x.grad = None
        y = moe_forward(router, moe, config, x)
        y.backward(dy)
        return y.detach().float(), x.grad.detach().float()

    (y_g, dx_g), (y_l, dx_l) = out_and_grad(True), out_and_grad(False)
    rel = max(((a - b).norm() / b.norm()).item() for a, b in ((y_g, y_l), (dx_g, dx_l)))

    def step(run: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def fn() -> None:
            x.grad = None
            run().backward(dy)
        return fn

    times = {}
    for grouped in (True, False):
        moe.grouped_gemm = grouped
        times["grouped" if grouped else "loop"] = _timed(
            step(lambda: moe_forward(router, moe, config, x)), device, warmup, iters)
    times["dense"] = _timed(step(lambda: dense(x)), device, warmup, iters)
    flops = 6 * 3 * hidden * topk * ffn * tokens  # fwd + bwd of the three matrices, active
    return dict(shape=name, tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, topk=topk,
                grouped_mm_runs=grouped_runs, grouped_vs_loop_rel_err=rel,
                **{f"{k}_ms": 1e3 * v for k, v in times.items()},
                **{f"{k}_tflops": flops / v / 1e12 for k, v in times.items()},
                moe_over_dense=times["grouped"] / times["dense"])


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = [bench_shape(*shape, device=device, dtype=dtype, warmup=args.warmup,
                           iters=args.iters) for shape in (TINY if args.tiny else SHAPES)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_moe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(device) if device.type == "cuda"
                       else "cpu", torch=torch.__version__, results=results), f, indent=1)
    print("| shape | tokens | h | f | E | topk | grouped_mm | rel err (grouped vs loop) | "
          "grouped ms | loop ms | dense (topk x f) ms | MoE / dense | grouped TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['tokens']} | {r['hidden']} | {r['ffn']} | {r['experts']} | "
              f"{r['topk']} | {r['grouped_mm_runs']} | {r['grouped_vs_loop_rel_err']:.1e} | "
              f"{r['grouped_ms']:.2f} | {r['loop_ms']:.2f} | {r['dense_ms']:.2f} | "
              f"{r['moe_over_dense']:.2f} | {r['grouped_tflops']:.1f} |")
    bad = [r["shape"] for r in results if not r["grouped_vs_loop_rel_err"] < 2e-2]
    if bad:
        print(f"grouped and loop paths disagree on {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
