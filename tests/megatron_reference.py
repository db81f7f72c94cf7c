"""A tiny Megatron-Core GPTModel on the CPU, and its checkpoint written as Megatron-LM writes one.

Only imported when megatron.core is importable. Megatron-Core assumes CUDA in three places a
CPU run reaches; `cpu_shims` covers them for the (forked worker) process: RoPE moves its
frequencies to torch.cuda.current_device() (made to answer 'cpu'), a tied embedding's
first/last-stage sync calls Tensor.cuda() (made the identity), the default causal mask is
built on 'cuda' (the forward passes an explicit mask instead), and attention dropout forks
the CUDA RNG tracker (a no-op here: dropout is 0); the MoE router's GEMM names
transformer_engine's (made None: torch's). TorchDynamo is off: Megatron's jit_fuser would
compile its fused functions in every worker (tests/test_megatron_import.py: 41-63 s with it,
10-22 s without, on this 2-core box under load). MoE models use gpt_builder's block spec
(--moe-layer-freq's dense and MoE layers), the allgather dispatcher (alltoall syncs CUDA
streams) and SequentialMLP (grouped GEMM needs transformer_engine or grouped_gemm).

The args Namespace holds what Megatron-LM's validate_args leaves in it for these flags, and
the model is built as Megatron-LM's core_transformer_config_from_args and gpt_builder build it.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                    get_gpt_layer_local_spec)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_layout import megatron_args  # noqa: F401  (the tests build args through here)


def cpu_shims() -> None:
    """Let this worker process run Megatron-Core's forward on the CPU (see the docstring)."""
    torch._dynamo.config.disable = True  # Megatron's jit_fuser compiles for seconds, per worker
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # its router GEMM names TE's without transformer_engine


def init_parallel(args: argparse.Namespace) -> None:
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size)
    cpu_shims()


def _moe_fields(args: argparse.Namespace) -> Dict[str, Any]:
    """The --moe-* args, copied by name as core_transformer_config_from_args does."""
    if not args.num_experts:
        return {}
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    return {"num_moe_experts": args.num_experts,
            "expert_model_parallel_size": args.expert_model_parallel_size,
            **{k: v for k, v in vars(args).items() if k.startswith("moe_") and k in names}}


def core_config(args: argparse.Namespace) -> TransformerConfig:
    """Megatron-LM's core_transformer_config_from_args, for the flags these tests use."""
    gelu_or_other = (F.silu if args.swiglu else
                     (lambda x: torch.pow(F.relu(x), 2)) if args.squared_relu else F.gelu)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels, normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p, qk_layernorm=args.qk_layernorm,
        gated_linear_unit=args.swiglu, activation_func=gelu_or_other,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        pipeline_dtype=args.params_dtype, params_dtype=args.params_dtype,
        use_cpu_initialization=True, init_method_std=args.init_method_std,
        **_moe_fields(args))


def build_chunk(args: argparse.Namespace, vp_stage: Optional[int]) -> GPTModel:
    """This rank's model chunk `vp_stage`, as Megatron-LM's gpt_builder builds it."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp, vp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size or 1
    chunk = vp_stage or 0
    config = core_config(args)
    if args.num_experts:  # gpt_builder's MoE spec: --moe-layer-freq's dense and MoE layers
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=args.normalization, vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization,
                                        qk_layernorm=args.qk_layernorm)
    return GPTModel(
        config, spec,
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pp_rank == 0 and chunk == 0,
        post_process=pp_rank == pp - 1 and chunk == vp - 1,
        parallel_output=False,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        vp_stage=vp_stage)


def randomize(chunks: List[GPTModel], seed: int) -> None:
    """Random values everywhere (norms and biases too, so a swap shows): tp-sharded
    parameters differ per tp rank, routed experts per ep rank, replicated ones are equal on
    every tp rank."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            for i, (name, p) in enumerate(chunk.named_parameters()):
                sharded = getattr(p, "tensor_model_parallel", False)
                expert = not getattr(p, "allreduce", True)  # routed experts: per ep rank
                g = torch.Generator().manual_seed(
                    seed + 1000 * (v * 64 + pp_rank) + i + (100000 * tp_rank if sharded else 0)
                    + (10000000 * ep_rank if expert else 0))
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
            for i, (name, b) in enumerate(chunk.named_buffers()):
                if name.endswith("expert_bias"):  # the router's (zeros until trained)
                    g = torch.Generator().manual_seed(seed + 1000 * (v * 64 + pp_rank) + i)
                    b.copy_(0.1 * torch.randn(b.shape, generator=g))
    for chunk in chunks:  # a tied output layer on the last stage starts as the embedding
        if chunk.share_embeddings_and_output_weights and chunk._is_in_embd_group():
            weight = chunk.shared_embedding_or_output_weight()
            with torch.no_grad():
                if not chunk.pre_process:
                    weight.zero_()
                dist.all_reduce(weight, group=chunk.embd_group)


def forward_logits(chunks: List[GPTModel], tokens: torch.Tensor,
                   args: argparse.Namespace) -> Optional[torch.Tensor]:
    """Full logits [b, s, padded vocab] on the last stage (None elsewhere): the chunks run in
    the order activations flow, hidden states passed between pipeline ranks."""
    pp, vp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size or 1
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    group = parallel_state.get_pipeline_model_parallel_group()
    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(s, s), diagonal=1).bool()[None, None]
    hidden = torch.empty(s, b, args.hidden_size)
    out = None
    for v in range(vp):
        for p in range(pp):
            first, last = (p, v) == (0, 0), (p, v) == (pp - 1, vp - 1)
            if p != pp_rank:
                continue
            if not first:
                dist.recv(hidden, group_src=(p - 1) % pp, group=group)
                chunks[v].set_input_tensor(hidden)
            with torch.no_grad():
                out = chunks[v](tokens, positions, mask)
            if not last:
                dist.send(out.contiguous(), group_dst=(p + 1) % pp, group=group)
    return out if pp_rank == pp - 1 else None


def save_like_megatron(root: str, iteration: int, args: argparse.Namespace,
                       chunks: List[GPTModel]) -> None:
    """This rank's model_optim_rng.pt as Megatron-LM's save_checkpoint (ckpt_format torch)
    writes it, and (on the first rank) the tracker."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    name = (f"mp_rank_{tp_rank:02d}" if args.pipeline_model_parallel_size == 1
            else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")
    path = os.path.join(root, f"iter_{iteration:07d}", name, "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state: Dict[str, Any] = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
    for i, chunk in enumerate(chunks):
        state["model" if len(chunks) == 1 else f"model{i}"] = \
            chunk.state_dict_for_save_checkpoint()
    state["rng_state"] = [{"torch_rng_state": torch.get_rng_state()}]
    state["num_floating_point_operations_so_far"] = 0
    torch.save(state, path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def run_and_save(rank: int, world_size: int, args: argparse.Namespace, root: str,
                 tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """On one forked rank: build and randomise this rank's chunks, save them as Megatron-LM
    does, return the full logits on the last stage's tp rank 0."""
    init_parallel(args)
    vp = args.virtual_pipeline_model_parallel_size
    chunks = [build_chunk(args, v if vp else None) for v in range(vp or 1)]
    for chunk in chunks:
        chunk.eval()
    randomize(chunks, seed=7)
    save_like_megatron(root, 10, args, chunks)
    logits = forward_logits(chunks, tokens, args)
    keep = logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0
    parallel_state.destroy_model_parallel()
    return logits if keep else None
