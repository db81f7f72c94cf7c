#!/usr/bin/env python
"""Muon's optimizer step per layout: time and bytes moved, measured vs the plan's formula.

    python bench/bench_muon.py                       # 4 forked gloo ranks, a small GPT
    python bench/bench_muon.py --layers 4 --hidden 256 --steps 3

On 4 forked gloo ranks (tests/multirank.py) a GPT model (SwiGLU, GQA) takes `--steps` timed
Muon steps (after a warm-up) with fp32 iterations in each layout: dp4 at ZeRO stage 0 (every
rank orthogonalises every matrix), dp4 at stages 1 and 3 (the layer-wise scheme: matrices
owned over dp), tp2 x dp2 at stage 1 duplicated (owners gather over tp) and blockwise. Per
layout it reports the median step time on rank 0 (gloo on shared cores: indicative only), the
bytes rank 0 sent in the optimizer step by collective (`comm.stats`: all-to-all = the layer-
wise exchange, all_gather = ZeRO's parameter gather plus the tp gathers of duplicated), the
plan's formula for the exchange and the tp gathers (training/plan/muon.py: 2 x 4 bytes x the
shard's matrix elements x (n-1)/n; 4 bytes x each owned tp-split matrix x (tp-1)/tp), and the
plan's per-rank average of Newton-Schulz FLOPs. A CPU run's numbers are in docs/MUON.md
("Measured").
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
from gigatron.parallel.topology import ProcessGroups, Topology  # noqa: E402
from gigatron.parallel.zero import ZeroConfig, build_zero  # noqa: E402
from gigatron.parallel.zero.muon import MuonConfig  # noqa: E402
from gigatron.parallel.zero.muon.newton_schulz import newton_schulz_flops  # noqa: E402

# name -> (tp, zero stage, tp mode)
LAYOUTS = {"dp4_stage0": (1, 0, "duplicated"), "dp4_stage1": (1, 1, "duplicated"),
           "dp4_stage3": (1, 3, "duplicated"), "tp2_dp2_stage1": (2, 1, "duplicated"),
           "tp2_dp2_stage1_blockwise": (2, 1, "blockwise")}


def _config(args: argparse.Namespace) -> TransformerConfig:
    return TransformerConfig(num_layers=args.layers, hidden_size=args.hidden,
                             num_attention_heads=8, num_query_groups=2, vocab_size=256,
                             max_position_embeddings=args.seq, seq_length=args.seq,
                             activation="swiglu", hidden_dropout=0.0, attention_dropout=0.0)


def _formula(zero, tp: int) -> dict:
    """The plan's per-rank exchange and gather bytes and average FLOPs for this rank's groups."""
    exchange = gather = flops = 0.0
    for g, rule in zip(zero.flat_groups, zero.flat_rule):
        if rule != "muon":
            continue
        layout = zero.optimizer.layouts[id(g.master)]
        k, steps = g.ways, zero.config.muon.num_ns_steps
        n = sum(u.numel for u in layout.units)
        exchange += 8.0 * n * (k - 1) / k / k if k > 1 else 0.0
        whole = tp if zero.config.muon.tp_mode == "duplicated" else 1
        split = [u for u in layout.units if u.split is not None]
        gather += sum(4.0 * u.numel * whole * (tp - 1) / tp for u in split) / k \
            if whole > 1 else 0.0
        flops += sum(_unit_flops(u, whole, steps) for u in layout.units) / k
    return {"exchange": exchange, "gather": gather, "flops": flops}


def _unit_flops(u, whole: int, steps: int) -> float:
    rows, cols = (u.rows * whole, u.cols) if u.split is not None and u.split.dim == 0 \
        else (u.rows, u.cols * (whole if u.split is not None else 1))
    if u.qkv:
        groups = rows // sum(u.qkv)
        return sum(newton_schulz_flops(groups * r, cols, steps) for r in u.qkv)
    return newton_schulz_flops(rows, cols, steps)


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    out = {}
    g = torch.Generator().manual_seed(rank)
    config = _config(args)
    d = config.head_dim
    qkv = (config.num_attention_heads // config.num_query_groups * d, d, d)
    for name, (tp, stage, mode) in LAYOUTS.items():
        groups = ProcessGroups(Topology(tp=tp, dp=world // tp, pp=1), rank)
        model = GPTModel(config, tp_group=groups.tp, seed=1234)
        muon = MuonConfig(fp32_matmul_prec="highest", tp_mode=mode, qkv_split_shapes=qkv)
        zero = build_zero(model, ZeroConfig(zero_stage=stage, lr=1e-3, optimizer="muon",
                                            reduce_bucket_size=args.bucket, muon=muon),
                          groups)
        tokens = torch.randint(0, 256, (2, args.seq), generator=g)
        times, sent = [], {}
        for step in range(args.steps + 1):
            zero.zero_grad()
            loss = model(tokens, labels=tokens).float().mean()
            zero.backward(loss)
            zero.finish_sync()
            comm.stats.reset()
            start = time.perf_counter()
            zero.step()
            times.append(time.perf_counter() - start)
            sent = comm.stats.snapshot()
        out[name] = {"time": statistics.median(times[1:]), "sent": sent,
                     "formula": _formula(zero, tp)}
        del zero, model
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bucket", type=int, default=40_000)
    args = parser.parse_args(argv)
    results = run_on_ranks(_rank, 4, args, timeout=600)
    print(f"GPT {args.layers} layers x hidden {args.hidden} (SwiGLU, GQA 8/2), 4 gloo ranks, "
          f"rank 0's optimizer step:")
    print(f"{'layout':<26} {'step ms':>8} {'all_to_all':>11} {'formula':>9} "
          f"{'all_gather':>11} {'tp gather formula':>18} {'NS GFLOP avg':>13}")
    for name in LAYOUTS:
        r = results[0][name]
        f = r["formula"]
        print(f"{name:<26} {r['time'] * 1e3:>8.1f} {r['sent'].get('all_to_all', 0):>11,} "
              f"{f['exchange']:>9,.0f} {r['sent'].get('all_gather', 0):>11,} "
              f"{f['gather']:>18,.0f} {f['flops'] / 1e9:>13.3f}")


if __name__ == "__main__":
    main()
