"""What the trainer asks of a model's MoE layers once per step: their routing statistics for
the log, and the aux-loss-free expert-bias update (Megatron-Core's, arXiv 2408.15664).

Each MoELayer counts, per micro-batch forward in training, the tokens its router sent to
each expert and the (token, expert) choices capacity dropped, on the device; nothing here
reads them on the host: `take_moe_stats` returns device scalars for the logger to read.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch import nn

from gigatron.models.moe.layer import MoELayer
from gigatron.models.moe.router import updated_expert_bias
from gigatron.parallel import comm
from gigatron.parallel.comm import Group


def moe_layers(chunks: Sequence[nn.Module]) -> List[MoELayer]:
    """The MoE layers of this rank's model chunks, in chunk then layer order."""
    return [module for chunk in chunks for module in chunk.modules()
            if isinstance(module, MoELayer)]


@torch.no_grad()
def take_moe_stats(chunks: Sequence[nn.Module]) -> Dict[str, torch.Tensor]:
    """Per MoE layer since the last take, as 0-d device tensors, and reset them:
    `moe/layer_{n}/tokens_per_expert_max_over_mean` (1.0 = perfectly even; this rank's
    tokens) and, with a capacity factor, `moe/layer_{n}/dropped_token_share` (dropped
    (token, expert) choices over routed ones). n is the global layer number."""
    out: Dict[str, torch.Tensor] = {}
    for layer in moe_layers(chunks):
        counts = layer.stats_tokens_per_expert
        prefix = f"moe/layer_{layer.layer_number}"
        out[f"{prefix}/tokens_per_expert_max_over_mean"] = \
            counts.max() / counts.mean().clamp(min=1e-20)
        if layer.router.config.capacity_factor is not None:
            out[f"{prefix}/dropped_token_share"] = \
                layer.stats_dropped / layer.stats_routed.clamp(min=1.0)
        for buffer in (counts, layer.stats_dropped, layer.stats_routed):
            buffer.zero_()
    return out


@torch.no_grad()
def update_expert_biases(chunks: Sequence[nn.Module], group: Group = None) -> None:
    """After an optimizer step: move each expert bias by +-rate towards balance, from the
    step's token counts summed over `group` (the ranks that routed different tokens to the
    same experts: data (and context) parallel; tp ranks route the same tokens, so leave
    them out), then reset the counts. One all-reduce for all layers."""
    layers = [layer for layer in moe_layers(chunks) if layer.router.expert_bias is not None]
    if not layers:
        return
    counts = torch.cat([layer.bias_tokens_per_expert for layer in layers])
    comm.all_reduce(counts, group=group)
    for layer, layer_counts in zip(layers, counts.split([layer.bias_tokens_per_expert.numel()
                                                           for layer in layers])):
        bias = layer.router.expert_bias
        assert bias is not None
        bias.copy_(updated_expert_bias(layer_counts, bias, layer.router.config.bias_update_rate))
        layer.bias_tokens_per_expert.zero_()
