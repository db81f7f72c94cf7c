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

--parts exchange: one MoE layer's forward + backward on --ep forked gloo ranks (the alltoall
dispatcher over all of them), routing forced uniform; the all-to-all bytes each rank sends,
read from parallel/comm's counters, must equal the formula
4 x tokens x topk x h x bytes x (ep - 1) / ep (dispatch and combine, forward and backward).
--parts train: a tiny MoE GPT and the dense GPT of the same active parameters (ffn = topk x
the expert ffn) trained side by side through the trainer's step (training/run/loop.py's
train_step on the run's own builders): tokens/s of each, as a table.

    python bench/bench_moe.py --parts exchange train --device cpu
    python bench/bench_moe.py --parts train --train-models mixtral-like deepseek-v3-like

--train-models deepseek-v3-like: multi-latent attention in both models, one shared expert
and sigmoid routing with the expert bias in the MoE one (its dense twin: ffn (topk + 1) x f).
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

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(BENCH_DIR, "..", "tests"))
sys.path.insert(0, BENCH_DIR)
from multirank import run_on_ranks  # noqa: E402
from train_paths import build_gigatron  # noqa: E402

from gigatron.models.config import TransformerConfig  # noqa: E402
from gigatron.models.moe.experts import RoutedExperts  # noqa: E402
from gigatron.models.moe.router import RouterConfig, route  # noqa: E402

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


def exchange_formula(tokens: int, topk: int, hidden: int, nbytes: int, ep: int) -> int:
    """All-to-all bytes one rank sends per MoE layer and step under uniform routing: dispatch
    and combine, forward and backward, each (ep - 1) / ep of the tokens' top-k rows."""
    return 4 * tokens * topk * hidden * nbytes * (ep - 1) // ep


def _exchange_rank(rank: int, world: int, tokens: int, hidden: int, experts: int,
                   topk: int) -> Dict:
    """One MoE layer's forward + backward over all `world` ranks as ep; bytes counted."""
    from gigatron.models.moe.layer import MoELayer
    from gigatron.parallel import comm
    from gigatron.parallel.expert.dispatchers import expert_dispatcher_factory

    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=1, ffn_hidden_size=hidden,
        vocab_size=64, seq_length=tokens,
        activation="swiglu", add_bias_linear=False, num_moe_experts=experts,
        moe_router_topk=topk, moe_ffn_hidden_size=hidden, hidden_dropout=0.0,
        attention_dropout=0.0)
    layer = MoELayer(config, dispatcher_factory=expert_dispatcher_factory(
        "alltoall", torch.distributed.group.WORLD))
    # token t picks experts t*topk .. t*topk + topk - 1 (mod E): every rank sends each
    # expert the same number of rows, the uniform routing the formula assumes
    picks = (torch.arange(tokens)[:, None] * topk + torch.arange(topk)) % experts
    x = torch.zeros(tokens, hidden)
    x.scatter_(1, picks, 4.0)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(experts, hidden))
    x = x.view(tokens, 1, hidden).requires_grad_()
    comm.stats.reset()
    layer(x).sum().backward()
    return dict(sent=comm.stats.bytes.get("all_to_all", 0),
                tokens_per_expert=layer.stats_tokens_per_expert.tolist())


def bench_exchange(eps: List[int], tokens: int, hidden: int, experts: int,
                   topk: int) -> List[Dict]:
    """Measured all-to-all bytes per rank (forked gloo ranks, fp32) beside the formula."""
    rows = []
    for ep in eps:
        results = run_on_ranks(_exchange_rank, ep, tokens, hidden, experts, topk, timeout=300)
        rows.append(dict(ep=ep, tokens=tokens, hidden=hidden, experts=experts, topk=topk,
                         measured=[r["sent"] for r in results],
                         formula=exchange_formula(tokens, topk, hidden, 4, ep)))
    return rows


TRAIN_MODELS = ("mixtral-like", "deepseek-v3-like")


