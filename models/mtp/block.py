"""The multi-token prediction modules, as Megatron-Core builds them (DeepSeek-V3's MTP).

Module k (1 .. D) takes the hidden state h_{k-1} of each position i (the main model's
output after its final norm for k = 1) and the embedding of token i + k (the input ids
rolled left k times, the last places filled with id 0 as `roll_left` does), and computes

    h_k = final_layernorm(transformer_layer(eh_proj(cat(enorm(emb), hnorm(h_{k-1})))))

with the embedding and output layer shared with the main model (passed in at call time,
never owned here). `eh_proj` is column-parallel 2h -> h, gathered over tp (and split back
over the sequence under sequence parallelism); the transformer layer is of the kind the
last decoder layer is (dense or MoE, windowed or not: Megatron-Core's MTP spec takes the
decoder's last layer spec), numbered num_layers + k - 1 (0-based). Parameter names are
Megatron-Core's: mtp.layers.{k-1}.{enorm,hnorm,eh_proj,transformer_layer,final_layernorm}.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional

import torch
from torch import nn

from gigatron.models.attention_kinds import is_window_layer
from gigatron.models.config import TransformerConfig
from gigatron.models.losses import LayerLosses
from gigatron.models.moe.config_checks import moe_layer_pattern
from gigatron.models.transformer import Norm, TransformerLayer
from gigatron.parallel.tensor import ColumnParallelLinear, tp_size
from gigatron.parallel.tensor.mappings import scatter_to_sequence_parallel_region
from gigatron.parallel.comm import Group


def roll_left(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` [b, s] shifted one place left along the sequence, the last place 0
    (Megatron-Core's roll_tensor without context parallelism)."""
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    rolled[..., -1] = 0
    return rolled


def mtp_layer_config(config: TransformerConfig) -> TransformerConfig:
    """The config the MTP transformer layers are built from: the decoder's, with the
    per-layer patterns (MoE, sliding window) extended so layers num_layers .. num_layers +
    D - 1 are of the last decoder layer's kind."""
    depth, last = config.mtp_num_layers or 0, config.num_layers - 1
    changes: dict = {"num_layers": config.num_layers + depth}
    if config.num_moe_experts is not None:
        pattern = moe_layer_pattern(config)
        changes["moe_layer_freq"] = [int(m) for m in pattern + [pattern[-1]] * depth]
    if config.window_size and config.window_attn_skip_freq is not None:
        windows = [int(is_window_layer(config, n)) for n in range(config.num_layers)]
        changes["window_attn_skip_freq"] = windows + [windows[last]] * depth
    return dataclasses.replace(config, **changes)


class MultiTokenPredictionLayer(nn.Module):
    """Depth k of multi-token prediction (its hidden state predicts token i + k + 1)."""

    def __init__(self, config: TransformerConfig, layer_config: TransformerConfig,
                 layer_number: int, tp_group: Group, tracker: Any,
                 device: Optional[torch.device] = None,
                 layer_losses: Optional[LayerLosses] = None,
                 dispatcher_factory: Optional[Callable] = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel and tp_size(tp_group) > 1
        sp, h = self.sequence_parallel, config.hidden_size
        self.enorm = Norm(config, sp, device)
        self.hnorm = Norm(config, sp, device)
        # input: cat(embedding, hidden) as Megatron-Core orders it
        self.eh_proj = ColumnParallelLinear(
            2 * h, h, tp_group=tp_group, bias=False, gather_output=True,
            sequence_parallel=sp, init_std=config.init_method_std,
            params_dtype=config.params_dtype, device=device)
        self.transformer_layer = TransformerLayer(layer_config, tp_group, tracker, device,
                                                  layer_number, layer_losses,
                                                  dispatcher_factory)
        self.final_layernorm = Norm(config, sp, device)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor,
                rotary: Optional[tuple], documents: Any) -> torch.Tensor:
        """`hidden` h_{k-1} and `embedded` (the embedding of token i + k), both [s(/tp), b, h]."""
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        if self.sequence_parallel:  # gathered over tp: back to this rank's sequence slice
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        x = self.transformer_layer(x, rotary, None, documents)
        return self.final_layernorm(x)


class MultiTokenPredictionBlock(nn.Module):
    """The D modules of multi-token prediction, on the stage with the output layer."""

    def __init__(self, config: TransformerConfig, tp_group: Group, tracker: Any,
                 device: Optional[torch.device] = None,
                 layer_losses: Optional[LayerLosses] = None,
                 dispatcher_factory: Optional[Callable] = None) -> None:
        super().__init__()
        layer_config = mtp_layer_config(config)
        self.layers = nn.ModuleList([
            MultiTokenPredictionLayer(config, layer_config, config.num_layers + k, tp_group,
                                      tracker, device, layer_losses, dispatcher_factory)
            for k in range(config.mtp_num_layers or 0)])

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor,
                position_ids: Optional[torch.Tensor],
                embed: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor],
                rotary: Optional[tuple], documents: Any) -> List[torch.Tensor]:
        """The hidden states of depths 1 .. D ([s(/tp), b, h] each) from the main model's
        final `hidden`; `embed(ids, positions)` is the main model's embedding. The ids
        and positions roll one place further at each depth (Megatron-Core's)."""
        outputs = []
        for layer in self.layers:
            input_ids = roll_left(input_ids)
            if position_ids is not None:
                position_ids = roll_left(position_ids)
            hidden = layer(hidden, embed(input_ids, position_ids), rotary, documents)
            outputs.append(hidden)
        return outputs
