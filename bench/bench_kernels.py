"""Build, check and time gigatron's fused kernels against torch eager on one GPU.

    python bench/bench_kernels.py [--quick] [--json OUT.json]
    python bench/bench_kernels.py --sweep-norms [--iters 30]   # time every norm launch variant
    python bench/bench_kernels.py --norms-only                 # the norms at their defaults
    python bench/bench_kernels.py --sweep-softmax [--iters 30] # every softmax forward variant

Measures the device copy bandwidth (bytes read + written by a large device-to-device copy)
as the ceiling, checks each kernel against an fp32 torch reference, then times forward and
backward (median of CUDA-event timings, inputs rotated so the L2 cache does not serve them)
for the kernel and for torch eager (F.layer_norm, F.rms_norm, masked_fill + softmax).
Prints a markdown table: times, speed-up over torch, and achieved bandwidth as % of copy.
--sweep-norms instead times each launch variant of the bf16 norm kernels (csrc/norm_variants.cuh)
side by side; a variant whose output or grads miss the tolerance is reported WRONG, not timed.
--sweep-softmax does the same for the bf16 softmax forward's launch variants (csrc/softmax.cu).
"""
import argparse
import json
import os
import statistics
import sys
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from gigatron.ops.build import load_kernels
from gigatron.ops.kernel_functions import NORM_VARIANTS

NORM_SHAPES = [(4096, 1024), (8192, 4096), (16384, 4096), (8192, 8192), (4096, 16384), (1024, 65536)]
# the last of each list is a 7B model's (32 heads, hidden 4096, seq 4096, micro-batch 1)
SOFTMAX_SHAPES = [(4, 16, 512, 512), (2, 16, 1024, 1024), (1, 32, 2048, 2048), (1, 8, 1024, 4096),
                  (1, 4, 512, 16384), (1, 32, 4096, 4096)]
CAUSAL_SHAPES = [(32, 1024, 1024), (32, 2048, 2048), (8, 4096, 4096), (32, 4096, 4096)]
ROTATE = 3
SWEEP_SHAPES = [(8192, 4096), (16384, 4096), (8192, 8192)]
SWEEP_SOFTMAX = [((1, 32, 2048, 2048), False), ((1, 32, 4096, 4096), False), ((32, 4096, 4096), True)]
SWEEP_TOL = 1e-2  # relative L2 error for bfloat16, as tests/test_ops_cuda.py


def time_ms(fn: Callable[[int], object], iters: int) -> float:
    """Median milliseconds of fn(i) over iters runs, after warm-up, timed with CUDA events."""
    for i in range(5):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(iters: int) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randn(256 << 20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda i: dst.copy_(src), iters)
    return 2 * src.numel() * 4 / ms / 1e6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_norm(kernels, rows: int, hidden: int, dtype: torch.dtype, rms: bool, iters: int) -> Dict:
    """Forward/backward of LayerNorm or RMSNorm: kernel (the launch variants gigatron runs,
    ops.kernel_functions.NORM_VARIANTS) vs torch eager."""
    fwd_variant, bwd_variant = NORM_VARIANTS
    xs = [torch.randn(rows, hidden, device="cuda", dtype=dtype) for _ in range(ROTATE)]
    dys = [torch.randn(rows, hidden, device="cuda", dtype=dtype) for _ in range(ROTATE)]
    w = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
    b = None if rms else torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)

    def torch_fwd(x):
        return F.rms_norm(x, (hidden,), w, 1e-5) if rms else F.layer_norm(x, (hidden,), w, b, 1e-5)

    wd, bd = w.detach(), None if rms else b.detach()
    saved = [kernels.norm_forward(x, wd, bd, 1e-5, rms, fwd_variant) for x in xs]
    x32 = xs[0].float()
    ref = (F.rms_norm(x32, (hidden,), wd.float(), 1e-5) if rms
           else F.layer_norm(x32, (hidden,), wd.float(), bd.float(), 1e-5))
    err = rel_err(saved[0][0], ref)
    params = [w] if rms else [w, b]
    k_fwd = time_ms(lambda i: kernels.norm_forward(xs[i % ROTATE], wd, bd, 1e-5, rms, fwd_variant), iters)
    t_fwd = time_ms(lambda i: torch_fwd(xs[i % ROTATE]), iters)
    k_bwd = time_ms(lambda i: kernels.norm_backward(dys[i % ROTATE], xs[i % ROTATE], wd, saved[i % ROTATE][1],
                                                    saved[i % ROTATE][2], rms, not rms, bwd_variant), iters)
    xg = [x.clone().requires_grad_() for x in xs]
    graphs = [torch_fwd(x) for x in xg]
    t_bwd = time_ms(lambda i: torch.autograd.grad(graphs[i % ROTATE], [xg[i % ROTATE]] + params,
                                                  dys[i % ROTATE], retain_graph=True), iters)
    size = rows * hidden * xs[0].element_size()
    return dict(op="rms_norm" if rms else "layer_norm", shape=f"{rows}x{hidden}", dtype=str(dtype)[6:],
                err=err, k_fwd=k_fwd, t_fwd=t_fwd, k_bwd=k_bwd, t_bwd=t_bwd,
                fwd_bytes=2 * size, bwd_bytes=3 * size)


