"""YaRN RoPE (arXiv 2309.00071) as Megatron-Core's YarnRotaryEmbedding computes it, and
MLA's interleaved rotary layout.

YaRN blends each frequency between its interpolated (base^(-2i/d) / factor) and original
value by a linear ramp over the channels whose wavelengths fall between beta_fast and
beta_slow rotations of the original context, and scales cos/sin by a concentration
factor; MLA also multiplies its softmax scale by mscale(factor, mscale_all_dim)^2.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term 0.1 mscale ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_concentration(scaling_factor: float, mscale: Optional[float],
                       mscale_all_dim: Optional[float]) -> float:
    """The factor multiplying cos and sin (Megatron-Core's concentration factor)."""
    if mscale is None or mscale_all_dim is None:
        return yarn_get_mscale(scaling_factor)
    return yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor,
                                                                     mscale_all_dim)


def _correction_dim(rotations: float, dim: int, base: float, context: int) -> float:
    """The channel whose wavelength makes `rotations` turns over `context` positions."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float,
                          context: int, round_to_int: bool = True) -> Tuple[float, float]:
    """(low, high) channel pair indices of the ramp between extrapolation and interpolation."""
    low = _correction_dim(beta_fast, dim, base, context)
    high = _correction_dim(beta_slow, dim, base, context)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim: int, base: float, scaling_factor: float, original_context: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, round_to_int: bool = True,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """YaRN's inverse frequencies [dim / 2] (fp32)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    extrapolated = 1.0 / (base ** exponents)
    interpolated = 1.0 / (scaling_factor * base ** exponents)
    low, high = yarn_correction_range(beta_fast, beta_slow, dim, base, original_context,
                                      round_to_int)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low)
            / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: the original frequency (short wavelengths), 0: interpolated
    return interpolated * (1 - keep) + extrapolated * keep


def deinterleave(x: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """MLA's rotary channels stored as pairs (x0, x1), (x2, x3), ... regrouped to the
    rotate-half layout (x0, x2, ..., x1, x3, ...), as Megatron-Core's MLA RoPE reads them;
    channels past `rotary_dim` pass unchanged."""
    rot = x[..., :rotary_dim]
    halves = torch.cat([rot[..., 0::2], rot[..., 1::2]], dim=-1)
    return halves if rotary_dim == x.shape[-1] else torch.cat([halves, x[..., rotary_dim:]],
                                                              dim=-1)
