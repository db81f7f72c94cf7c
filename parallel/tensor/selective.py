"""torchtitan's op-level selective activation checkpointing, as a policy for `checkpoint`.

torchtitan (`activation_checkpoint.mode = "selective"`, `selective_ac_option = "op"`;
torchtitan/parallelisms/parallelize_llama.py, `_save_list`) checkpoints each transformer
block and, inside it, keeps the outputs of the attention kernels and of the block's matrix
multiplications except every second one (counted in the block's forward order), recomputing
everything else (norms, RoPE, activations, the other matmuls) in the backward. The rule is
the same here; a biased linear (aten.addmm, which torchtitan's bias-free Llama never runs)
counts as a matmul too. torchtitan's aten.max (for Float8 scales) is not kept.
"""
from __future__ import annotations

from typing import Any, Callable, Tuple

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
MATMULS = frozenset({_aten.mm.default, _aten.addmm.default})
ATTENTION = frozenset({
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
})


def op_policy() -> Callable[..., CheckpointPolicy]:
    """A fresh policy (its matmul count starts at 0): one per checkpointed forward."""
    count = 0

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        nonlocal count
        if func in MATMULS:
            count += 1
            return CheckpointPolicy.MUST_SAVE if count % 2 else \
                CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in ATTENTION else \
            CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def op_contexts() -> Tuple[Any, Any]:
    """(forward context, recompute context) of torchtitan's op rule for one checkpoint."""
    return create_selective_checkpoint_contexts(op_policy())
