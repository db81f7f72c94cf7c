"""The trainer's side of mixture-of-experts layers: the expert-bias update after each step and
what the log line shows of the routing.

After every optimizer step (`after_step`, device ops only) the aux-loss-free expert biases move
towards balance from the step's token counts (`models.moe.stats.update_expert_biases`).
Megatron-Core all-reduces those counts over tensor x data (x context) parallel ranks because
its tensor-parallel ranks may route different sequence shards. In gigatron the counts a layer
keeps already cover its whole micro-batch: with expert parallelism each tp rank routes its
sequence-parallel slice and the layer sums the counts over tp in the same all-reduce as its
balancing losses (models/moe/sharded_losses.py); without it the layer routes the gathered
sequence; under context parallelism the layer sums them over cp as well. So the
data-parallel group is the one left whose ranks routed different tokens. The step's
balancing losses (the executor's `aux_losses`, summed over micro-batches and this rank's MoE
layers) are added up on the device. At a log line (`log_fields`, collective) one all-reduce brings every stage's losses
and per-layer statistics to every rank, and the host reads them once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig

# layer-loss name -> the TransformerConfig coefficient it was multiplied by
MOE_LOSSES = {"load_balancing_loss": "moe_aux_loss_coeff", "z_loss": "moe_z_loss_coeff"}
IMBALANCE, DROPPED = "tokens_per_expert_max_over_mean", "dropped_token_share"


class MoETraining:
    """One run's MoE bookkeeping: `after_step` once per optimizer step, `log_fields` at each
    log line (every rank)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], config: "TransformerConfig",
                 dp_group: Group, ranks_per_stage: int, device: torch.device) -> None:
        from gigatron.models.moe.config_checks import moe_layer_pattern
        from gigatron.models.mtp.block import mtp_layer_config

        self.chunks, self.config, self.dp_group = list(chunks), config, dp_group
        self.ranks_per_stage, self.device = ranks_per_stage, device
        # multi-token prediction's MoE layers (numbered after the decoder's) count too, as
        # Megatron-LM's track_moe_metrics counts them
        pattern = moe_layer_pattern(mtp_layer_config(config) if config.mtp_num_layers
                                    else config)
        self.layers = [n for n, moe in enumerate(pattern) if moe]
        self.loss_sums: Dict[str, torch.Tensor] = {}  # per-step means, summed (device)
        self.steps = 0

    def after_step(self, aux_losses: Mapping[str, torch.Tensor], num_microbatches: int) -> None:
        """After the optimizer step: update the expert biases (with
        --moe-router-enable-expert-bias) and add the step's balancing losses, averaged over
        its micro-batches; no host read."""
        from gigatron.models.moe.stats import update_expert_biases

        if self.config.moe_router_enable_expert_bias:
            update_expert_biases(self.chunks, self.dp_group)
        for name in MOE_LOSSES:
            if name in aux_losses:
                value = aux_losses[name].detach().double() / num_microbatches
                seen = self.loss_sums.get(name)
                self.loss_sums[name] = value if seen is None else seen + value
        self.steps += 1

    def log_fields(self) -> Dict[str, Any]:
        """Collective: the interval's balancing losses as Megatron logs them (without their
        coefficient, the mean over MoE layers, micro-batches, steps and data-parallel
        ranks) and per MoE layer its tokens-per-expert max/mean and, with a capacity, the
        share of dropped (token, expert) choices (the mean over the stage's ranks of each
        rank's own tokens); resets the interval."""
        from gigatron.models.moe.stats import take_moe_stats

        terms = self._local_terms(take_moe_stats(self.chunks))
        comm.all_reduce(terms)
        values = [v / self.ranks_per_stage for v in terms.tolist()]
        fields: Dict[str, Any] = {}
        for index, (name, coeff_field) in enumerate(MOE_LOSSES.items()):
            coeff = getattr(self.config, coeff_field) or 0.0
            if coeff > 0 and self.steps:
                fields[name] = values[index] / (coeff * len(self.layers) * self.steps)
        per_layer = self._per_layer(values[len(MOE_LOSSES):])
        fields["moe"] = per_layer
        imbalance = [v for k, v in per_layer.items() if k.endswith(IMBALANCE)]
        if imbalance:
            fields[IMBALANCE] = max(imbalance)
        dropped = [v for k, v in per_layer.items() if k.endswith(DROPPED)]
        if dropped:
            fields[DROPPED] = sum(dropped) / len(dropped)
        self.loss_sums, self.steps = {}, 0
        return fields

    def _local_terms(self, stats: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """[load-balancing sum, z-loss sum, imbalance per MoE layer, dropped share per MoE
        layer]: this rank's share, zero for what other stages hold."""
        dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        n = len(self.layers)
        terms = torch.zeros(len(MOE_LOSSES) + 2 * n, dtype=dtype, device=self.device)
        for index, name in enumerate(MOE_LOSSES):
            if name in self.loss_sums:
                terms[index] = self.loss_sums[name].to(dtype)
        for slot, layer in enumerate(self.layers):
            for offset, kind in ((0, IMBALANCE), (n, DROPPED)):
                value = stats.get(f"moe/layer_{layer}/{kind}")
                if value is not None:
                    terms[len(MOE_LOSSES) + offset + slot] = value.to(dtype)
        return terms

    def _per_layer(self, values: List[float]) -> Dict[str, float]:
        """'layer_{n}/tokens_per_expert_max_over_mean' (and '/dropped_token_share' with a
        capacity) per MoE layer n (the global layer number, from 0)."""
        n, out = len(self.layers), {}
        for slot, layer in enumerate(self.layers):
            out[f"layer_{layer}/{IMBALANCE}"] = values[slot]
            if (self.config.moe_expert_capacity_factor or 0) > 0:  # negative: dropless
                out[f"layer_{layer}/{DROPPED}"] = values[n + slot]
        return out


def moe_training(chunks: Sequence[torch.nn.Module], config: "TransformerConfig",
                 dp_group: Group, ranks_per_stage: int,
                 device: torch.device) -> Optional[MoETraining]:
    """The run's MoE bookkeeping; None for a dense model."""
    if config.num_moe_experts is None:
        return None
    return MoETraining(chunks, config, dp_group, ranks_per_stage, device)
