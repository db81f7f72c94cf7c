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

Expert parallelism (a dispatcher over ep/etp ranks, e.g. parallel/expert/alltoall.py): the
layer holds only its num_experts / ep local experts, each expert's ffn sliced over etp (both
SwiGLU halves sliced, as Megatron-Core's GroupedMLP), initialised as its slice of the full
[E, h, 2f] / [E, f, h] tensors (parallelism-invariant, like parallel/tensor/init.py). The
tokens each rank dispatches must be its own: with tp > 1 the sequence-parallel slice, routed
on that rank (models/moe/sharded_losses.py gives the balancing losses and statistics of the
whole micro-batch). Expert weights carry `expert_parallel` (their grads are reduced over the
expert-data-parallel group, parallel/zero) and are not tagged replicated over tp; the router
weight is tagged sequence-parallel (partial grads, summed over tp).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn

from gigatron.models.config import TransformerConfig
from gigatron.models.losses import LayerLosses
from gigatron.models.moe.config_checks import router_config
from gigatron.models.moe.experts import RoutedExperts
from gigatron.models.moe.router import Router, RouterOutput
from gigatron.models.moe.sharded_losses import tp_reduced_losses
from gigatron.models.transformer import MLP, mlp_activation, output_init_std
from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.expert.dispatch import LocalDispatcher, TokenDispatcher
from gigatron.parallel.tensor import (checkpoint, gather_from_sequence_parallel_region,
                                       tp_size)
from gigatron.parallel.expert.init import mark_expert_parallel
from gigatron.parallel.tensor.init import InitSpec, set_parallel_attributes
from gigatron.parallel.tensor.mappings import scatter_to_sequence_parallel_region
from gigatron.parallel.zero.param_groups import NO_DECAY_ATTR

# builds a layer's dispatcher from the number of routed experts (LocalDispatcher: all here)
DispatcherFactory = Callable[[int], TokenDispatcher]


