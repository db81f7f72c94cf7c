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
Communication per layer and micro-batch, per rank, X = tokens/cp x ad x w (the bench checks
each against parallel/comm's counters):
  p2p         forward (cp-1) 2X, backward (cp-1) 2X + cp 2X; overlapped with the blocks
  all_gather  forward (cp-1) 2X (all-gather), backward (cp-1) 2X gathered again and
              (cp-1) 2X reduce-scattered
  a2a         forward and backward 4X (cp-1)/cp each (all-to-all)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class ContextLayout:
    """The cp size and comm type of a plan (cp 1: no context parallelism)."""

    cp: int = 1
    comm_type: str = "p2p"


NONE = ContextLayout()


def attention_held(layout: ContextLayout, q_storage: float, w: int, ad: float,
                   seq_length: int) -> Tuple[float, float]:
    """(bytes the cp attention keeps per local token, bytes per layer and micro-batch) on
    top of the log-sum-exp; `q_storage`: the local queries' storage per token."""
    if layout.comm_type in ("p2p", "all_gather"):
        return q_storage + 2 * w * ad, 0.0
    return 4 * w * ad, 16.0 * seq_length


def layer_bytes(layout: ContextLayout, local_tokens: float, ad: float, w: int
                ) -> Tuple[float, float]:
    """(forward, backward) bytes one rank sends for one layer's attention, one micro-batch."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    x = local_tokens * ad * w
    if layout.comm_type == "p2p":
        return (cp - 1) * 2 * x, (cp - 1) * 2 * x + cp * 2 * x
    if layout.comm_type == "all_gather":
        return (cp - 1) * 2 * x, 2 * (cp - 1) * 2 * x
    return 4 * x * (cp - 1) / cp, 4 * x * (cp - 1) / cp


def layer_time(layout: ContextLayout, forward_bytes: float, backward_bytes: float,
               rate: float, core_forward: float) -> Tuple[float, float]:
    """(forward, backward) seconds the layer waits on cp traffic at `rate` bytes/s: the
    ring's hops hide behind its blocks' compute (core_forward, twice that backward); the
    collectives of all_gather and a2a are not overlapped."""
    forward, backward = forward_bytes / rate, backward_bytes / rate
    if layout.comm_type == "p2p":
        return max(0.0, forward - core_forward), max(0.0, backward - 2 * core_forward)
    return forward, backward
