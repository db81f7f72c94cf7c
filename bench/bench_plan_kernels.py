"""The planner's kernel model against the GPU (issue 32): every published run's per-rank GEMMs
and attention, timed here, beside the time `gigatron plan` gives them.

    python bench/bench_plan_kernels.py [--iters 10] [--json OUT.json]

For each row of training/plan/published.py, on one GPU, at that row's per-tp-rank shapes
(tokens = sequence x micro-batch): each linear layer's forward, dgrad and wgrad GEMM (bf16,
torch.matmul, i.e. cuBLAS), the logits GEMM, and the fused causal attention (torch's
scaled_dot_product_attention, forward and backward) with the row's attention dropout and
without. The prediction is gemm.py's wave model at this device's measured 8192^3 ceiling
(so the shape model is checked, not the device's peak) and cost.py's attention term at
this device's dense peak. Median of CUDA-event-timed runs; prints a markdown table and
writes JSON (default $OUT/bench_plan_kernels.json).
"""
import argparse
import json
import os
import sys
from typing import Dict, List

import torch
import torch.nn.functional as F

from ceilings import matmul_tflops, median_ms  # bench/ is the script's folder: on sys.path

from gigatron.training.plan import cost, gemm
from gigatron.training.plan.published import ROWS, predict


def time_linear(tokens: int, k: int, n: int, iters: int) -> Dict[str, float]:
    """Milliseconds of y = x W's three GEMMs: forward, dgrad (dy W^T), wgrad (x^T dy)."""
    dt = torch.bfloat16
    x = torch.randn(tokens, k, device="cuda", dtype=dt)
    w = torch.randn(k, n, device="cuda", dtype=dt)
    dy = torch.randn(tokens, n, device="cuda", dtype=dt)
    return dict(fwd=median_ms(lambda: x @ w, iters), dgrad=median_ms(lambda: dy @ w.t(), iters),
                wgrad=median_ms(lambda: x.t() @ dy, iters))


def time_attention(batch: int, heads: int, groups: int, seq: int, dim: int, dropout: float,
                   iters: int) -> Dict[str, float]:
    """Milliseconds of causal SDPA forward and backward (q: batch x heads x seq x dim; k, v
    with `groups` heads, expanded as the model does)."""
    dt = torch.bfloat16
    q = torch.randn(batch, heads, seq, dim, device="cuda", dtype=dt, requires_grad=True)
    k, v = (torch.randn(batch, groups, seq, dim, device="cuda", dtype=dt, requires_grad=True)
            for _ in range(2))
    rep = heads // groups

    def forward() -> torch.Tensor:
        kk = k if rep == 1 else k.repeat_interleave(rep, dim=1)
        vv = v if rep == 1 else v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, kk, vv, dropout_p=dropout, is_causal=True)

    out = forward()
    grad = torch.randn_like(out)

    def both() -> None:
        forward().backward(grad)

    fwd = median_ms(forward, iters)
    total = median_ms(both, iters)
    return dict(fwd=fwd, bwd=total - fwd)


def predicted_linear_ms(tokens: int, k: int, n: int, rate: float, sms: int) -> Dict[str, float]:
    """gemm.py's time for the same three GEMMs at `rate` FLOP/s for a full wave."""
    flops = 2.0 * tokens * k * n
    return dict(fwd=flops / (rate * gemm.wave_efficiency(tokens, n, sms)) * 1e3,
                dgrad=flops / (rate * gemm.wave_efficiency(tokens, k, sms)) * 1e3,
                wgrad=flops / (rate * gemm.wave_efficiency(k, n, sms)) * 1e3)