class MoELayer(nn.Module):
    """Router, routed experts and optional shared experts; adds its balancing losses to
    `layer_losses` in training and counts tokens per expert for models/moe/stats.py."""

    # step accumulators (buffers, see _init_stats)
    stats_tokens_per_expert: torch.Tensor
    stats_dropped: torch.Tensor
    stats_routed: torch.Tensor
    bias_tokens_per_expert: torch.Tensor

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
        self.cp_group: Group = None  # set_context_parallel
        self.sequence_parallel = config.sequence_parallel and tp_size(tp_group) > 1
        self.layer_losses = LayerLosses() if layer_losses is None else layer_losses
        self.router = Router(router_config(config), h, config.moe_router_load_balancing_type,
                             config.moe_aux_loss_coeff, config.moe_z_loss_coeff,
                             config.moe_router_dtype, config.init_method_std,
                             config.params_dtype, device, add_bias=config.add_bias_linear)
        self.dispatcher = dispatcher_factory(experts)
        self.expert_parallel = not isinstance(self.dispatcher, LocalDispatcher)
        if self.expert_parallel and tp_size(tp_group) > 1 and not self.sequence_parallel:
            raise ValueError("expert parallelism with --tensor-model-parallel-size > 1 needs "
                             "--sequence-parallel (as Megatron-Core): add it")
        local, ffn, etp_rank, etp = self._expert_shape(config)
        self.experts = RoutedExperts(local, h, ffn, config.activation,
                                     config.moe_grouped_gemm, config.init_method_std,
                                     output_init_std(config), config.params_dtype, device,
                                     add_bias=config.add_bias_linear,
                                     output_bias_slice=(etp_rank, etp))
        # the gated unit's offset and clamp (gpt-oss's quick GeGLU: 1 and 7)
        self.experts.activation = mlp_activation(config.activation, config.glu_linear_offset,
                                                 config.activation_func_clamp_value)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = MLP(config, tp_group, device,
                                      ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        self.recompute_shared = config.recomputes("shared_experts")
        self._tag(config, etp_rank, etp)
        # set by the block while a checkpointed region re-runs: no losses, no counts again
        self.recomputing = False
        self._init_stats(experts)

    def _expert_shape(self, config: TransformerConfig) -> Tuple[int, int, int, int]:
        """(local experts, local ffn width, etp rank, etp size) of this rank's dispatcher."""
        experts, ffn = config.num_moe_experts, config.moe_ffn_hidden_size
        assert experts is not None and ffn is not None
        local = self.dispatcher.num_local_experts
        if not self.expert_parallel:
            if local != experts:
                raise ValueError(f"MoELayer: a dispatcher with {local} of {experts} local "
                                 "experts must say which (an expert-parallel dispatcher)")
            return experts, ffn, 0, 1
        etp_group = getattr(self.dispatcher, "etp_group", None)
        etp = 1 if etp_group is None else comm.group_size(etp_group)
        if ffn % etp:
            raise ValueError(f"--moe-ffn-hidden-size {ffn} is not divisible by "
                             f"--expert-tensor-parallel-size {etp}: each expert-tensor-parallel "
                             f"rank holds an equal slice of every expert")
        return local, ffn // etp, 0 if etp_group is None else comm.group_rank(etp_group), etp

    def _tag(self, config: TransformerConfig, etp_rank: int, etp: int) -> None:
        """Init specs of the full tensors and how this rank holds them (see the module doc)."""
        std, out_std = config.init_method_std, output_init_std(config)
        experts, h = config.num_moe_experts, config.hidden_size
        assert experts is not None
        for param in (self.router.weight, self.router.bias):
            if param is not None:
                set_parallel_attributes(param, InitSpec("normal", tuple(param.shape), std),
                                        sequence_parallel=self.expert_parallel
                                        and self.sequence_parallel)
        full1 = (experts, h, self.experts.weight1.shape[2] * etp)
        full2 = (experts, self.experts.weight2.shape[1] * etp, h)
        set_parallel_attributes(self.experts.weight1, InitSpec("normal", full1, std))
        set_parallel_attributes(self.experts.weight2, InitSpec("normal", full2, out_std))
        stride = 2 if self.experts.swiglu else 1
        # (param, dim split over etp, its stride): SwiGLU's gate and up halves each sliced
        boxes = [(self.experts.weight1, 2, stride), (self.experts.weight2, 1, 1)]
        if self.experts.bias1 is not None and self.experts.bias2 is not None:
            set_parallel_attributes(self.experts.bias1, InitSpec("zeros", (experts, full1[2])))
            set_parallel_attributes(self.experts.bias2, InitSpec("zeros", (experts, h)))
            boxes += [(self.experts.bias1, 1, stride), (self.experts.bias2, 1, 1)]
            for bias in (self.experts.bias1, self.experts.bias2):
                setattr(bias, NO_DECAY_ATTR, True)  # biases, stacked: no weight decay
        if not self.expert_parallel:
            return
        local = self.dispatcher.num_local_experts
        ep_rank, ep = getattr(self.dispatcher, "first_expert") // local, experts // local
        for param, etp_dim, etp_stride in boxes:
            mark_expert_parallel(param, ((0, ep_rank, ep, 1),
                                         (etp_dim, etp_rank, etp, etp_stride)))

    def _init_stats(self, experts: int) -> None:
        """Step accumulators on the router's device (the trainer takes them, see stats.py)."""
        device = self.router.weight.device

        def zeros(*size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.float32, device=device)

        # since the last take_moe_stats: for logging
        self.register_buffer("stats_tokens_per_expert", zeros(experts), persistent=False)
        self.register_buffer("stats_dropped", zeros(), persistent=False)
        self.register_buffer("stats_routed", zeros(), persistent=False)
        # since the last update_expert_biases: the expert-bias update's counts
        self.register_buffer("bias_tokens_per_expert", zeros(experts), persistent=False)

    def set_context_parallel(self, cp_group: Group) -> None:
        """Under context parallelism each cp rank routes its own sequence chunks: the
        balancing losses and counts are reduced over cp too (sharded_losses.py)."""
        self.cp_group = cp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h]."""
        if self.expert_parallel:
            return self._forward_expert_parallel(x)
        full = x
        if self.sequence_parallel:
            full = gather_from_sequence_parallel_region(x, self.tp_group,
                                                        tensor_parallel_output_grad=False)
        s, b, h = full.shape
        tokens = full.reshape(s * b, h)
        training = self.training and torch.is_grad_enabled()
        # a recompute builds the losses' graph again (checkpoint wants the same saved
        # tensors) but must not add them, or count the tokens, a second time
        if self.cp_group is not None:  # tp ranks hold the same (gathered) tokens here
            routing = self._route_sharded(tokens, s, None)
        else:
            routing = self.router(tokens, s, with_losses=training)
            if training and not self.recomputing:
                for name, loss in routing.losses.items():
                    self.layer_losses.add(name, loss)
                self._add_counts(self._counts(routing.routing_map, routing.routed_map))
        out = self._experts(tokens, routing.probs, routing.routing_map).view(s, b, h)
        if self.sequence_parallel:
            out = scatter_to_sequence_parallel_region(out, self.tp_group)
        return out + self._shared(x) if self.shared_experts is not None else out

    def _forward_expert_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens (its sequence slice under tp) routed here and dispatched to the
        experts' ranks; losses and counts are the micro-batch's (sharded_losses.py)."""
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        routing = self._route_sharded(tokens, s, self.tp_group)
        out = self._experts(tokens, routing.probs, routing.routing_map).view(s, b, h)
        return out + self._shared(x) if self.shared_experts is not None else out

    def _experts(self, tokens: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> torch.Tensor:
        """The routed experts' output of `tokens`: dispatch, experts, combine. Never
        compiled (--torch-compile wraps it in torch.compiler.disable: training/run/
        compile.py): how many tokens each expert gets is data (rows picked by the routing
        map, split sizes read on the host), so dynamo would break the graph at each of
        them; the layer's graph breaks once here instead, around the smallest region that
        holds them all."""
        dispatched = self.dispatcher.dispatch(tokens, probs, routing_map)
        rows = self.experts.forward_rows(dispatched.rows, dispatched.tokens_per_expert)
        return self.dispatcher.combine(rows, dispatched)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts' output (--recompute-modules shared_experts: recomputed)."""
        assert self.shared_experts is not None
        if self.recompute_shared and torch.is_grad_enabled():
            return checkpoint(self.shared_experts, None, x)
        return self.shared_experts(x)

    def _route_sharded(self, tokens: torch.Tensor, s: int, tp_group: Group) -> RouterOutput:
        """The routing of this rank's tokens; in training, the balancing losses and counts
        of the micro-batch, reduced over the ranks that hold its other tokens (`tp_group`,
        the cp group)."""
        logits = self.router.gating(tokens)
        routing = self.router.route_logits(logits)
        if self.training and torch.is_grad_enabled():
            counts = self._counts(routing.routing_map, routing.routed_map)
            losses, counts = tp_reduced_losses(self.router, logits, s, counts, tp_group,
                                               with_losses=True, cp_group=self.cp_group)
            if not self.recomputing:
                for name, loss in losses.items():
                    self.layer_losses.add(name, loss)
                self._add_counts(counts)
        return routing

    @staticmethod
    @torch.no_grad()
    def _counts(routing_map: torch.Tensor, routed_map: torch.Tensor) -> torch.Tensor:
        """[tokens per expert..., routed choices, dropped choices] of one routing (fp32)."""
        return torch.cat([routing_map.sum(dim=0, dtype=torch.float32),
                          routed_map.sum(dtype=torch.float32).view(1),
                          (routed_map & ~routing_map).sum(dtype=torch.float32).view(1)])

    @torch.no_grad()
    def _add_counts(self, counts: torch.Tensor) -> None:
        """Add one micro-batch's counts (`_counts`) to the step's (device ops, no host read)."""
        per_expert = counts[:-2].to(self.stats_tokens_per_expert.dtype)
        self.stats_tokens_per_expert += per_expert
        self.bias_tokens_per_expert += per_expert
        self.stats_routed += counts[-2]
        self.stats_dropped += counts[-1]
