#!/usr/bin/env python
"""Pipeline schedules: bubble fraction and activation memory, simulated vs the formulas.

    python bench/bench_pipeline.py                               # pp 2 4 8, m = 1/2/4/8 x pp
    python bench/bench_pipeline.py --pp 4 --m-factors 1 2 --virtual 2 4 8

Pure: no processes. For each pipeline size p and number of micro-batches m, every rank's
schedule from `gigatron.parallel.pipeline.schedules` (1F1B, and interleaved 1F1B with v
chunks per rank) runs through `simulate.simulate` with a whole-stage forward of 1 and
backward of 2 time units (a chunk of an interleaved stage takes 1/v of that; communication
is free). Bubble = rank 0's idle share of the step, next to (p-1)/(m+p-1) for 1F1B and
(p-1)/(v·m+p-1) for interleaved. Peak in flight = the most forwards rank 0 holds whose
backward has not run (each keeps its activations), counted in whole-stage micro-batches
(an interleaved chunk's forward counts 1/v), next to min(m, p) for 1F1B and
min(m·v, 2(p-1) + (v-1)p + 1)/v for interleaved (Megatron's warm-up plus one).
"""
from __future__ import annotations

import argparse
import time
from typing import List, Optional, Tuple

from gigatron.parallel.pipeline.schedules import (Backward, Forward, interleaved_one_f_one_b,
                                                  one_f_one_b)
from gigatron.parallel.pipeline.simulate import simulate


def schedules(pp: int, m: int, v: int) -> List[list]:
    """Every rank's instruction list: 1F1B for v == 1, interleaved 1F1B otherwise."""
    if v == 1:
        return [one_f_one_b(r, pp, m) for r in range(pp)]
    return [interleaved_one_f_one_b(r, pp, m, v) for r in range(pp)]


def peak_in_flight(instructions: list) -> int:
    """Most (micro-batch, chunk) forwards held at once before their backward."""
    held = peak = 0
    for ins in instructions:
        if isinstance(ins, Forward):
            held += 1
            peak = max(peak, held)
        elif isinstance(ins, Backward):
            held -= 1
    return peak


def bubble_formula(pp: int, m: int, v: int) -> float:
    return (pp - 1) / (v * m + pp - 1)


def peak_formula(pp: int, m: int, v: int) -> float:
    if v == 1:
        return min(m, pp)
    if m == pp:  # Megatron runs every forward first when m == p
        return m
    return min(m * v, 2 * (pp - 1) + (v - 1) * pp + 1) / v


def measure(pp: int, m: int, v: int) -> Optional[Tuple[float, float]]:
    """(bubble fraction of rank 0, peak in-flight whole-stage micro-batches on rank 0)."""
    if v > 1 and m % pp:
        return None
    plans = schedules(pp, m, v)
    result = simulate(plans, forward_time=1.0 / v, backward_time=2.0 / v)
    return result.bubble_fraction(0), peak_in_flight(plans[0]) / v


def table(pps: List[int], factors: List[int], virtuals: List[int]) -> str:
    """Markdown table: one row per (p, m), bubble then peak per schedule."""
    names = ["1F1B"] + [f"interleaved v={v}" for v in virtuals]
    vs = [1] + virtuals
    head = (["p", "m"] + [f"bubble {n} (formula)" for n in names]
            + [f"peak in flight {n} (formula)" for n in names])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for pp in pps:
        for f in factors:
            m = f * pp
            got = [measure(pp, m, v) for v in vs]
            bubbles = [f"{g[0]:.3f} ({bubble_formula(pp, m, v):.3f})" if g else "-"
                       for g, v in zip(got, vs)]
            peaks = [f"{g[1]:g} ({peak_formula(pp, m, v):g})" if g else "-"
                     for g, v in zip(got, vs)]
            rows.append("| " + " | ".join([str(pp), str(m)] + bubbles + peaks) + " |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--m-factors", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="micro-batches per step as multiples of pp")
    p.add_argument("--virtual", type=int, nargs="+", default=[2, 4],
                   help="chunks per rank for the interleaved schedule")
    args = p.parse_args(argv)
    if min(args.pp + args.m_factors) < 1 or min(args.virtual) < 2:
        p.error("--pp and --m-factors must be >= 1, --virtual >= 2")
    start = time.perf_counter()
    print("forward 1, backward 2 per whole stage and micro-batch; communication free; "
          "rank 0\n")
    print(table(args.pp, args.m_factors, args.virtual))
    print(f"\n{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
