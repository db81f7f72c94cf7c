"""MoELayer: the mixture-of-experts block that takes an MLP's place in a transformer layer.

router -> dispatch -> routed experts -> combine (weighted by the router), plus the shared
experts, as Megatron-Core's MoELayer. Hidden states are sequence-first [s, b, h].

Tensor parallelism (no expert parallelism): every tp rank routes and computes the full
routed part on the full sequence (Megatron-Core's expert-tensor-parallel size 1: experts
replicated over tp). Under sequence parallelism the layer first gathers the sequence and at
the end keeps its slice again, with backwards (split, all-gather) that leave every rank the
complete gradient: router and experts are replicated parameters with equal grads on every tp
rank, tagged as parallel/tensor tags a replicated norm. The shared experts are the dense
tensor-parallel MLP on the layer's own input.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from gigatron.models.config import TransformerConfig
from gigatron.models.losses import LayerLosses
from gigatron.models.moe.config_checks import router_config
from gigatron.models.moe.experts import RoutedExperts
from gigatron.models.moe.router import Router
from gigatron.models.transformer import MLP, output_init_std
from gigatron.parallel.comm import Group
from gigatron.parallel.expert.dispatch import LocalDispatcher, TokenDispatcher
from gigatron.parallel.tensor import gather_from_sequence_parallel_region, tp_size
from gigatron.parallel.tensor.init import InitSpec, set_parallel_attributes
from gigatron.parallel.tensor.mappings import scatter_to_sequence_parallel_region

# builds a layer's dispatcher from the number of routed experts (LocalDispatcher: all here)
DispatcherFactory = Callable[[int], TokenDispatcher]


class MoELayer(nn.Module):
    """Router, routed experts and optional shared experts; adds its balancing losses to
    `layer_losses` in training and counts tokens per expert for models/moe/stats.py."""

    def __init__(self, config: TransformerConfig, tp_group: Group = None,
                 layer_losses: Optional[LayerLosses] = None, layer_number: int = 0,
                 dispatcher_factory: DispatcherFactory = LocalDispatcher,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs num_moe_experts (--num-experts)")
        experts, h = config.num_moe_experts, config.hidden_size
        self.layer_number = layer_number
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel and tp_size(tp_group) > 1
        self.layer_losses = LayerLosses() if layer_losses is None else layer_losses
        self.router = Router(router_config(config), h, config.moe_router_load_balancing_type,
                             config.moe_aux_loss_coeff, config.moe_z_loss_coeff,
                             config.moe_router_dtype, config.init_method_std,
                             config.params_dtype, device)
        self.dispatcher = dispatcher_factory(experts)
        if self.dispatcher.num_local_experts != experts:
            raise NotImplementedError(
                f"MoELayer holds all {experts} experts; a dispatcher with "
                f"{self.dispatcher.num_local_experts} local experts needs expert-parallel "
                f"initialisation, which is not built yet")
        self.experts = RoutedExperts(experts, h, config.moe_ffn_hidden_size, config.activation,
                                     config.moe_grouped_gemm, config.init_method_std,
                                     output_init_std(config), config.params_dtype, device)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = MLP(config, tp_group, device,
                                      ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        self._tag_replicated(config)
        # set by the block while a checkpointed region re-runs: no losses, no counts again
        self.recomputing = False
        self._init_stats(experts)

    def _tag_replicated(self, config: TransformerConfig) -> None:
        """Init specs of the full tensors; not tp-partitioned, complete grads on every rank."""
        std, out_std = config.init_method_std, output_init_std(config)
        for param, scale in ((self.router.weight, std), (self.experts.weight1, std),
                             (self.experts.weight2, out_std)):
            set_parallel_attributes(param, InitSpec("normal", tuple(param.shape), scale))

    def _init_stats(self, experts: int) -> None:
        """Step accumulators on the router's device (the trainer takes them, see stats.py)."""
        device = self.router.weight.device
        zeros = dict(dtype=torch.float32, device=device)
        # since the last take_moe_stats: for logging
        self.register_buffer("stats_tokens_per_expert", torch.zeros(experts, **zeros),
                             persistent=False)
        self.register_buffer("stats_dropped", torch.zeros((), **zeros), persistent=False)
        self.register_buffer("stats_routed", torch.zeros((), **zeros), persistent=False)
        # since the last update_expert_biases: the expert-bias update's counts
        self.register_buffer("bias_tokens_per_expert", torch.zeros(experts, **zeros),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h]."""
        full = x
        if self.sequence_parallel:
            full = gather_from_sequence_parallel_region(x, self.tp_group,
                                                        tensor_parallel_output_grad=False)
        s, b, h = full.shape
        tokens = full.reshape(s * b, h)
        training = self.training and torch.is_grad_enabled()
        # a recompute builds the losses' graph again (checkpoint wants the same saved
        # tensors) but must not add them, or count the tokens, a second time
        routing = self.router(tokens, s, with_losses=training)
        if training and not self.recomputing:
            for name, loss in routing.losses.items():
                self.layer_losses.add(name, loss)
            self._count(routing.routing_map, routing.routed_map)
        dispatched = self.dispatcher.dispatch(tokens, routing.probs, routing.routing_map)
        rows = self.experts.forward_rows(dispatched.rows, dispatched.tokens_per_expert)
        out = self.dispatcher.combine(rows, dispatched).view(s, b, h)
        if self.sequence_parallel:
            out = scatter_to_sequence_parallel_region(out, self.tp_group)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    @torch.no_grad()
    def _count(self, routing_map: torch.Tensor, routed_map: torch.Tensor) -> None:
        """Add this micro-batch's tokens per expert and drops (device ops, no host read)."""
        counts = routing_map.sum(dim=0, dtype=torch.float32)
        self.stats_tokens_per_expert += counts
        self.bias_tokens_per_expert += counts
        self.stats_routed += routed_map.sum(dtype=torch.float32)
        self.stats_dropped += (routed_map & ~routing_map).sum(dtype=torch.float32)
