"""What one layer keeps under --recompute-granularity selective, by module or by op rule, and
what it runs again in the backward (`recomputed_parts`: the step time's charge, layer.py's
parts).

Megatron-Core's --recompute-modules (models/config.py RECOMPUTE_MODULES): each named module
runs inside a checkpoint, so the layer keeps the module's input (already counted: it is the
tensor the norm before it produced) and drops what the module's own ops saved:
  core_attn       the attention kernel's tensors beyond its inputs (memory/activations.py `held`, `core`)
  mlp             a dense MLP's: fc1's (gathered) input beyond the checkpoint's own, fc1's
                  output and the activation's (`mlp_act`)
  moe             an MoE layer's MLP part (`moe_mlp_bytes`) beyond its input
  shared_experts  the shared experts' fc1 output and activation
torchtitan's op rule (--selective-ac-option op; parallel/tensor/selective.py) checkpoints the
whole layer and keeps its input, the attention kernel's output and log-sum-exp (flash or
memory-efficient kernels only: the unfused and math paths are recomputed) and the outputs of
the layer's first and third matmuls: linear_qkv's and linear_fc1's in a dense layer (its
linear_proj and linear_fc2 are recomputed). torchtitan's Llama runs wq, wk, wv and w1, w3
as separate matmuls, so it keeps wq's, wv's, w1's and w2's instead: 2 (4h + kv + ffn) bytes
per token in bf16 against 2 (3h + 2 kv + 2 ffn) here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Tuple

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig


def selective_layer_bytes(c: "TransformerConfig", layer: float,
                          dropped: Dict[str, float]) -> float:
    """Bytes per token one layer keeps: `layer` (nothing recomputed) less what each module
    that --recompute-modules names would have saved (`dropped`, by module name)."""
    return layer - sum(bytes_ for module, bytes_ in dropped.items() if c.recomputes(module))


def op_layer_bytes(c: "TransformerConfig", width: int, tp: int, split: int,
                   kernel: str) -> float:
    """Bytes per token one dense layer keeps under torchtitan's op rule (module docstring);
    `split`: what sequence parallelism splits the layer's input by; `kernel`: the attention
    path (memory.attention_kernel)."""
    if c.multi_latent_attention or c.num_moe_experts is not None:
        raise ValueError("gigatron plan models --selective-ac-option op for dense layers "
                         "with standard attention only (not MoE or --multi-latent-attention)")
    h, a, g, d = c.hidden_size, c.num_attention_heads, c.num_query_groups, c.head_dim
    qkv = g * (a // g + 2) * d / tp
    fc1 = (2 if c.activation in ("swiglu", "quick_geglu") else 1) * c.ffn_hidden_size / tp
    attention = width * a * d / tp + 4 * a / tp if kernel == "flash" else 0.0
    return width * (h / split + qkv + fc1) + attention


MODULE_PARTS = {
    "core_attn": ("core",),
    "mla_up_proj": ("linear_q_up_proj", "linear_kv_up_proj", "rope"),
    "layernorm": ("norms",),
    "mlp": ("linear_fc1", "linear_fc2", "activation", "tp_mlp"),
    "moe": ("linear_fc1", "linear_fc2", "activation", "tp_mlp", "moe"),
    "shared_experts": ("shared_experts",),
}
"""The parts of a layer (training/plan/layer.py) each --recompute-modules name runs again in
the backward: its checkpointed submodule's forward, collectives included (mlp and moe hold
their tp collectives; moe its token exchange; mla_up_proj the up-projections and RoPE)."""
OP_RULE_PARTS = ("linear_proj", "linear_fc2", "norms", "residual", "activation", "rope",
                 "gaps", "tp_attention", "tp_mlp")
"""What torchtitan's op rule runs again in a dense layer: the whole layer's forward but the
kept matmuls (linear_qkv's, linear_fc1's) and the fused attention kernel (an unfused or
math attention is recomputed: `recomputed_parts`)."""


def recomputed_parts(c: "TransformerConfig", moe_layer: bool, flash: bool) -> Tuple[str, ...]:
    """The layer parts a selective recomputation runs again (none for other granularities:
    full recomputation is the whole forward); `moe_layer`: an MoE layer ('mlp' is its dense
    layers' module, 'moe' and 'shared_experts' its own); `flash`: a fused attention."""
    if c.recompute_granularity != "selective":
        return ()
    if c.selective_ac_option == "op":
        return OP_RULE_PARTS + (() if flash else ("core",))
    out: List[str] = []
    for module, parts in MODULE_PARTS.items():
        if not c.recomputes(module) or (module == "mlp" and moe_layer) or \
                (module in ("moe", "shared_experts") and not moe_layer) or \
                (module == "shared_experts" and c.recomputes("moe")):
            continue
        out += parts
    return tuple(out)
