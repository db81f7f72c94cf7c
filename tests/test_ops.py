"""Fused-op fallbacks against fp64 reference math, fully masked rows, grads, backend choice.

Tolerances: float32 outputs within 1e-5 relative (L2) of an fp64 computation; bfloat16
within 1e-2, float16 within 2e-3 (one rounding of the output dominates).
"""
import re
from pathlib import Path

import pytest
import torch

from gigatron import ops
from gigatron.ops import backend
from gigatron.ops.__main__ import report

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
CSRC = Path(__file__).resolve().parent.parent / "csrc"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def layer_norm_fp64(x, w, b, eps):
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w.double() + b.double()


def rms_norm_fp64(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def softmax_fp64(x, mask, scale):
    """Softmax written out with explicit zero weights for masked keys."""
    s = x.double() * scale
    keep = torch.ones_like(s, dtype=torch.bool) if mask is None else ~mask.expand_as(s)
    s = torch.where(keep, s, torch.full_like(s, -1e300))
    e = torch.exp(s - s.amax(-1, keepdim=True)) * keep
    return e / e.sum(-1, keepdim=True).clamp_min(1e-300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norms_match_fp64_formulas_at_odd_hidden(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 7, 37, generator=gen) * 3 + 1).to(dtype)
    w, b = torch.randn(37, generator=gen), torch.randn(37, generator=gen)
    assert rel_err(ops.layer_norm(x, w, b, 1e-5), layer_norm_fp64(x, w, b, 1e-5)) < TOL[dtype]
    assert rel_err(ops.rms_norm(x, w, 1e-6), rms_norm_fp64(x, w, 1e-6)) < TOL[dtype]
    assert ops.layer_norm(x, w.to(dtype), b.to(dtype), 1e-5).dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_softmax_matches_fp64_with_head_broadcast_masks(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 13, generator=gen).to(dtype)
    for mask_shape in [(2, 1, 5, 13), (1, 1, 5, 13), (5, 13), (2, 3, 5, 13)]:
        mask = torch.rand(mask_shape, generator=gen) < 0.4
        out = ops.scaled_masked_softmax(x, mask, 0.37)
        assert out.dtype == dtype
        assert rel_err(out, softmax_fp64(x, mask, 0.37)) < TOL[dtype]
        assert (out[mask.expand_as(out)] == 0).all()
    assert rel_err(ops.scaled_masked_softmax(x, None, 2.0), softmax_fp64(x, None, 2.0)) < TOL[dtype]


def test_fully_masked_rows_give_zeros_and_zero_grads_not_nan():
    x = torch.randn(2, 2, 4, 9, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 1, 4, 9, dtype=torch.bool)
    mask[0, 0, 1] = True
    mask[1, 0, 3] = True
    out = ops.scaled_masked_softmax(x, mask, 0.5)
    assert torch.equal(out[0, :, 1], torch.zeros(2, 9, dtype=torch.float64))
    assert torch.allclose(out[0, :, 0].sum(-1), torch.ones(2, dtype=torch.float64))
    out.backward(torch.randn_like(out))
    assert torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[1, :, 3], torch.zeros(2, 9, dtype=torch.float64))


@pytest.mark.parametrize("sq,sk", [(6, 6), (4, 9), (7, 3)])
def test_causal_softmax_equals_masked_softmax_with_strict_upper_triangle(sq, sk):
    x = torch.randn(3, sq, sk, dtype=torch.float64)
    out = ops.scaled_upper_triang_masked_softmax(x, 0.8)
    upper = torch.ones(sq, sk, dtype=torch.bool).triu(1)
    assert torch.allclose(out, softmax_fp64(x, upper, 0.8), atol=1e-12)
    assert (out[:, upper] == 0).all()


def test_fallback_grads_pass_fp64_gradcheck():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 4, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    mask = torch.rand(3, 1, 4, 6, generator=gen) < 0.3
    mask[0, 0, 2] = True
    w = torch.randn(6, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ops.scaled_masked_softmax(t, mask, 0.7), (x,))
    assert torch.autograd.gradcheck(lambda t: ops.scaled_upper_triang_masked_softmax(t, 1.3),
                                    (x.detach()[0].clone().requires_grad_(),))
    assert torch.autograd.gradcheck(lambda t, w_, b_: ops.layer_norm(t, w_, b_, 1e-5), (x, w, b))
    assert torch.autograd.gradcheck(lambda t, w_: ops.rms_norm(t, w_, 1e-5), (x, w))