def _deepseek_attention(h: int) -> List[str]:
    """DeepSeek-V3's multi-latent attention scaled to hidden h: heads of 128 query/key
    channels + 64 rotated, values 128, key/value latent 4 x 128, query latent 12 x 128 (at
    h < 1024 heads of 16 on the same ratios)."""
    head = 128 if h >= 1024 else 16
    return ["--multi-latent-attention", "--num-attention-heads", str(max(1, h // head)),
            "--qk-head-dim", str(head), "--qk-pos-emb-head-dim", str(head // 2),
            "--v-head-dim", str(head), "--kv-lora-rank", str(4 * head),
            "--q-lora-rank", str(12 * head)]


def _train_flags(moe: bool, args: argparse.Namespace, family: str = "mixtral-like"
                 ) -> List[str]:
    """A Llama-shaped GPT: MoE (E experts of ffn f, top-k) or dense of ffn k x f.
    deepseek-v3-like adds multi-latent attention (both), one shared expert of ffn f and
    sigmoid routing with the aux-loss-free expert bias (its dense twin: ffn (k + 1) x f)."""
    h, f, k = args.train_hidden, args.train_expert_ffn, args.train_topk
    deepseek = family == "deepseek-v3-like"
    dense_ffn = (k + 1) * f if deepseek else k * f
    mlp = ["--num-experts", str(args.train_experts), "--moe-router-topk", str(k),
           "--moe-ffn-hidden-size", str(f), "--ffn-hidden-size", str(dense_ffn),
           "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm"] if moe else \
        ["--ffn-hidden-size", str(dense_ffn)]
    if moe and deepseek:
        mlp += ["--moe-shared-expert-intermediate-size", str(f),
                "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    attention = _deepseek_attention(h) if deepseek else \
        ["--num-attention-heads", str(max(1, h // 64))]
    return ["--num-layers", str(args.train_layers), "--hidden-size", str(h)] + attention + [
            "--seq-length", str(args.seq_length),
            "--max-position-embeddings", str(args.seq_length), "--micro-batch-size",
            str(args.train_micro_batch), "--global-batch-size", str(args.train_micro_batch),
            "--vocab-size", "1024", "--swiglu", "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--train-iters", "1000000", "--lr", "1e-4",
            "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234"
            ] + (["--bf16"] if args.device == "cuda" else []) + mlp


def bench_train(args: argparse.Namespace, device: torch.device) -> List[Dict]:
    """tokens/s of the MoE GPT and its dense twin through the trainer's step (median of
    interleaved steps)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return _train_rows(args, device)
    # a private one-rank group (see bench_train_gpu.py), left again for the caller
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store,
                            rank=0, world_size=1)
    try:
        return _train_rows(args, device)
    finally:
        dist.destroy_process_group()


def _train_rows(args: argparse.Namespace, device: torch.device) -> List[Dict]:
    return [row for family in args.train_models for row in _train_family(args, device, family)]


def _train_family(args: argparse.Namespace, device: torch.device, family: str) -> List[Dict]:
    rows, steps = [], {}
    for name, moe in (("moe", True), ("dense", False)):
        session, step = build_gigatron(_train_flags(moe, args, family), device)
        model = session.chunks[0]
        total = sum(p.numel() for p in model.parameters())
        inactive = 0
        if moe:
            experts = [m.experts for m in model.modules() if hasattr(m, "experts")
                       and isinstance(m.experts, RoutedExperts)]
            per_expert = sum(e.weight1[0].numel() + e.weight2[0].numel() for e in experts)
            inactive = per_expert * (args.train_experts - args.train_topk)
        rows.append(dict(model=name, family=family, parameters=total,
                         active_parameters=total - inactive))
        steps[name] = step
    g = torch.Generator().manual_seed(0)
    shape = (args.train_micro_batch, args.seq_length + 1)
    tokens = torch.randint(0, 1024, shape, generator=g).to(device)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    # one step of each in turn, so that a load on the machine falls on both alike
    times: Dict[str, List[float]] = {row["model"]: [] for row in rows}
    for i in range(args.warmup + args.iters):
        for name, step in steps.items():
            seconds = _timed(lambda: step(*batch), device, 0, 1)
            if i >= args.warmup:
                times[name].append(seconds)
    for row in rows:
        row["seconds"] = statistics.median(times[row["model"]])
        row["tokens_per_s"] = batch[0].numel() / row["seconds"]
    steps.clear()  # the next family's models build on a freed device
    return rows


def _print_tables(kernels: List[Dict], exchange: List[Dict], train: List[Dict]) -> None:
    if kernels:
        print("| shape | tokens | h | f | E | topk | grouped_mm | rel err (grouped vs loop) | "
              "grouped ms | loop ms | dense (topk x f) ms | MoE / dense | grouped TFLOP/s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in kernels:
        print(f"| {r['shape']} | {r['tokens']} | {r['hidden']} | {r['ffn']} | {r['experts']} | "
              f"{r['topk']} | {r['grouped_mm_runs']} | {r['grouped_vs_loop_rel_err']:.1e} | "
              f"{r['grouped_ms']:.2f} | {r['loop_ms']:.2f} | {r['dense_ms']:.2f} | "
              f"{r['moe_over_dense']:.2f} | {r['grouped_tflops']:.1f} |")
    if exchange:
        print("\n| ep | tokens/rank | h | E | topk | all-to-all bytes sent per rank (measured) "
              "| formula 4 T k h B (ep-1)/ep |\n|---|---|---|---|---|---|---|")
    for r in exchange:
        print(f"| {r['ep']} | {r['tokens']} | {r['hidden']} | {r['experts']} | {r['topk']} | "
              f"{', '.join(map(str, r['measured']))} | {r['formula']} |")
    if train:
        print("\n| family | model | parameters | active parameters | step ms | tokens/s |\n"
              "|---|---|---|---|---|---|")
    for r in train:
        print(f"| {r['family']} | {r['model']} | {r['parameters']:,} | "
              f"{r['active_parameters']:,} | "
              f"{1e3 * r['seconds']:.1f} | {r['tokens_per_s']:,.0f} |")


def parse_args(argv: List[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["kernels"],
                   choices=("kernels", "exchange", "train"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="kernels: the tiny shape only")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="exchange: ranks")
    p.add_argument("--exchange-tokens", type=int, default=64)
    p.add_argument("--exchange-hidden", type=int, default=32)
    p.add_argument("--exchange-experts", type=int, default=8)
    p.add_argument("--exchange-topk", type=int, default=2)
    p.add_argument("--train-models", nargs="+", default=["mixtral-like"], choices=TRAIN_MODELS,
                   help="train: each family's MoE GPT beside its dense twin")
    p.add_argument("--train-layers", type=int, default=4)
    p.add_argument("--train-hidden", type=int, default=256)
    p.add_argument("--train-expert-ffn", type=int, default=256)
    p.add_argument("--train-experts", type=int, default=8)
    p.add_argument("--train-topk", type=int, default=2)
    p.add_argument("--train-micro-batch", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    return p.parse_args(argv)


def main(argv: List[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernels = [bench_shape(*shape, device=device, dtype=dtype, warmup=args.warmup,
                           iters=args.iters) for shape in (TINY if args.tiny else SHAPES)
               ] if "kernels" in args.parts else []
    exchange = bench_exchange(args.ep, args.exchange_tokens, args.exchange_hidden,
                              args.exchange_experts, args.exchange_topk) \
        if "exchange" in args.parts else []
    train = bench_train(args, device) if "train" in args.parts else []
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_moe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(device) if device.type == "cuda"
                       else "cpu", torch=torch.__version__, results=kernels,
                       exchange=exchange, train=train), f, indent=1)
    _print_tables(kernels, exchange, train)
    bad = [r["shape"] for r in kernels if not r["grouped_vs_loop_rel_err"] < 2e-2]
    if bad:
        print(f"grouped and loop paths disagree on {bad}", file=sys.stderr)
    wrong = [r["ep"] for r in exchange if any(m != r["formula"] for m in r["measured"])]
    if wrong:
        print(f"all-to-all bytes differ from the formula at ep {wrong}", file=sys.stderr)
    return 1 if bad or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
