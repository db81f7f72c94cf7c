"""Multi-latent attention (DeepSeek-V2/V3) with Megatron-Core's module and parameter names.

Queries come from hidden states directly (linear_q_proj) or through a low-rank latent
(linear_q_down_proj -> q_layernorm -> linear_q_up_proj); keys and values from one latent
of kv_lora_rank channels (linear_kv_down_proj -> kv_layernorm -> linear_kv_up_proj) plus
qk_pos_emb_head_dim channels that RoPE rotates and every head shares. A head's query and key
are [qk_head_dim no-position channels | qk_pos_emb_head_dim rotated]; its value has
v_head_dim channels.

Tensor parallelism as Megatron-Core's local spec: the down-projections are column-parallel
with their outputs gathered (each rank computes a slice of the latent), the up-projections
column-parallel over heads, linear_proj row-parallel. The latents are replicated over tp, so
their norms run on the whole sequence even under sequence parallelism. The shared
positional key is used by every rank's heads: its gradient is summed over tp (Megatron-Core
misses that sum with column-parallel down-projections, NVIDIA/Megatron-LM issue 1699).

Inference caches the normalised latent and the rotated positional key of each token (the
KV cache's keys and values of one "head", models/kv_cache.py), expanded per step.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
from torch import nn

from gigatron.models.config import TransformerConfig
from gigatron.models.documents import Documents
from gigatron.models.kv_cache import LayerCache
from gigatron.models.mla.rope import deinterleave, yarn_get_mscale
from gigatron.models.transformer import CoreAttention, Norm, apply_rotary, output_init_std
from gigatron.parallel.comm import Group
from gigatron.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRNGTracker,
    checkpoint,
    copy_to_tensor_parallel_region,
    tp_size,
)


def mla_softmax_scale(config: TransformerConfig) -> float:
    """mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(qk_head_dim +
    qk_pos_emb_head_dim), Megatron-Core's MLA softmax scale (whatever rope_type is)."""
    mscale = yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return mscale * mscale / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