def test_kernel_backward_formulas_match_autograd_in_fp64():
    """The closed forms csrc/ implements, checked against autograd of the forward."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(11, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, generator=gen, requires_grad=True)
    dy = torch.randn(6, 11, dtype=torch.float64, generator=gen)
    eps, scale = 1e-5, 0.6
    for rms in (False, True):
        y = rms_norm_fp64(x, w, eps) if rms else layer_norm_fp64(x, w, b, eps)
        dx_ref, dw_ref = torch.autograd.grad(y, (x, w), dy)
        xd = x.detach()
        mean = torch.zeros(6, 1, dtype=torch.float64) if rms else xd.mean(-1, keepdim=True)
        ms = ((xd - mean) ** 2).mean(-1, keepdim=True)
        rstd = 1 / torch.sqrt(ms + eps)
        xhat, g = (xd - mean) * rstd, dy * w.detach()
        c1 = torch.zeros_like(rstd) if rms else g.mean(-1, keepdim=True)
        dx = rstd * (g - c1 - xhat * (g * xhat).mean(-1, keepdim=True))
        assert torch.allclose(dx, dx_ref, atol=1e-10)
        assert torch.allclose((dy * xhat).sum(0), dw_ref, atol=1e-10)
    y = softmax_fp64(x, None, scale)
    (dx_ref,) = torch.autograd.grad(y, x, dy)
    yd = y.detach()
    dx = scale * yd * (dy - (dy * yd).sum(-1, keepdim=True))
    assert torch.allclose(dx, dx_ref, atol=1e-10)


def test_backend_env_forces_choice_and_rejects_bad_values(monkeypatch):
    x = torch.randn(2, 8)
    assert ops.chosen_backend("layer_norm", x, torch.ones(8)) == "torch"
    monkeypatch.setenv(backend.ENV_VAR, "kernel")
    with pytest.raises(ValueError, match="GIGATRON_OPS_BACKEND=kernel.*CUDA"):
        ops.layer_norm(x, torch.ones(8), torch.zeros(8), 1e-5)
    monkeypatch.setenv(backend.ENV_VAR, "apex")
    with pytest.raises(ValueError, match="apex"):
        ops.scaled_upper_triang_masked_softmax(torch.randn(1, 4, 4), 1.0)
    monkeypatch.setenv(backend.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="GIGATRON_OPS_BACKEND='fast'"):
        ops.rms_norm(x, torch.ones(8), 1e-5)
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    assert ops.chosen_backend("scaled_masked_softmax", x.view(1, 1, 2, 8)) == "torch"


def test_bad_softmax_inputs_raise_value_errors_naming_the_problem():
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match="mask must be a bool"):
        ops.scaled_masked_softmax(x, torch.zeros(2, 1, 4, 5), 1.0)
    with pytest.raises(ValueError, match="does not broadcast"):
        ops.scaled_masked_softmax(x, torch.zeros(3, 1, 4, 5, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match=r"\[b\*np, sq, sk\]"):
        ops.scaled_upper_triang_masked_softmax(x, 1.0)


def test_env_report_names_every_backend_and_reason():
    text = report(build=False)
    for word in ("kernel:", "apex:", "torch:", "layer_norm", "scaled_upper_triang_masked_softmax"):
        assert word in text
    if not torch.cuda.is_available():
        assert "unavailable" in text.split("kernel:")[1].splitlines()[0]


def test_kernel_sources_include_only_cuda_and_standard_headers():
    allowed = re.compile(r"^(cuda_\w+\.h|cuda\w*\.h|c\w+|algorithm|limits|tuple)$")
    for path in list(CSRC.glob("*.cu")) + list(CSRC.glob("*.cuh")) + [CSRC / "gigatron_kernels.h"]:
        for inc in re.findall(r'#include\s*[<"]([^>"]+)[>"]', path.read_text()):
            local = (CSRC / inc).is_file()
            assert local or allowed.match(inc), f"{path.name} includes {inc}: only CUDA headers allowed"
    torch_includes = [p.name for p in CSRC.iterdir() if "torch/extension.h" in p.read_text(errors="ignore")]
    assert torch_includes == ["binding.cpp"]
