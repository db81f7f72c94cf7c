"""Every compiled kernel against an fp64 reference on a GPU (forced GIGATRON_OPS_BACKEND=kernel).

Odd sizes, rows not multiples of 8 (scalar path), rows past the register cache (streaming
path), fully masked rows. Relative L2 error limits, per dtype: outputs and input grads
float32 1e-5, float16 2e-3, bfloat16 1e-2; weight/bias grads (sums over many rows) float32
1e-5, half types 1e-2. Outputs come from memory poisoned with NaN, so an unwritten element fails.
"""
import pytest
import torch

from gigatron import ops

pytestmark = pytest.mark.cuda
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NORM_SHAPES = [(1, 1), (7, 37), (33, 1000), (5, 4096), (3, 4095), (9, 8200), (2, 20000), (2, 65536), (1, 70001)]
SOFTMAX_SHAPES = [(2, 3, 5, 7), (1, 2, 8, 1024), (2, 1, 3, 4097), (1, 1, 2, 16384), (1, 2, 2, 20000)]
CAUSAL_SHAPES = [(3, 17, 17), (2, 64, 1000), (2, 5, 9), (1, 300, 4096)]


@pytest.fixture(autouse=True)
def force_kernel(monkeypatch):
    monkeypatch.setenv("GIGATRON_OPS_BACKEND", "kernel")


def poison_allocator():
    """Fill cached device blocks with NaN so torch.empty inside the kernels returns NaN memory."""
    torch.cuda.synchronize()
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite (unwritten or NaN) output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(out, ref, tol, what, scale=None):
    """Relative L2 error under tol; `scale` (a norm) replaces ref's norm where the exact result
    cancels to far below the terms it is computed from (hidden 1: dx is ~0 in exact arithmetic,
    so any rounding is an infinite relative error, in torch's own kernels too)."""
    err = rel_err(out, ref)
    if scale is not None:
        err = ((out.double() - ref.double()).norm() / max(ref.double().norm().item(), scale)).item()
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"


def norm_dx_scale(x, w, dy, rms):
    """The size of the terms dx is a difference of: || rstd * w * dy || (float64)."""
    xr, wr, dyr = x.detach().double(), w.detach().double(), dy.double()
    centred = xr if rms else xr - xr.mean(-1, keepdim=True)
    rstd = torch.rsqrt((centred * centred).mean(-1, keepdim=True) + 1e-5)
    return (rstd * wr * dyr).norm().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
def test_norm_kernels_match_fp64_forward_and_grads(dtype, rms):
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, hidden in NORM_SHAPES:
        x = (torch.randn(rows, hidden, device="cuda", generator=gen) * 2 + 0.5).to(dtype).requires_grad_()
        w = torch.randn(hidden, device="cuda", generator=gen).to(dtype).requires_grad_()
        b = torch.randn(hidden, device="cuda", generator=gen).to(dtype).requires_grad_()
        dy = torch.randn(rows, hidden, device="cuda", generator=gen).to(dtype)
        poison_allocator()
        out = ops.rms_norm(x, w, 1e-5) if rms else ops.layer_norm(x, w, b, 1e-5)
        params = (x, w) if rms else (x, w, b)
        grads = torch.autograd.grad(out, params, dy)
        ref_params = [p.detach().double().requires_grad_() for p in params]
        xr = ref_params[0]
        if rms:
            ref = xr / torch.sqrt((xr * xr).mean(-1, keepdim=True) + 1e-5) * ref_params[1]
        else:
            ref = torch.nn.functional.layer_norm(xr, (hidden,), ref_params[1], ref_params[2], 1e-5)
        ref_grads = torch.autograd.grad(ref, ref_params, dy.double())
        what = f"{'rms' if rms else 'layer'}_norm {dtype} {rows}x{hidden}"
        check(out, ref, TOL[dtype], what)
        check(grads[0], ref_grads[0], TOL[dtype], what + " dx", norm_dx_scale(x, w, dy, rms))
        for g, r in zip(grads[1:], ref_grads[1:]):
            assert g.dtype == dtype
            check(g, r, 1e-5 if dtype == torch.float32 else 1e-2, what + " dweight/dbias")


