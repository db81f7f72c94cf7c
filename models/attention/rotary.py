"""Rotary position embeddings: inverse frequencies (plain, Llama 3's scaling, YaRN), the cos/sin
tables for a sequence or for given positions, and their application to q/k heads."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.mla.rope import yarn_concentration, yarn_inv_freq


def rotary_inv_freq(config: TransformerConfig,
                    device: Optional[torch.device] = None) -> torch.Tensor:
    """RoPE's inverse frequencies [rotary_dim / 2] (fp32), as Megatron-Core's RotaryEmbedding
    builds them: base ** -(2i / rotary_dim), then Llama 3.1's scaling if asked."""
    dim = config.rotary_dim
    if config.rope_type == "yarn":  # MLA's YaRN (models/mla/rope.py)
        return yarn_inv_freq(dim, config.rotary_base, config.rotary_scaling_factor,
                             config.original_max_position_embeddings, config.beta_fast,
                             config.beta_slow, config.yarn_correction_range_round_to_int,
                             device)
    inv_freq = 1.0 / (config.rotary_base ** (
        torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if config.rope_scaling:
        inv_freq = llama3_scaled_inv_freq(
            inv_freq, config.rope_scaling_factor, config.rope_scaling_low_freq_factor,
            config.rope_scaling_high_freq_factor,
            config.rope_scaling_original_max_position_embeddings)
    return inv_freq


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float = 1.0,
                           high_freq_factor: float = 4.0,
                           original_context: int = 8192) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: wavelengths longer than original_context / low_freq_factor
    are slowed by `factor`, those shorter than original_context / high_freq_factor kept, the
    band between blended linearly in original_context / wavelength."""
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = original_context / low_freq_factor
    high_freq_wavelength = original_context / high_freq_factor
    slowed = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelength - low_freq_factor) / \
        (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(medium, blended, slowed)


def rotary_cos_sin(seq_len: int, config: TransformerConfig,
                   device: Optional[torch.device]) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [s, 1, 1, rotary_dim] (fp32) for rotate-half RoPE at positions
    0 .. s-1."""
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    return _cos_sin(positions[:, None], config)


def rotary_cos_sin_at(position_ids: torch.Tensor,
                      config: TransformerConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [s, b, 1, rotary_dim] (fp32) at `position_ids` [b, s] (left
    padding, a KV cache's later steps)."""
    return _cos_sin(position_ids.t().float(), config)


def _cos_sin(positions: torch.Tensor,
             config: TransformerConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """Tables [s, b', 1, rotary_dim] of fp32 positions [s, b']."""
    if config.rotary_seq_len_interpolation_factor is not None:
        positions = positions * (1 / config.rotary_seq_len_interpolation_factor)
    angles = positions[..., None] * rotary_inv_freq(config, positions.device)
    emb = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    if config.rope_type == "yarn":
        factor = yarn_concentration(config.rotary_scaling_factor, config.mscale,
                                    config.mscale_all_dim)
        return emb.cos() * factor, emb.sin() * factor
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] channels of x [s, b, n, d] (Llama's rotate-half
    layout); the other channels (--rotary-percent < 1) pass unchanged."""
    rot = cos.shape[-1]
    xf = (x if rot == x.shape[-1] else x[..., :rot]).float()  # no slice (nor its backward) when whole
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = (xf * cos + rotated * sin).to(x.dtype)
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)
