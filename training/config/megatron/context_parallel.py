"""Megatron-Core's context-parallel flags checked against the model: one line per problem.

--context-parallel-size splits each sequence over cp ranks (parallel/context/split.py's
load-balanced chunks); --cp-comm-type picks how the attention sees the other ranks' keys and
values (parallel/context/attention.py), a2a+p2p in the sub-groups that
--hierarchical-context-parallel-sizes A P gives (A x P = cp, heads per tp rank divisible by A). What the split cannot do is refused here, before any
process group exists.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig
    from gigatron.training.config.table import Settings
    from gigatron.training.config.validation import Problems

_FLAG = "--context-parallel-size"


def context_parallel_problems(s: "Settings", model: Optional["TransformerConfig"],
                              p: "Problems") -> None:
    """Lines for the context-parallel layouts the model or the other flags cannot run."""
    from gigatron.parallel.context.split import (HIERARCHICAL_FLAG, check_context_parallel,
                                                 check_hierarchical_sizes)

    cp, comm_type, tp = (s.parallel.context_parallel_size, s.parallel.cp_comm_type,
                         s.parallel.tp)
    sizes = s.parallel.hierarchical_context_parallel_sizes
    if comm_type == "a2a+p2p":
        p.run(check_hierarchical_sizes, cp, sizes)
    if cp == 1 or model is None:
        return
    heads = model.num_attention_heads
    p.run(check_context_parallel, model.seq_length, cp, heads, model.num_query_groups,
          "p2p" if comm_type in ("a2a", "a2a+p2p") else comm_type)
    if comm_type == "a2a+p2p" and sizes and len(sizes) == 2 and heads % tp == 0 and \
            (heads // tp) % sizes[0]:
        p.add(f"--cp-comm-type a2a+p2p splits each tensor-parallel rank's heads over the a2a "
              f"size, but --num-attention-heads {heads} / --tensor-model-parallel-size {tp} = "
              f"{heads // tp} is not divisible by the a2a size {sizes[0]} of "
              f"{HIERARCHICAL_FLAG}: pick an a2a size that divides it")
    if comm_type == "a2a" and heads % tp == 0 and (heads // tp) % cp:
        p.add(f"--cp-comm-type a2a splits each tensor-parallel rank's heads over cp, but "
              f"--num-attention-heads {heads} / --tensor-model-parallel-size {tp} = "
              f"{heads // tp} is not divisible by {_FLAG} {cp}: pick a cp that divides it, or "
              f"--cp-comm-type p2p")
    seq = model.seq_length
    if model.sequence_parallel and tp > 1 and seq % (2 * cp) == 0 and (seq // cp) % tp:
        multiple = math.lcm(2 * cp, cp * tp)
        p.add(f"--seq-length {seq} / {_FLAG} {cp} = {seq // cp} tokens per cp rank are not "
              f"divisible by --tensor-model-parallel-size {tp} (--sequence-parallel splits "
              f"them over tp): pick a --seq-length that is a multiple of {multiple}")
    if model.attention_dropout:
        p.add(f"--attention-dropout {model.attention_dropout} with {_FLAG} {cp}: attention "
              f"dropout under context parallelism is not supported; set --attention-dropout 0")