def bench_softmax(kernels, shape, dtype: torch.dtype, causal: bool, iters: int) -> Dict:
    """Forward/backward of scaled masked (mask [b,1,sq,sk]) or causal softmax vs eager."""
    scale = 0.125
    xs = [torch.randn(*shape, device="cuda", dtype=dtype) for _ in range(ROTATE)]
    dys = [torch.randn(*shape, device="cuda", dtype=dtype) for _ in range(ROTATE)]
    sq, sk = shape[-2], shape[-1]
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").triu(1)
    else:
        mask = torch.rand(shape[0], 1, sq, sk, device="cuda") < 0.1
    kmask = None if causal else mask

    def torch_fwd(x):
        return torch.softmax((x * scale).masked_fill(mask, -10000.0), dim=-1)

    ys = [kernels.softmax_forward(x, kmask, scale, causal) for x in xs]
    err = rel_err(ys[0], torch.softmax((xs[0].float() * scale).masked_fill(mask, float("-inf")), -1))
    k_fwd = time_ms(lambda i: kernels.softmax_forward(xs[i % ROTATE], kmask, scale, causal), iters)
    t_fwd = time_ms(lambda i: torch_fwd(xs[i % ROTATE]), iters)
    k_bwd = time_ms(lambda i: kernels.softmax_backward(dys[i % ROTATE], ys[i % ROTATE], scale, causal), iters)
    xg = [x.clone().requires_grad_() for x in xs]
    graphs = [torch_fwd(x) for x in xg]
    t_bwd = time_ms(lambda i: torch.autograd.grad(graphs[i % ROTATE], xg[i % ROTATE], dys[i % ROTATE],
                                                  retain_graph=True), iters)
    fwd_bytes, bwd_bytes = softmax_bytes(xs[0], mask, causal)
    return dict(op="causal_softmax" if causal else "masked_softmax", shape="x".join(map(str, shape)),
                dtype=str(dtype)[6:], err=err, k_fwd=k_fwd, t_fwd=t_fwd, k_bwd=k_bwd, t_bwd=t_bwd,
                fwd_bytes=fwd_bytes, bwd_bytes=bwd_bytes)


def norm_reference(x: torch.Tensor, w: torch.Tensor, b, dy: torch.Tensor, rms: bool) -> List[torch.Tensor]:
    """fp32 torch y, dx, dweight (and dbias) for one norm."""
    hidden = x.shape[-1]
    params = [t.float().requires_grad_() for t in ([x, w] if rms else [x, w, b])]
    y = (F.rms_norm(params[0], (hidden,), params[1], 1e-5) if rms
         else F.layer_norm(params[0], (hidden,), params[1], params[2], 1e-5))
    return [y.detach()] + list(torch.autograd.grad(y, params, dy.float()))


def sweep_one(kernels, xs, dys, w, b, rms: bool, variant: int, ref: List[torch.Tensor], iters: int) -> Dict:
    """Check one variant against ref (y, dx, dw[, db]), then time its forward and backward."""
    hidden = xs[0].shape[-1]
    saved = [kernels.norm_forward(x, w, b, 1e-5, rms, variant) for x in xs]
    dx, dw, db = kernels.norm_backward(dys[0], xs[0], w, saved[0][1], saved[0][2], rms, not rms, variant)
    errs = [rel_err(o, r) for o, r in zip([saved[0][0], dx, dw] + ([] if rms else [db]), ref)]
    row = dict(op="rms_norm" if rms else "layer_norm", shape=f"{xs[0].shape[0]}x{hidden}", variant=variant,
               fits_fwd=kernels.norm_variant_fits(hidden, variant, False),
               fits_bwd=kernels.norm_variant_fits(hidden, variant, True), err=max(errs),
               wrong=not all(e < SWEEP_TOL for e in errs))  # a NaN error is wrong too
    if row["wrong"]:
        return row
    row["k_fwd"] = time_ms(lambda i: kernels.norm_forward(xs[i % ROTATE], w, b, 1e-5, rms, variant), iters)
    row["k_bwd"] = time_ms(lambda i: kernels.norm_backward(dys[i % ROTATE], xs[i % ROTATE], w, saved[i % ROTATE][1],
                                                           saved[i % ROTATE][2], rms, not rms, variant), iters)
    size = xs[0].numel() * xs[0].element_size()
    row.update(fwd_bytes=2 * size, bwd_bytes=3 * size)
    return row


