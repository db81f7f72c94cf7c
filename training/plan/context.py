"""Context parallelism in the plan: what the attention keeps and sends on one cp rank.

Each cp rank holds s/cp tokens of every micro-batch (rank i: chunks i and 2cp-1-i of 2cp),
so every per-token activation falls as 1/cp; the causal load balance gives each rank 1/cp
of the attention FLOPs. What differs per --cp-comm-type is what the attention itself keeps
(parallel/context/, measured by bench/bench_context_parallel.py), per local token, with
ad = heads x head_dim / tp and w the activation width (keys/values enter the attention at
the query heads: models/transformer.py repeats a GQA model's before the call):
  p2p         the local queries' storage, the stacked k and v (2 w ad), its output and
              log-sum-exp: torch's fused kernels per block, no s x s tensor
  all_gather  as p2p: blocks through the fused kernels, the gathered k and v not kept (the
              backward gathers them again)
  a2a         the head-split q, k, v and output (4 w ad) and two int64 sequence orders
              (16 s per layer)
  a2a+p2p     as a2a, the orders over the inner group's A x s/cp tokens (16 A s/cp per layer)
Communication per layer and micro-batch, per rank, X = tokens/cp x ad x w (the bench checks
each against parallel/comm's counters):
  p2p         forward (cp-1) 2X, backward (cp-1) 2X + cp 2X; overlapped with the blocks
  all_gather  forward (cp-1) 2X (all-gather), backward (cp-1) 2X gathered again and
              (cp-1) 2X reduce-scattered
  a2a         forward and backward 4X (cp-1)/cp each (all-to-all)
  a2a+p2p     a2a's over the inner group of A (4X (A-1)/A each way, on the link A x tp
              ranks span) and p2p's over the P = cp/A outer groups (the head-split tensors are
              X too; on the link the whole tp x cp span), its hops overlapped as the ring's
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Tuple

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig
    from gigatron.training.config.run_config import ParallelConfig, RunConfig

HIERARCHICAL = "a2a+p2p"


@dataclass(frozen=True)
class ContextLayout:
    """The cp size and comm type of a plan (cp 1: no context parallelism)."""

    cp: int = 1
    comm_type: str = "p2p"
    a2a_size: int = 1  # a2a+p2p: A, the inner group's size (P = cp / A)


NONE = ContextLayout()


def layout_of(parallel: "ParallelConfig") -> ContextLayout:
    """The run's context parallelism as the plan models it."""
    sizes = parallel.hierarchical_context_parallel_sizes
    a2a = sizes[0] if parallel.cp_comm_type == HIERARCHICAL and sizes else 1
    return ContextLayout(parallel.context_parallel_size, parallel.cp_comm_type, a2a)


def parts(layout: ContextLayout) -> List[Tuple[str, int, int]]:
    """(comm type, group size, cp ranks the group spans) of each part of the attention's
    traffic: one, or a2a+p2p's all-to-all within A ranks and ring across the P groups."""
    if layout.comm_type != HIERARCHICAL:
        return [(layout.comm_type, layout.cp, layout.cp)]
    a2a = layout.a2a_size
    return [("a2a", a2a, a2a), ("p2p", layout.cp // a2a, layout.cp)]


def attention_held(layout: ContextLayout, q_storage: float, w: int, ad: float,
                   seq_length: int) -> Tuple[float, float]:
    """(bytes the cp attention keeps per local token, bytes per layer and micro-batch) on
    top of the log-sum-exp; `q_storage`: the local queries' storage per token."""
    if layout.comm_type in ("p2p", "all_gather"):
        return q_storage + 2 * w * ad, 0.0
    if layout.comm_type == HIERARCHICAL:  # the orders index the inner group's tokens
        return 4 * w * ad, 16.0 * seq_length * layout.a2a_size / layout.cp
    return 4 * w * ad, 16.0 * seq_length


def layer_bytes(comm_type: str, group: int, local_tokens: float, ad: float, w: int
                ) -> Tuple[float, float]:
    """(forward, backward) bytes one rank sends for one layer's attention, one micro-batch,
    in a `comm_type` group of `group` ranks (one of `parts`)."""
    if group == 1:
        return 0.0, 0.0
    x = local_tokens * ad * w
    if comm_type == "p2p":
        return (group - 1) * 2 * x, (group - 1) * 2 * x + group * 2 * x
    if comm_type == "all_gather":
        return (group - 1) * 2 * x, 2 * (group - 1) * 2 * x
    return 4 * x * (group - 1) / group, 4 * x * (group - 1) / group


def layer_time(comm_type: str, forward_bytes: float, backward_bytes: float,
               rate: float, core_forward: float) -> Tuple[float, float]:
    """(forward, backward) seconds the layer waits on cp traffic at `rate` bytes/s: the
    ring's hops hide behind its blocks' compute (core_forward, twice that backward); the
    collectives of all_gather and a2a are not overlapped."""
    forward, backward = forward_bytes / rate, backward_bytes / rate
    if comm_type == "p2p":
        return max(0.0, forward - core_forward), max(0.0, backward - 2 * core_forward)
    return forward, backward


def head_width(c: "TransformerConfig") -> int:
    """Channels per head of the k and v the cp attention exchanges: the head size, or MLA's
    q/k head and v head zero-padded to the wider of the two (models/attention/core.py pads
    them before the cp call: one head size for its blocks)."""
    if not c.multi_latent_attention:
        return c.head_dim
    return max(c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim)


def layer_traffic(run: "RunConfig", tokens: int, core_forward: float,
                  rate_of: Callable[[int], float]) -> Dict[str, float]:
    """One layer's context-parallel traffic per micro-batch: the seconds its forward and
    backward wait, and per step's share its bytes, transfer and exposed time (`rate_of(
    extent)`: bytes/s of a group within `extent` consecutive ranks; the cp group spans
    tp x cp of them, tp-cp-dp-pp). Recomputation (full, or selective with core_attn or
    torchtitan's op rule) runs the forward's exchange again in the backward."""
    c, p = run.model, run.parallel
    assert c is not None
    layout = layout_of(p)
    out = dict.fromkeys(("fwd_s", "bwd_s", "bytes", "step_s", "exposed_s"), 0.0)
    if layout.cp == 1:
        return out
    again = 1 if c.recompute_granularity == "full" or c.recomputes("core_attn") or \
        (c.recompute_granularity == "selective" and c.selective_ac_option == "op") else 0
    for comm_type, group, span in parts(layout):  # a2a+p2p: a2a within A, ring over P
        fwd_b, bwd_b = layer_bytes(comm_type, group, tokens, c.num_attention_heads *
                                   head_width(c) / p.tp, c.params_dtype.itemsize)
        rate = rate_of(p.tp * span)
        fwd_s, bwd_s = layer_time(comm_type, fwd_b, bwd_b, rate, core_forward)
        out["fwd_s"] += fwd_s
        out["bwd_s"] += bwd_s + again * fwd_s
        out["bytes"] += (1 + again) * fwd_b + bwd_b
        out["step_s"] += ((1 + again) * fwd_b + bwd_b) / rate
        out["exposed_s"] += (1 + again) * fwd_s + bwd_s
    return out
