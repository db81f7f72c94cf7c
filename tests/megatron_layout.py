"""A Megatron-LM torch checkpoint built by hand from a gigatron state dict, without
megatron-core: each rank's Megatron-Core names (local or transformer_engine spec), layers
numbered from 0 per chunk, column/row shards, SwiGLU's [gate_r; up_r] per tp rank, the
vocabulary padded to Megatron's multiple with random rows, written in Megatron-LM's folders.
"""
from __future__ import annotations

import argparse
import io
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

StateDict = Dict[str, torch.Tensor]
_TE_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
             "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
           "word_embeddings.weight", "output_layer.weight", "linear_q_proj.weight",
           "linear_q_up_proj.weight", "linear_kv_up_proj.weight")
# multi-latent attention (Megatron-Core's gpt_layer_specs): the down-projections are
# column-parallel in the local spec, TELinear 'duplicated' (whole on every rank) with
# transformer_engine, whose input norm stays apart and whose latent norms are fused into the
# up-projections
_MLA_DOWN = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")
_TE_MLA_NORMS = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                 "self_attention.kv_layernorm.":
                     "self_attention.linear_kv_up_proj.layer_norm_",
                 "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def megatron_args(tp: int = 1, pp: int = 1, vp: Optional[int] = None,
                  **overrides: Any) -> argparse.Namespace:
    """Saved args of a small run (post-validation values, Megatron-LM's names)."""
    args = dict(
        num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
        group_query_attention=True, num_query_groups=2, kv_channels=8, seq_length=16,
        max_position_embeddings=16, position_embedding_type="rope", rotary_base=50000,
        rotary_percent=1.0, rotary_interleaved=False, rotary_seq_len_interpolation_factor=None,
        use_rope_scaling=False, rope_scaling_factor=8.0, normalization="RMSNorm",
        norm_epsilon=1e-5, apply_layernorm_1p=False, swiglu=True, squared_relu=False,
        bias_gelu_fusion=False, bias_swiglu_fusion=True, add_bias_linear=False,
        add_qkv_bias=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, make_vocab_size_divisible_by=32,
        vocab_size=None, padded_vocab_size=None, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        expert_model_parallel_size=1, num_experts=None, multi_latent_attention=False,
        qk_layernorm=False, use_legacy_models=False, params_dtype=torch.float32,
        bf16=False, fp16=False, ckpt_format="torch", tokenizer_type="NullTokenizer")
    args.update(overrides)
    if args["padded_vocab_size"] is None:  # Megatron's _vocab_size_with_padding of 100 tokens
        multiple = args["make_vocab_size_divisible_by"] * tp
        args["padded_vocab_size"] = -(-100 // multiple) * multiple
    return argparse.Namespace(**args)


def shard(name: str, tensor: torch.Tensor, tp: int, rank: int, swiglu: bool,
          te: bool = False) -> torch.Tensor:
    """Rank `rank`'s slice of one full gigatron tensor."""
    if name.endswith(_MLA_DOWN):
        return tensor if te else tensor.chunk(tp)[rank]
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")) and swiglu:
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    if name.endswith(_COLUMN):
        return tensor.chunk(tp)[rank]
    if name.endswith(_ROW):
        return tensor.chunk(tp, dim=1)[rank]
    return tensor


def megatron_padded(vocab: torch.Tensor, real: int, padded: int) -> torch.Tensor:
    """The real rows, then random rows up to Megatron's padded size."""
    g = torch.Generator().manual_seed(3)
    extra = torch.randn(padded - real, vocab.shape[1], generator=g, dtype=vocab.dtype)
    return torch.cat([vocab[:real], extra])


def te_name(name: str, mla: bool = False) -> str:
    for ours, theirs in (_TE_MLA_NORMS if mla else _TE_NORMS).items():
        if ours in name:
            return name.replace(ours, theirs)
    return name


def rank_chunks(state: StateDict, num_layers: int, tp: int, pp: int, vp: int, swiglu: bool,
                tied: bool, te: bool) -> Dict[Tuple[int, int], List[Dict[str, object]]]:
    """(tp rank, pp rank) -> model chunks, as Megatron-Core's state_dict() gives them."""
    per_chunk = num_layers // (pp * vp)
    out: Dict[Tuple[int, int], List[Dict[str, object]]] = {}
    for t in range(tp):
        for p in range(pp):
            chunks = []
            for v in range(vp):
                first = (v * pp + p) * per_chunk
                pre, post = (p, v) == (0, 0), (p, v) == (pp - 1, vp - 1)
                chunk: Dict[str, object] = {}
                for name, tensor in state.items():
                    m = re.match(r"decoder\.layers\.(\d+)\.(.+)$", name)
                    if m:
                        layer = int(m.group(1))
                        if not first <= layer < first + per_chunk:
                            continue
                        local = f"decoder.layers.{layer - first}.{m.group(2)}"
                    elif name.startswith("embedding.") and pre:
                        local = name
                    elif name.startswith(("decoder.final_layernorm", "output_layer")) and post:
                        local = name
                    else:
                        continue
                    mla = any(".linear_kv_down_proj." in k for k in state)
                    chunk[te_name(local, mla) if te else local] = shard(name, tensor, tp, t,
                                                                        swiglu, te).clone()
                if post and tied and pp * vp > 1:  # the last stage's copy of the embedding
                    chunk["output_layer.weight"] = shard(
                        "embedding.word_embeddings.weight",
                        state["embedding.word_embeddings.weight"], tp, t, swiglu)
                if te:
                    for key in [k for k in chunk if k.endswith(".weight")]:
                        chunk[key.rsplit(".", 1)[0] + "._extra_state"] = io.BytesIO(b"fp8")
                chunks.append(chunk)
            out[(t, p)] = chunks
    return out


def write_megatron(root: str, iteration: int, args: argparse.Namespace,
                   chunks: Dict[Tuple[int, int], List[Dict[str, object]]]) -> None:
    """Megatron-LM's folders: the tracker and iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt."""
    pp = args.pipeline_model_parallel_size
    for (t, p), models in chunks.items():
        name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
        path = os.path.join(root, f"iter_{iteration:07d}", name, "model_optim_rng.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state: Dict[str, object] = {"args": args, "checkpoint_version": 3.0,
                                    "iteration": iteration, "optimizer": {"state": {}}}
        for i, model in enumerate(models):
            state["model" if len(models) == 1 else f"model{i}"] = model
        torch.save(state, path)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