def bench_row(row, rate: float, peak: float, hbm: float, sms: int, iters: int) -> Dict:
    """One published row's per-rank kernels: measured and predicted milliseconds."""
    plan = predict(row)
    c, p, t = plan.run.model, plan.run.parallel, plan.run.train
    tokens = c.seq_length * t.micro_batch_size
    vocab = c.padded_vocab_size(p.tp) // p.tp
    linears = []
    for k, n in gemm.layer_shapes(c, p.tp) + ((c.hidden_size, vocab),):
        measured = time_linear(tokens, k, n, iters)
        predicted = predicted_linear_ms(tokens, k, n, rate, sms)
        linears.append(dict(k=k, n=n, measured=measured, predicted=predicted))
    fl = cost._layer_flops(c, tokens, p.tp)
    by = cost._layer_bytes(c, tokens, p.tp, False, True)
    core_ms = (fl["core"] / (peak * 1e12 * cost.ATTENTION_EFFICIENCY) +
               by["core"] / (hbm * 1e9 * cost.MEMORY_EFFICIENCY)) * 1e3
    heads, groups = c.num_attention_heads // p.tp, c.num_query_groups // p.tp
    attention = {f"dropout_{drop}": time_attention(t.micro_batch_size, heads, groups,
                                                   c.seq_length, c.head_dim, drop, iters)
                 for drop in sorted({0.0, c.attention_dropout})}
    return dict(row=f"{row.label} ({row.note})", tp=p.tp, tokens=tokens, hidden=c.hidden_size,
                heads=heads, head_dim=c.head_dim, seq=c.seq_length,
                attention_dropout=c.attention_dropout, hidden_dropout=c.hidden_dropout,
                linears=linears, attention=attention,
                attention_predicted=dict(fwd=core_ms, bwd=2 * core_ms))


def table(results: List[Dict]) -> str:
    """Markdown: per row, the layer's GEMMs and attention, measured vs predicted (ms)."""
    lines = ["| row | tp | layer GEMMs ms (meas / pred) | logits GEMMs | attention fwd+bwd "
             "(meas, no dropout / with / pred) |", "|---|---|---|---|---|"]
    for r in results:
        layer = r["linears"][:-1]
        meas = sum(sum(x["measured"].values()) for x in layer)
        pred = sum(sum(x["predicted"].values()) for x in layer)
        lm, lp = (sum(r["linears"][-1][key].values()) for key in ("measured", "predicted"))
        att = {k: v["fwd"] + v["bwd"] for k, v in r["attention"].items()}
        a_pred = r["attention_predicted"]["fwd"] + r["attention_predicted"]["bwd"]
        with_drop = att.get(f"dropout_{r['attention_dropout']}", att["dropout_0.0"])
        lines.append(f"| {r['row']} | {r['tp']} | {meas:.3f} / {pred:.3f} ({meas / pred - 1:+.1%})"
                     f" | {lm:.2f} / {lp:.2f} ({lm / lp - 1:+.1%}) | {att['dropout_0.0']:.3f} / "
                     f"{with_drop:.3f} / {a_pred:.3f} ({att['dropout_0.0'] / a_pred - 1:+.1%}) |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=10, help="timed runs per kernel (median)")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                       "bench_plan_kernels.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_plan_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    rate = matmul_tflops(args.iters) * 1e12
    # the device's datasheet row: its dense bf16 peak and HBM bandwidth (H100 SXM / H200)
    from gigatron.training.observe.devices import hardware
    hw = hardware("h200" if "H200" in props.name else "h100-sxm")
    peak, hbm = hw.peak("bf16") or 989.4, hw.hbm_gbps or 3350.0
    results, seen = [], set()
    for row in ROWS:
        plan = predict(row)  # rows of the same per-rank shapes are timed once
        c, p, t = plan.run.model, plan.run.parallel, plan.run.train
        key = (c.hidden_size, c.ffn_hidden_size, c.num_attention_heads, c.num_query_groups,
               c.seq_length, c.padded_vocab_size(p.tp), p.tp, t.micro_batch_size)
        if key in seen:
            continue
        seen.add(key)
        torch.cuda.empty_cache()
        results.append(bench_row(row, rate, peak, hbm, props.multi_processor_count, args.iters))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    with open(args.json, "w") as f:
        json.dump(dict(device=props.name, sms=props.multi_processor_count,
                       torch=torch.__version__, ceiling_tflops=rate / 1e12, peak_tflops=peak,
                       results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