def sweep_norms(kernels, iters: int) -> List[Dict]:
    """Every launch variant of the bf16 norm kernels at SWEEP_SHAPES, LayerNorm and RMSNorm."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n_rows, hidden in SWEEP_SHAPES:
        def randn(*shape):
            return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)
        xs = [randn(n_rows, hidden) * 2 + 0.5 for _ in range(ROTATE)]
        dys = [randn(n_rows, hidden) for _ in range(ROTATE)]
        w, b = randn(hidden), randn(hidden)
        for rms in (False, True):
            ref = norm_reference(xs[0], w, None if rms else b, dys[0], rms)
            for variant in range(kernels.norm_variants):
                rows.append(sweep_one(kernels, xs, dys, w, None if rms else b, rms, variant, ref, iters))
                print(rows[-1], flush=True)
        del xs, dys
    return rows


def sweep_table(rows: List[Dict], copy_gbs: float) -> str:
    """Markdown table of the variant sweep: ms and % of copy bandwidth, best correct variant marked *."""
    best = {}
    for r in rows:
        for d in ("fwd", "bwd"):
            key = (r["op"], r["shape"], d)
            if not r["wrong"] and r[f"k_{d}"] < best.get(key, (float("inf"), None))[0]:
                best[key] = (r[f"k_{d}"], r["variant"])
    lines = [f"copy bandwidth (read + write): {copy_gbs:.0f} GB/s on {torch.cuda.get_device_name()}; bfloat16; "
             "variants: csrc/norm_variants.cuh; '(=0)': the row does not fit, variant 0 ran; * fastest", "",
             "| op | shape | variant | max rel err | fwd ms | fwd % copy BW | bwd ms | bwd % copy BW |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for d in ("fwd", "bwd"):
            if r["wrong"]:
                cells += ["WRONG", "WRONG"]
                continue
            mark = "*" if best[(r["op"], r["shape"], d)][1] == r["variant"] else ""
            fell_back = "" if r[f"fits_{d}"] else " (=0)"
            pct = 100 * r[f"{d}_bytes"] / r[f"k_{d}"] / 1e6 / copy_gbs
            cells += [f"{r[f'k_{d}']:.4f}{mark}{fell_back}", f"{pct:.0f}%"]
        lines.append(f"| {r['op']} | {r['shape']} | {r['variant']} | {r['err']:.1e} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def softmax_bytes(x: torch.Tensor, mask: torch.Tensor, causal: bool) -> tuple:
    """Bytes the forward and the backward move at least (causal: the upper triangle is not read)."""
    es, sq, sk = x.element_size(), x.shape[-2], x.shape[-1]
    rows = x.numel() // sk
    if causal:
        read = sum(min(q + 1, sk) for q in range(sq)) * (rows // sq)
        return (read + rows * sk) * es, (2 * read + rows * sk) * es
    return 2 * rows * sk * es + mask.numel(), 3 * rows * sk * es


def sweep_softmax(kernels, iters: int) -> List[Dict]:
    """Every launch variant of the bf16 softmax forward at SWEEP_SOFTMAX, checked then timed."""
    rows = []
    for shape, causal in SWEEP_SOFTMAX:
        xs = [torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(ROTATE)]
        sq, sk = shape[-2], shape[-1]
        mask = (torch.ones(sq, sk, dtype=torch.bool, device="cuda").triu(1) if causal
                else torch.rand(shape[0], 1, sq, sk, device="cuda") < 0.1)
        kmask = None if causal else mask
        ref = torch.softmax((xs[0].float() * 0.125).masked_fill(mask, float("-inf")), -1)
        fwd_bytes = softmax_bytes(xs[0], mask, causal)[0]
        for variant in range(kernels.softmax_variants):
            err = rel_err(kernels.softmax_forward(xs[0], kmask, 0.125, causal, variant), ref)
            row = dict(op="causal_softmax" if causal else "masked_softmax", shape="x".join(map(str, shape)),
                       variant=variant, err=err, wrong=not err < SWEEP_TOL, fwd_bytes=fwd_bytes)
            if not row["wrong"]:
                row["k_fwd"] = time_ms(lambda i: kernels.softmax_forward(xs[i % ROTATE], kmask, 0.125, causal,
                                                                         variant), iters)
            rows.append(row)
            print(row, flush=True)
    return rows


def softmax_sweep_table(rows: List[Dict], copy_gbs: float) -> str:
    """Markdown table of the softmax forward sweep; * marks the fastest correct variant per shape."""
    best = {}
    for r in rows:
        if not r["wrong"] and r["k_fwd"] < best.get((r["op"], r["shape"]), (float("inf"), None))[0]:
            best[(r["op"], r["shape"])] = (r["k_fwd"], r["variant"])
    lines = [f"copy bandwidth (read + write): {copy_gbs:.0f} GB/s on {torch.cuda.get_device_name()}; bfloat16; "
             "variants: csrc/softmax.cu; * fastest", "",
             "| op | shape | variant | rel err | fwd ms | fwd % copy BW |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["wrong"]:
            cells = "WRONG | WRONG"
        else:
            mark = "*" if best[(r["op"], r["shape"])][1] == r["variant"] else ""
            cells = f"{r['k_fwd']:.4f}{mark} | {100 * r['fwd_bytes'] / r['k_fwd'] / 1e6 / copy_gbs:.0f}%"
        lines.append(f"| {r['op']} | {r['shape']} | {r['variant']} | {r['err']:.1e} | {cells} |")
    return "\n".join(lines)


def table(results: List[Dict], copy_gbs: float) -> str:
    """Markdown table: ms, speed-up over torch eager, kernel bandwidth as % of copy bandwidth."""
    lines = [f"copy bandwidth (read + write): {copy_gbs:.0f} GB/s on {torch.cuda.get_device_name()}", "",
             "| op | dtype | shape | rel err | fwd ms (torch) | fwd speed-up | fwd % copy BW "
             "| bwd ms (torch) | bwd speed-up | bwd % copy BW |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        pct = lambda nbytes, ms: 100 * nbytes / ms / 1e6 / copy_gbs  # noqa: E731
        lines.append(
            f"| {r['op']} | {r['dtype']} | {r['shape']} | {r['err']:.1e} | {r['k_fwd']:.3f} ({r['t_fwd']:.3f}) "
            f"| {r['t_fwd'] / r['k_fwd']:.2f}x | {pct(r['fwd_bytes'], r['k_fwd']):.0f}% "
            f"| {r['k_bwd']:.3f} ({r['t_bwd']:.3f}) | {r['t_bwd'] / r['k_bwd']:.2f}x "
            f"| {pct(r['bwd_bytes'], r['k_bwd']):.0f}% |")
    return "\n".join(lines)


def main() -> None:
    """Run every benchmark and print the table (and optionally write JSON)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and iterations (smoke run)")
    parser.add_argument("--iters", type=int, default=50, help="timed runs per measurement (median)")
    parser.add_argument("--sweep-norms", action="store_true",
                        help="only time every launch variant of the bf16 norm kernels side by side")
    parser.add_argument("--sweep-softmax", action="store_true",
                        help="only time every launch variant of the bf16 softmax forward side by side")
    parser.add_argument("--norms-only", action="store_true",
                        help="only the norm kernels at their launch defaults (no softmax)")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_kernels.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU")
    kernels, note = load_kernels()
    if kernels is None:
        sys.exit(f"fused kernels unavailable: {note}")
    print(f"kernels: {note}", flush=True)
    iters = 10 if args.quick else args.iters
    if args.sweep_norms or args.sweep_softmax:
        sweeps = {}
        if args.sweep_norms:
            sweeps["norm_sweep"] = sweep_norms(kernels, iters)
        if args.sweep_softmax:
            sweeps["softmax_sweep"] = sweep_softmax(kernels, iters)
        copy_gbs = copy_bandwidth_gbs(iters)
        with open(args.json, "w") as f:
            json.dump(dict(copy_gbs=copy_gbs, device=torch.cuda.get_device_name(), **sweeps), f, indent=1)
        if args.sweep_norms:
            print(sweep_table(sweeps["norm_sweep"], copy_gbs))
        if args.sweep_softmax:
            print(softmax_sweep_table(sweeps["softmax_sweep"], copy_gbs))
        return
    take = (lambda s: s[:2]) if args.quick else (lambda s: s)  # noqa: E731
    results = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        norm_shapes = take(NORM_SHAPES) if dtype == torch.bfloat16 else [(8192, 4096)]
        for rows, hidden in norm_shapes:
            for rms in (False, True):
                results.append(bench_norm(kernels, rows, hidden, dtype, rms, iters))
                print(results[-1], flush=True)
        if args.norms_only:
            continue
        for shape in take(SOFTMAX_SHAPES) if dtype == torch.bfloat16 else [(2, 16, 1024, 1024)]:
            results.append(bench_softmax(kernels, shape, dtype, False, iters))
            print(results[-1], flush=True)
        for shape in take(CAUSAL_SHAPES) if dtype == torch.bfloat16 else [(32, 2048, 2048)]:
            results.append(bench_softmax(kernels, shape, dtype, True, iters))
            print(results[-1], flush=True)
    copy_gbs = copy_bandwidth_gbs(iters)
    with open(args.json, "w") as f:
        json.dump(dict(copy_gbs=copy_gbs, device=torch.cuda.get_device_name(), results=results), f, indent=1)
    print(table(results, copy_gbs))


if __name__ == "__main__":
    main()
