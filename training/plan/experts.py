"""What an MoE layer costs beyond a dense one: its matmuls, element-wise bytes, token exchange.

With expert parallelism (memory.routed_share), the layer is modelled as Megatron-Core lays
it out and parallel/expert's dispatchers run it: each tensor-parallel rank routes 1/tp of
the micro-batch's tokens (its sequence-parallel slice); the alltoall dispatcher sends each routed token's h-vector to the ep rank of each of
its top-k experts (the share (ep-1)/ep leaves the rank), all-gathers the received rows over
the expert-tensor-parallel group, and the combine returns them the same way (reduce-scatter,
all-to-all); the allgather dispatcher gathers every token of the ep x etp group (hidden
states, router probabilities and routing map) and reduce-scatters the outputs. Routing is
taken as balanced: each rank's experts compute topk x etp / tp rows per token, 1/etp of the
ffn each. Backward moves the same bytes as forward; full recomputation runs the forward's
exchange again. The exchange is not overlapped with compute (Megatron-Core's default path):
its whole time is on the critical path of every MoE layer. The link is the one the group's
ranks span (etp varies fastest in the expert grid, then ep): NVLink while etp x ep ranks fit
in a node, else the network, as cost.py decides for tp and dp. Without it (ep 1, etp = tp)
every tp rank routes every token through whole experts and nothing is exchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Tuple

from gigatron.training.plan.memory import routed_share
from gigatron.training.plan.parameters import is_expert_parallel

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig


@dataclass(frozen=True)
class MoELayerCost:
    """One MoE layer's micro-batch on one rank, as differences from a dense layer's."""

    flops: float  # forward matmul FLOPs beyond the dense layer's
    element_bytes: float  # forward element-wise bytes beyond the dense layer's
    tp_collectives: float  # tensor-parallel collectives per pass beyond the dense layer's
    exchange_forward_bytes: float  # token exchange, bytes this rank sends/receives
    exchange_backward_bytes: float
    exchange_forward_s: float
    exchange_backward_s: float


def _dense_mlp(c: "TransformerConfig", tokens: int, tp: int) -> Tuple[float, float]:
    """(forward FLOPs, element-wise bytes) of the dense MLP an MoE layer replaces."""
    glu = c.activation in ("swiglu", "quick_geglu")
    ffn = c.ffn_hidden_size
    flops = 2.0 * tokens * (c.hidden_size * (2 * ffn if glu else ffn) + ffn * c.hidden_size) / tp
    return flops, (3 if glu else 2) * c.params_dtype.itemsize * ffn / tp * tokens


def moe_mlp_flops(c: "TransformerConfig", tokens: int, tp: int, ep: int, etp: int) -> float:
    """Forward matmul FLOPs of an MoE layer's MLP part on one rank: router and top-k expert
    rows of the tokens it routes (balanced), shared experts (tensor-parallel)."""
    h, k, e, f = c.hidden_size, c.moe_router_topk, c.num_moe_experts, c.moe_ffn_hidden_size
    assert e is not None and f is not None
    fc1 = 2 * f if c.activation in ("swiglu", "quick_geglu") else f
    flops = 2.0 * tokens * routed_share(tp, ep, etp)[0] * (h * e + k * (h * fc1 + f * h))
    shared = c.moe_shared_expert_intermediate_size
    if shared:
        shared_fc1 = 2 * shared if fc1 == 2 * f else shared
        flops += 2.0 * tokens * (h * shared_fc1 + shared * h) / tp
    return flops


def exchange_bytes(c: "TransformerConfig", tokens: int, tp: int, ep: int,
                   etp: int) -> Tuple[float, float]:
    """(forward, backward) bytes one rank's token exchange moves for one MoE layer and one
    micro-batch of `tokens` tokens, by the dispatcher's collectives (module docstring):
    alltoall: dispatch + combine all-to-all, each tokens/tp x topk x h x (ep-1)/ep, and the
    etp all-gather + reduce-scatter of the rows, each (etp-1) x tokens/tp x topk x h;
    allgather: (ep x etp - 1) x tokens/tp x (h gathered + h reduce-scattered + E probs and
    routing map gathered; backward the probs' gradient, not the map's)."""
    w, h, k, e = c.params_dtype.itemsize, c.hidden_size, c.moe_router_topk, c.num_moe_experts
    assert e is not None
    local = tokens / tp
    if not is_expert_parallel(tp, ep, etp):  # every expert here: no dispatcher collectives
        return 0.0, 0.0
    if c.moe_token_dispatcher_type == "alltoall":
        one_way = local * k * h * w * (ep - 1) / ep + (etp - 1) * local * k * h * w
        return 2 * one_way, 2 * one_way
    others = ep * etp - 1
    return others * local * (2 * h * w + e * (w + 1)), others * local * (2 * h * w + e * w)


def exchange_time(c: "TransformerConfig", tokens: int, tp: int, ep: int, etp: int,
                  rate: Callable[[int], float]) -> Tuple[float, float]:
    """(forward, backward) seconds of `exchange_bytes`; `rate(extent)`: bytes/s a group
    spanning `extent` consecutive ranks sustains."""
    forward, backward = exchange_bytes(c, tokens, tp, ep, etp)
    if forward == 0.0:
        return 0.0, 0.0
    if c.moe_token_dispatcher_type == "alltoall":  # two links: ep's all-to-all, etp's gather
        etp_part = 2 * (etp - 1) * tokens / tp * c.moe_router_topk * c.hidden_size * \
            c.params_dtype.itemsize
        ep_part = forward - etp_part
        one = (ep_part / rate(etp * ep) if ep > 1 else 0.0) + \
            (etp_part / rate(etp) if etp > 1 else 0.0)
        return one, one
    if ep * etp == 1:
        return 0.0, 0.0
    group = rate(ep * etp)
    return forward / group, backward / group


def moe_layer_cost(c: "TransformerConfig", tokens: int, tp: int, ep: int, etp: int,
                   rate: Callable[[int], float]) -> MoELayerCost:
    """An MoE layer's forward beyond a dense layer's, on one rank, for one micro-batch."""
    w, h, k, e = c.params_dtype.itemsize, c.hidden_size, c.moe_router_topk, c.num_moe_experts
    assert e is not None and c.moe_ffn_hidden_size is not None
    glu = 3 if c.activation in ("swiglu", "quick_geglu") else 2
    dense_flops, dense_bytes = _dense_mlp(c, tokens, tp)
    shared = c.moe_shared_expert_intermediate_size or 0
    share = routed_share(tp, ep, etp)[0]
    # expert activations (rows k etp share per token, ffn / etp wide), permute / weight /
    # un-permute copies of each row, the router's softmax and top-k; shared experts'
    element = tokens * (share * (glu * w * k * c.moe_ffn_hidden_size + 5 * w * h * k + 16 * e)
                        + glu * w * shared / tp)
    forward_bytes, backward_bytes = exchange_bytes(c, tokens, tp, ep, etp)
    forward_s, backward_s = exchange_time(c, tokens, tp, ep, etp, rate)
    # the dense MLP's tp collective goes (the attention's stays), the shared experts bring
    # theirs; without expert parallelism under sequence parallelism the layer all-gathers
    # its input (half a collective each way)
    replicated_sp = not is_expert_parallel(tp, ep, etp) and tp > 1 and c.sequence_parallel
    collectives = -1.0 + (0.5 if replicated_sp else 0.0) + (1.0 if shared else 0.0)
    return MoELayerCost(moe_mlp_flops(c, tokens, tp, ep, etp) - dense_flops,
                        element - dense_bytes, collectives, forward_bytes, backward_bytes,
                        forward_s, backward_s)