def mla_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on MLA's interleaved positional channels x [s, b, n, p] (Megatron-Core's MLA
    layout; the result is in the rotate-half order, for queries and keys alike)."""
    return apply_rotary(deinterleave(x, cos.shape[-1]), cos, sin)


def _latent_norm(config: TransformerConfig, device: Optional[torch.device],
                 size: int) -> Norm:
    """A latent's norm (replicated over tp, whole sequence) with its own epsilon when the
    config gives one (Hugging Face's DeepSeek models: 1e-6 whatever rms_norm_eps says)."""
    norm = Norm(config, False, device, size)
    if config.mla_latent_norm_epsilon is not None:
        norm.eps = config.mla_latent_norm_epsilon
    return norm


class MultiLatentAttention(nn.Module):
    """Causal self-attention through compressed query and key/value latents."""

    def __init__(self, config: TransformerConfig, tp_group: Group,
                 tracker: Optional[TensorParallelRNGTracker],
                 device: Optional[torch.device] = None, layer_number: int = 0) -> None:
        super().__init__()
        tp = tp_size(tp_group)
        self.config, self.tp_group, self.tracker = config, tp_group, tracker
        heads = config.num_attention_heads
        self.local_heads = heads // tp
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        sp = config.sequence_parallel
        common: Dict[str, Any] = dict(tp_group=tp_group, bias=False,
                                      params_dtype=config.params_dtype, device=device,
                                      init_std=config.init_method_std)
        # a down-projection reads the (sequence-split) hidden states; its latent is gathered
        down: Dict[str, Any] = dict(common, sequence_parallel=sp, gather_output=True)
        self.linear_q_proj = self.linear_q_down_proj = self.linear_q_up_proj = None
        self.q_layernorm = None
        if config.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(config.hidden_size,
                                                      heads * self.q_head_dim,
                                                      sequence_parallel=sp, **common)
        else:
            self.linear_q_down_proj = ColumnParallelLinear(config.hidden_size,
                                                           config.q_lora_rank, **down)
            self.linear_q_up_proj = ColumnParallelLinear(config.q_lora_rank,
                                                         heads * self.q_head_dim, **common)
            if config.qk_layernorm:
                self.q_layernorm = _latent_norm(config, device, config.q_lora_rank)
        self.linear_kv_down_proj = ColumnParallelLinear(
            config.hidden_size, config.kv_lora_rank + config.qk_pos_emb_head_dim, **down)
        self.linear_kv_up_proj = ColumnParallelLinear(
            config.kv_lora_rank, heads * (config.qk_head_dim + config.v_head_dim), **common)
        self.kv_layernorm = (_latent_norm(config, device, config.kv_lora_rank)
                             if config.qk_layernorm else None)
        self.core_attention = CoreAttention(config, tracker, layer_number, tp, device,
                                            softmax_scale=mla_softmax_scale(config))
        self.linear_proj = RowParallelLinear(
            heads * config.v_head_dim, config.hidden_size, tp_group=tp_group,
            bias=config.add_bias_linear, sequence_parallel=sp,
            init_std=output_init_std(config), params_dtype=config.params_dtype, device=device)
        self.recompute_core = config.recomputes("core_attn")
        self.recompute_up = config.recomputes("mla_up_proj")

    def _query_input(self, x: torch.Tensor) -> torch.Tensor:
        """What linear_q_up_proj reads (the normalised query latent), or linear_q_proj's
        output where queries have no latent."""
        if self.linear_q_proj is not None:
            return self.linear_q_proj(x)
        assert self.linear_q_down_proj is not None
        latent = self.linear_q_down_proj(x)
        return latent if self.q_layernorm is None else self.q_layernorm(latent)

    def _query(self, q_input: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """Rotated queries [s, b, local heads, qk_head_dim + qk_pos_emb_head_dim]."""
        c = self.config
        q = q_input if self.linear_q_up_proj is None else self.linear_q_up_proj(q_input)
        q = q.view(*q.shape[:2], self.local_heads, self.q_head_dim)
        q_nope, q_pos = torch.split(q, [c.qk_head_dim, c.qk_pos_emb_head_dim], dim=-1)
        return torch.cat([q_nope, mla_rotary(q_pos, cos, sin)], dim=-1)

    def _up_projections(self, q_input: torch.Tensor, latent: torch.Tensor,
                        k_pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(queries, keys, values) of the latents: the up-projections and RoPE, the part
        --recompute-modules mla_up_proj recomputes in backward."""
        k, v = self._expand(latent, mla_rotary(k_pos, cos, sin))
        return self._query(q_input, cos, sin), k, v

    def _expand(self, latent: torch.Tensor, k_pos: torch.Tensor):
        """Keys [s, b, local heads, q_head_dim] and values [s, b, local heads, v_head_dim]
        of normalised latents [s, b, kv_lora_rank] and rotated positional keys
        [s, b, 1, qk_pos_emb_head_dim]."""
        c = self.config
        kv = self.linear_kv_up_proj(latent)
        kv = kv.view(*kv.shape[:2], self.local_heads, c.qk_head_dim + c.v_head_dim)
        k_nope, v = torch.split(kv, [c.qk_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pos.expand(-1, -1, self.local_heads, -1)], dim=-1)
        return k, v

    def forward(self, x: torch.Tensor, rotary: Optional[tuple] = None,
                kv_cache: Optional[LayerCache] = None,
                documents: Optional[Documents] = None) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h]; `rotary`: the (cos, sin) tables of MLA's
        positional channels (GPTModel builds them); `kv_cache`: inference over cached
        latents (this step's are appended); `documents`: packed documents' boundaries."""
        c = self.config
        assert rotary is not None, "MLA needs the RoPE tables of its positional channels"
        q_input = self._query_input(x)
        latent, k_pos = torch.split(self.linear_kv_down_proj(x),
                                    [c.kv_lora_rank, c.qk_pos_emb_head_dim], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        # every local head reads the shared positional key: sum its grad over tp
        k_pos = copy_to_tensor_parallel_region(k_pos, self.tp_group)[:, :, None, :]
        if kv_cache is not None:
            query = self._query(q_input, *rotary)
            latents, k_positions = kv_cache.append(latent[:, :, None, :],
                                                   mla_rotary(k_pos, *rotary))
            k, v = self._expand(latents[:, 0].transpose(0, 1), k_positions.permute(2, 0, 1, 3))
            out = self.core_attention.forward_masked(
                query, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), kv_cache.mask)
            return self.linear_proj(out)
        grad = torch.is_grad_enabled()
        if self.recompute_up and grad:
            query, k, v = checkpoint(self._up_projections, self.tracker, q_input, latent, k_pos,
                                     *rotary)
        else:
            query, k, v = self._up_projections(q_input, latent, k_pos, *rotary)
        if self.recompute_core and grad:
            out = checkpoint(self.core_attention, self.tracker, query, k, v, documents)
        else:
            out = self.core_attention(query, k, v, documents)
        return self.linear_proj(out)
