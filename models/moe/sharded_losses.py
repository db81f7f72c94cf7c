"""The router's balancing losses when the tensor-parallel ranks route different tokens.

Under expert parallelism with tp > 1 each tp rank routes its own sequence-parallel slice of
the micro-batch. The switch loss and the z-loss are sums over tokens, so each rank reduces
its per-expert score sums, token counts and z-loss sum over tp in one all-reduce (forward:
sum; backward: identity, so each rank's scores get the full loss's gradient for its own
tokens) and every rank computes the loss of the whole micro-batch: the same value as one
device, and router grads that sum over tp to one device's (the router weight is tagged
sequence-parallel, whose grads the optimizer all-reduces over tp).

Under context parallelism each cp rank holds its own chunks of the sequence, so the same sums
are reduced over cp as well (Megatron-Core reduces the token counts over tp x cp), with or
without expert parallelism. The optimizer averages dense grads over dp x cp, so a cp rank's
share of the loss's gradient is scaled by cp (the value stays the micro-batch's), as the LM
loss of a cp rank is.

The same all-reduce carries the layer's routing statistics (tokens per expert, routed and
dropped choices), so the step's counts are the micro-batch's on every tp and cp rank.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from gigatron.models.moe.router import Router, scores_for_aux_loss, switch_load_balancing_loss
from gigatron.parallel.comm import Group
from gigatron.parallel.tensor import tp_size
from gigatron.parallel.tensor.mappings import reduce_from_tensor_parallel_region


def _aux_terms(router: Router, logits: torch.Tensor, local_seq: int
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's (score sums, token counts) of the switch loss: per expert for aux_loss,
    per (sequence, expert) for seq_aux_loss."""
    config = router.config
    routing_map, scores = scores_for_aux_loss(logits, config.topk, config.score_function)
    if router.load_balancing_type == "seq_aux_loss":
        width = logits.shape[0] // local_seq * logits.shape[1]
        scores, routing_map = scores.reshape(local_seq, width), routing_map.reshape(local_seq,
                                                                                    width)
    return scores.sum(dim=0), routing_map.sum(dim=0).to(scores.dtype)


def tp_reduced_losses(router: Router, logits: torch.Tensor, local_seq: int,
                      stats: torch.Tensor, tp_group: Group, with_losses: bool,
                      cp_group: Group = None
                      ) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """(the micro-batch's balancing losses by layer-loss name, `stats` summed over tp x cp)
    from this rank's logits [local_seq * b, E] (sequence-major) and statistics vector;
    `tp_group` None: the tp ranks hold the same tokens."""
    ranks = tp_size(tp_group) * tp_size(cp_group)  # that split the micro-batch's tokens
    num_tokens, num_experts = logits.shape
    aux = with_losses and router.aux_loss_coeff > 0 and \
        router.load_balancing_type in ("aux_loss", "seq_aux_loss")
    z = with_losses and router.z_loss_coeff is not None
    dtype = torch.promote_types(logits.dtype, torch.float32)  # fp64 with --moe-router-dtype fp64
    pieces = []
    if aux:
        pieces += list(_aux_terms(router, logits, local_seq))
    if z:
        pieces.append(torch.logsumexp(logits, dim=-1).square().sum().view(1))
    pieces = [p.to(dtype) for p in pieces] + [stats.to(dtype)]
    sizes = [p.numel() for p in pieces]
    reduced = torch.cat(pieces)
    for group in (tp_group, cp_group):
        if tp_size(group) > 1:
            reduced = reduce_from_tensor_parallel_region(reduced, group)
    reduced = reduced.split(sizes)
    losses: Dict[str, torch.Tensor] = {}
    topk, coeff = router.config.topk, router.aux_loss_coeff
    if aux:
        score_sums, counts = reduced[0], reduced[1]
        if router.load_balancing_type == "aux_loss":
            losses["load_balancing_loss"] = switch_load_balancing_loss(
                score_sums.unsqueeze(0), counts, num_tokens * ranks, topk, num_experts, coeff)
        else:
            batch = num_tokens // local_seq
            losses["load_balancing_loss"] = switch_load_balancing_loss(
                score_sums.unsqueeze(0), counts, local_seq * ranks, topk, num_experts,
                coeff) / batch
    if z:
        z_sum = reduced[2 if aux else 0]
        losses["z_loss"] = (z_sum / (num_tokens * ranks) * router.z_loss_coeff).squeeze(0)
    cp = tp_size(cp_group)
    if cp > 1:  # dense grads are averaged over dp x cp: each cp rank's share counts cp times
        losses = {k: v + (cp - 1) * (v - v.detach()) for k, v in losses.items()}
    return losses, reduced[-1].detach()