def masked_softmax_fp64(x, mask, scale):
    """Masked keys get weight exactly 0; a fully masked row is all zeros."""
    keep = ~mask.expand(x.shape)
    s = torch.where(keep, x.double() * scale, torch.full(x.shape, -1e300, dtype=torch.float64, device=x.device))
    e = torch.exp(s - s.amax(-1, keepdim=True)) * keep
    return e / e.sum(-1, keepdim=True).clamp_min(1e-300)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_softmax_kernel_matches_fp64_with_fully_masked_rows(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    for b, np_, sq, sk in SOFTMAX_SHAPES:
        for mask_heads in (1, np_):
            x = (torch.randn(b, np_, sq, sk, device="cuda", generator=gen) * 4).to(dtype).requires_grad_()
            mask = torch.rand(b, mask_heads, sq, sk, device="cuda", generator=gen) < 0.3
            mask[0, :, sq - 1] = True  # a fully masked row (in every head of the mask)
            dy = torch.randn(b, np_, sq, sk, device="cuda", generator=gen).to(dtype)
            poison_allocator()
            out = ops.scaled_masked_softmax(x, mask, 0.125)
            (dx,) = torch.autograd.grad(out, x, dy)
            xr = x.detach().double().requires_grad_()
            ref = masked_softmax_fp64(xr, mask, 0.125)
            (dx_ref,) = torch.autograd.grad(ref, xr, dy.double())
            what = f"masked softmax {dtype} {(b, np_, sq, sk)} mask heads {mask_heads}"
            check(out, ref, TOL[dtype], what)
            check(dx, dx_ref, TOL[dtype], what + " dx")
            assert (out[0, :, sq - 1] == 0).all() and (dx[0, :, sq - 1] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_softmax_kernel_matches_fp64(dtype):
    gen = torch.Generator(device="cuda").manual_seed(2)
    for bnp, sq, sk in CAUSAL_SHAPES:
        x = (torch.randn(bnp, sq, sk, device="cuda", generator=gen) * 4).to(dtype).requires_grad_()
        dy = torch.randn(bnp, sq, sk, device="cuda", generator=gen).to(dtype)
        poison_allocator()
        out = ops.scaled_upper_triang_masked_softmax(x, 0.3)
        (dx,) = torch.autograd.grad(out, x, dy)
        upper = torch.ones(sq, sk, dtype=torch.bool, device="cuda").triu(1)
        xr = x.detach().double().requires_grad_()
        ref = masked_softmax_fp64(xr, upper, 0.3)
        (dx_ref,) = torch.autograd.grad(ref, xr, dy.double())
        what = f"causal softmax {dtype} {(bnp, sq, sk)}"
        check(out, ref, TOL[dtype], what)
        check(dx, dx_ref, TOL[dtype], what + " dx")
        assert (out[:, upper] == 0).all()


def test_kernels_accept_non_contiguous_and_unaligned_inputs():
    base = torch.randn(4, 2, 6, 41, device="cuda", dtype=torch.float16)
    x = base[..., 1:]  # unaligned, non-contiguous view
    mask = torch.zeros(4, 1, 6, 40, dtype=torch.bool, device="cuda")
    ref = masked_softmax_fp64(x, mask, 1.0)
    check(ops.scaled_masked_softmax(x, mask, 1.0), ref, TOL[torch.float16], "strided softmax")
    w = torch.ones(40, device="cuda", dtype=torch.float16)
    ref = torch.nn.functional.layer_norm(x.double(), (40,), w.double(), w.double() * 0, 1e-5)
    check(ops.layer_norm(x, w, w * 0, 1e-5), ref, TOL[torch.float16], "strided layer_norm")


VARIANT_SHAPES = [(1, 1), (3, 4095), (33, 1000), (1500, 4096), (9, 8200), (2, 16384)]


def norm_kernels():
    from gigatron.ops.build import load_kernels

    kernels, note = load_kernels()
    assert kernels is not None, note
    return kernels


def kernel_grads(kernels, x, w, b, dy, rms, variant):
    """(y, dx, dweight[, dbias]) from the raw kernels with one launch variant."""
    y, mean, rstd = kernels.norm_forward(x, w, b, 1e-5, rms, variant)
    dx, dw, db = kernels.norm_backward(dy, x, w, mean, rstd, rms, b is not None, variant)
    return [y, dx, dw] + ([] if b is None else [db])


@pytest.mark.parametrize("variant", range(1, 10))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_launch_variants_match_variant_0_and_fp64(variant, dtype):
    kernels = norm_kernels()
    assert kernels.norm_variants == 10
    gen = torch.Generator(device="cuda").manual_seed(3)
    for rows, hidden in VARIANT_SHAPES:
        for rms in (False, True):
            x = (torch.randn(rows, hidden, device="cuda", generator=gen) * 2 + 0.5).to(dtype)
            # at 8200 the float32 weight starts one element into its buffer: unaligned for float4
            # reads, so those variants must fall back to variant 0 there
            w = torch.randn(hidden + 1, device="cuda", generator=gen)[int(hidden == 8200):][:hidden]
            b = None if rms else torch.randn(hidden, device="cuda", generator=gen)
            dy = torch.randn(rows, hidden, device="cuda", generator=gen).to(dtype)
            poison_allocator()
            got = kernel_grads(kernels, x, w, b, dy, rms, variant)
            base = kernel_grads(kernels, x, w, b, dy, rms, 0)
            what = f"variant {variant} {'rms' if rms else 'layer'}_norm {dtype} {rows}x{hidden}"
            if dtype == torch.float32:  # float32 always runs variant 0
                for g, r in zip(got, base):
                    assert torch.equal(g, r), what
                continue
            xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
            params = [xr, wr] + ([] if rms else [b.double().requires_grad_()])
            ref = (xr / torch.sqrt((xr * xr).mean(-1, keepdim=True) + 1e-5) * wr if rms else
                   torch.nn.functional.layer_norm(xr, (hidden,), wr, params[-1], 1e-5))
            refs = [ref] + list(torch.autograd.grad(ref, params, dy.double()))
            scale = norm_dx_scale(x, w, dy, rms)
            for i, (g, r, g0) in enumerate(zip(got, refs, base)):
                check(g, r, TOL[dtype], f"{what} output {i}", scale if i == 1 else None)
                check(g, g0, TOL[dtype], f"{what} output {i} vs variant 0", scale if i == 1 else None)


def test_norm_variants_launch_their_own_kernels_and_reject_bad_numbers():
    """At 4096 every variant fits, so each must launch a forward and a backward kernel of its own."""
    kernels = norm_kernels()
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda")

    def kernel_names(variant):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            _, mean, rstd = kernels.norm_forward(x, w, None, 1e-5, True, variant)
            kernels.norm_backward(x, x, w, mean, rstd, True, False, variant)
            torch.cuda.synchronize()
        names = {e.name for e in prof.events() if "norm_forward_kernel" in e.name or "norm_backward_kernel" in e.name}
        assert len(names) == 2, (variant, names)
        return names

    seen = [kernel_names(0)]
    for variant in range(1, kernels.norm_variants):
        assert kernels.norm_variant_fits(4096, variant, False) and kernels.norm_variant_fits(4096, variant, True)
        names = kernel_names(variant)
        assert all(not (names & other) for other in seen), (variant, names)
        seen.append(names)
    assert not kernels.norm_variant_fits(16384, 1, False) and not kernels.norm_variant_fits(4095, 5, False)
    with pytest.raises(RuntimeError, match="norm variant must be in"):
        kernels.norm_forward(x, w, None, 1e-5, True, kernels.norm_variants)
    # a formatted message raises (the H100 image segfaulted on TORCH_CHECK's streamed ones)
    with pytest.raises(RuntimeError, match="norm weight has 10 elements, hidden size is 4096"):
        kernels.norm_forward(x, w[:10], None, 1e-5, True)


@pytest.mark.parametrize("variant", range(1, 5))
def test_softmax_forward_launch_variants_match_variant_0_and_fp64(variant):
    kernels = norm_kernels()
    assert kernels.softmax_variants == 5
    gen = torch.Generator(device="cuda").manual_seed(4)
    for shape in [(2, 3, 5, 7), (1, 2, 8, 1000), (2, 2, 3, 4096), (1, 2, 4, 8192), (1, 1, 2, 16384)]:
        b, np_, sq, sk = shape
        x = (torch.randn(*shape, device="cuda", generator=gen) * 4).to(torch.bfloat16)
        mask = torch.rand(b, 1, sq, sk, device="cuda", generator=gen) < 0.3
        mask[0, :, sq - 1] = True  # a fully masked row
        for causal in (False, True):
            xs, m = (x.view(b * np_, sq, sk), torch.ones(sq, sk, dtype=torch.bool, device="cuda").triu(1)) \
                if causal else (x, mask)
            poison_allocator()
            got = kernels.softmax_forward(xs, None if causal else mask, 0.125, causal, variant)
            base = kernels.softmax_forward(xs, None if causal else mask, 0.125, causal, 0)
            what = f"softmax variant {variant} causal={causal} {shape}"
            check(got, masked_softmax_fp64(xs, m, 0.125), TOL[torch.bfloat16], what)
            check(got, base, TOL[torch.bfloat16], what + " vs variant 0")
    x = torch.randn(2, 1, 4, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        kernels.softmax_forward(x, None, 1.0, False, 0)
        kernels.softmax_forward(x, None, 1.0, False, variant)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "softmax_forward_kernel" in e.name]
    assert len(names) == 2 and names[0] != names[1], names  # the variant ran a kernel of its own
    with pytest.raises(RuntimeError, match="softmax variant must be in"):
        kernels.softmax_forward(x, None, 1.0, False, kernels.softmax_variants)
