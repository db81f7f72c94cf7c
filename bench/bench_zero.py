#!/usr/bin/env python
"""ZeRO stages 0-3: per-rank memory and per-step communication, measured vs the ZeRO paper.

    python bench/bench_zero.py                         # dp=4, 8 layers x hidden 256, fp32 + bf16
    python bench/bench_zero.py --dp 2 --dtypes fp32 --layers 4 --hidden 128
    python bench/bench_zero.py --model gpt2-124m --seq 128   # a zoo model (slow on a laptop)

On `--dp` forked gloo ranks (tests/multirank.py's run_on_ranks) a GPT model is trained with
AdamW for `--steps` timed steps (after one warm-up step) at each ZeRO stage. Per rank it
reports the bytes `gigatron.parallel.zero.measure_memory` counts (params, fp32 grads, fp32
master weights, Adam moments; activations are not counted) after the step, next to
`zero_memory_formula`, and the bytes the step sent in dp collectives (`comm.stats`, ring
convention) next to `zero_comm_bytes_formula` (gradients travel in fp32, parameters in their dtype).
Step time is the median over the timed steps on rank 0: on CPU/gloo with ranks sharing
cores it is only indicative.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from multirank import run_on_ranks  # noqa: E402

from gigatron.models.config import TransformerConfig  # noqa: E402
from gigatron.models.gpt import GPTModel  # noqa: E402
from gigatron.parallel import comm  # noqa: E402
from gigatron.parallel.zero import (ZeroConfig, build_zero, measure_memory,  # noqa: E402
                                    zero_comm_bytes_formula, zero_memory_formula)

PARAM_BYTES = {"fp32": 4, "bf16": 2}


def model_config(args: argparse.Namespace, dtype: str) -> TransformerConfig:
    """The benchmark model: a zoo entry (with --seq) or the custom size from the flags."""
    common = dict(seq_length=args.seq, hidden_dropout=0.0, attention_dropout=0.0,
                  params_dtype=dtype)
    if args.model:
        from gigatron.models.zoo import load_config
        return load_config(args.model, max_position_embeddings=max(args.seq, 1), **common)
    return TransformerConfig(num_layers=args.layers, hidden_size=args.hidden,
                             num_attention_heads=args.heads, vocab_size=args.vocab,
                             max_position_embeddings=args.seq, **common)


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    """Train each (dtype, stage) case; return memory, comm bytes and step times per case."""
    out = {}
    g = torch.Generator().manual_seed(rank)
    for dtype in args.dtypes:
        config = model_config(args, dtype)
        for stage in args.stages:
            model = GPTModel(config, seed=1234)
            zero = build_zero(model, ZeroConfig(zero_stage=stage, lr=1e-4,
                                                reduce_bucket_size=args.bucket))
            times, sent = [], {}
            for step in range(args.steps + 1):
                tokens = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq + 1),
                                       generator=g)
                comm.barrier()
                comm.stats.reset()
                start = time.perf_counter()
                zero.zero_grad()
                zero.backward(model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).mean())
                assert zero.step().success
                if step:  # step 0 is the warm-up
                    times.append(time.perf_counter() - start)
                sent = comm.stats.snapshot()
            out[(dtype, stage)] = {
                "memory": measure_memory(zero), "comm": sent, "time": times,
                "numel": sum(p.numel() for p in model.parameters())}
            del model, zero
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}" if n >= 1024 else f"{n:.0f} B"


def table(res: dict, args: argparse.Namespace) -> str:
    """Markdown table of rank 0's results."""
    rows = ["| dtype | stage | params MiB | grads MiB | master+Adam MiB | total MiB (formula) "
            "| vs stage 0 (formula) | comm MiB/step (formula) | by collective MiB "
            "| step ms |", "|" + "---|" * 10]
    for dtype in args.dtypes:
        base = res[(dtype, args.stages[0])]["memory"].total
        base_f = zero_memory_formula(res[(dtype, args.stages[0])]["numel"], args.dp,
                                     args.stages[0], param_bytes=PARAM_BYTES[dtype]).total
        for stage in args.stages:
            r = res[(dtype, stage)]
            m = r["memory"]
            f = zero_memory_formula(r["numel"], args.dp, stage, param_bytes=PARAM_BYTES[dtype])
            cf = zero_comm_bytes_formula(r["numel"], args.dp, stage, grad_bytes=4,
                                         param_bytes=PARAM_BYTES[dtype])
            parts = ", ".join(f"{k.replace('_', '-')} {mib(v)}"
                              for k, v in sorted(r["comm"].items()))
            rows.append(
                f"| {dtype} | {stage} | {mib(m.params)} | {mib(m.grads)} | "
                f"{mib(m.master_params + m.optimizer_state)} | {mib(m.total)} ({mib(f.total)}) "
                f"| {m.total / base:.3f} ({f.total / base_f:.3f}) | "
                f"{mib(sum(r['comm'].values()))} ({mib(cf)}) | {parts} | "
                f"{1e3 * statistics.median(r['time']):.0f} |")
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=4, help="data-parallel ranks (forked, gloo)")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(PARAM_BYTES))
    p.add_argument("--model", default="", help="zoo model name (overrides the size flags)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up")
    p.add_argument("--bucket", type=int, default=2_000_000, help="reduce_bucket_size")
    args = p.parse_args(argv)
    if args.dp < 1 or args.steps < 1:
        p.error("--dp and --steps must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    res = run_on_ranks(_rank, args.dp, args, timeout=600)[0]
    numel = res[(args.dtypes[0], args.stages[0])]["numel"]
    print(f"GPT {args.model or f'{args.layers} layers x hidden {args.hidden}, vocab {args.vocab}'}"
          f", seq {args.seq}: {numel:,} parameters; dp={args.dp} gloo ranks on "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}; rank 0, AdamW\n")
    print(table(res, args))
    off = max(abs(r["memory"].total / zero_memory_formula(
        r["numel"], args.dp, s, param_bytes=PARAM_BYTES[d]).total - 1) for (d, s), r in res.items())
    print(f"\nlargest |measured / formula - 1| of a total: {off:.2e} (padding to a multiple "
          f"of dp per bucket)")
    print(f"\nwhole benchmark {time.perf_counter() - start:.1f} s wall")


if __name__ == "__main__":
    main()
