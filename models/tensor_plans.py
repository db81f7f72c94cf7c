"""Ready-made tensor-parallel plans for `parallelize` (Megatron's split of a transformer).

Every plan splits attention as column-parallel q/k/v (each rank keeps whole heads: its
query heads and the key/value heads they use under GQA) and a row-parallel output
projection, the MLP as column-parallel up (gate) and row-parallel down, so each block costs
one all-reduce forward and one backward per sub-layer. Norms stay whole.

Logits (Hugging Face plans): by default the output layer gathers them, so the model's own
forward, loss (labels=...) and generate() work unchanged. With `loss_parallel=True` the
logits stay split by vocab ([b, s, V/tp] on each rank) and the loss is yours:
`vocab_parallel_cross_entropy(logits, targets, tp_group)` computes it without gathering
them (shift the labels yourself; it has no ignore_index). Do not pass labels= then.

These modules know module *names*, never the model classes: nothing here imports
transformers or gigatron.models.
"""
from __future__ import annotations

from typing import Any, Dict

from torch import nn

from gigatron.parallel.tensor.parallelize import StyleLike, TensorParallelPlan
from gigatron.parallel.tensor.styles import ColumnParallel, LocalAttributes

_NORM = "sequence_parallel_norm"


def gpt2_plan(loss_parallel: bool = False, sequence_parallel: bool = False) -> TensorParallelPlan:
    """Hugging Face `GPT2LMHeadModel`: Conv1D layers (weights stored transposed) and a fused
    c_attn whose q, k and v are each split (fused=3); `split_size`/`num_heads` of every
    attention module are made local. The tied lm_head/wte stay tied (both split by vocab).

    With `sequence_parallel` the batch (dim 0 of GPT-2's [b, s, h]) is split between
    sub-layers, so the batch must be divisible by tp; ln_1/ln_2/ln_f and the position table
    wpe are sequence_parallel_norm (wpe's [1, s, h] output is added to each rank's part)."""
    h = "transformer.h.*"
    layers: Dict[str, StyleLike] = {
        "transformer.wte": "vocab_embedding",
        f"{h}.attn": LocalAttributes(divide=("num_heads", "split_size", "embed_dim"),
                                     missing_ok=True),
        f"{h}.attn.c_attn": ColumnParallel(fused=3),
        f"{h}.attn.c_proj": "row",
        f"{h}.mlp.c_fc": "column",
        f"{h}.mlp.c_proj": "row",
        "lm_head": ColumnParallel(gather_output=not loss_parallel),
    }
    if sequence_parallel:
        layers.update({f"{h}.ln_1": _NORM, f"{h}.ln_2": _NORM, "transformer.ln_f": _NORM,
                       "transformer.wpe": _NORM})
    return TensorParallelPlan(layers, sequence_parallel)


def llama_plan(loss_parallel: bool = False) -> TensorParallelPlan:
    """Hugging Face `LlamaForCausalLM`: q/k/v column (GQA: num_key_value_heads must be
    divisible by tp), o row, gate/up column, down row, embed_tokens vocab-parallel, lm_head
    column (tied or not). Head-count attributes of the attention module are divided where
    the transformers version has them (5.x reshapes with -1 and needs none).

    No sequence parallelism: LlamaAttention reshapes its output to the shape of its own
    input, which would be the split one."""
    layer = "model.layers.*"
    attn = f"{layer}.self_attn"
    layers: Dict[str, StyleLike] = {
        "model.embed_tokens": "vocab_embedding",
        attn: LocalAttributes(divide=("num_heads", "num_key_value_heads", "hidden_size"),
                              missing_ok=True),
        f"{attn}.q_proj": "column", f"{attn}.k_proj": "column", f"{attn}.v_proj": "column",
        f"{attn}.o_proj": "row",
        f"{layer}.mlp.gate_proj": "column", f"{layer}.mlp.up_proj": "column",
        f"{layer}.mlp.down_proj": "row",
        "lm_head": ColumnParallel(gather_output=not loss_parallel),
    }
    return TensorParallelPlan(layers)


def gigatron_gpt_plan(model: nn.Module) -> TensorParallelPlan:
    """gigatron's own `GPTModel` (zoo GPT and Llama configs) built on one rank (tp_group
    None, e.g. to load a single-device checkpoint), split afterwards; the result computes
    what `GPTModel(config, tp_group=...)` computes. Its logits stay split by vocab and the
    model's loss is vocab-parallel, as when built split. Works per pipeline stage (a stage
    without the embedding or output layer). Sequence parallelism is fixed when GPTModel is
    built: for it, build with `tp_group` and `sequence_parallel=True` instead. The model's
    RNG tracker keeps the seed it was built with (tp rank 0's), so attention dropout draws
    the same stream on every tp rank; exact with dropout 0, as the tests run it."""
    config: Any = getattr(model, "config")
    if config.sequence_parallel:
        raise ValueError("gigatron_gpt_plan splits a model built without sequence "
                         "parallelism: build GPTModel(config, tp_group=...) for it instead")
    # a gated MLP's fc1 stacks [gate; up]: the model tags the weight with its block count
    strides = {getattr(m.weight, "partition_stride", 1) for n, m in model.named_modules()
               if n.endswith("mlp.linear_fc1") and getattr(m, "weight", None) is not None}
    fc1 = ColumnParallel(fused=strides.pop()) if len(strides) == 1 else "column"
    layer = "decoder.layers.*"
    layers: Dict[str, StyleLike] = {
        "": LocalAttributes(tp_group=("tp_group",)),
        f"{layer}.self_attention": LocalAttributes(divide=("local_groups",)),
        f"{layer}.self_attention.linear_qkv": "column",
        f"{layer}.self_attention.linear_proj": "row",
        f"{layer}.mlp.linear_fc1": fc1,
        f"{layer}.mlp.linear_fc2": "row",
    }
    if getattr(model, "pre_process", True):
        layers["embedding.word_embeddings"] = "vocab_embedding"
        layers["embedding"] = LocalAttributes(tp_group=("tp_group",))
    if getattr(model, "post_process", True):
        layers["output_layer"] = "column"
    return TensorParallelPlan(layers)


def plan_for(model: nn.Module, **options: bool) -> TensorParallelPlan:
    """The ready-made plan for `model`'s class (options of the Hugging Face ones:
    loss_parallel; sequence_parallel for GPT-2)."""
    kind = type(model).__name__
    if kind == "GPT2LMHeadModel":
        return gpt2_plan(**options)
    if kind in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        return llama_plan(**options)
    if kind == "GPTModel":
        return gigatron_gpt_plan(model)
    raise ValueError(f"no ready-made tensor-parallel plan for {kind}: write one (see "
                     f"gigatron.parallel.tensor.parallelize) or use gpt2_plan/llama_plan "
                     f"for look-alike module names")
