"""The three measured paths of bench_train_gpu.py, each built from one zoo size: gigatron's
pretrain flags and the model config they give, the torch.compile plain model and
megatron-core's GPTModel built from that config; every build returns (parameters, step)."""
from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List, Tuple

import torch

import megatron_gpt
import plain_gpt
from gigatron.training.observe import flops as metrics

Step = Callable[[torch.Tensor, torch.Tensor], Any]
Built = Tuple[int, Step]  # (parameter count, step)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# what plain_gpt.py builds: (positions, norm, activation, biases, untied, heads x kv == h)
PLAIN_ARCHITECTURES = [("learned_absolute", "LayerNorm", act, True, False, True)
                       for act in ("gelu", "gelu_tanh")] + \
    [("rope", "RMSNorm", "swiglu", False, untied, True) for untied in (False, True)]
# the override flag of each TransformerConfig field --tiny sets
TINY_FLAGS = {"num_layers": ["--num-layers"], "hidden_size": ["--hidden-size"],
              "ffn_hidden_size": ["--ffn-hidden-size"],
              "num_attention_heads": ["--num-attention-heads"],
              "num_query_groups": ["--group-query-attention", "--num-query-groups"],
              "vocab_size": ["--vocab-size"]}


def gigatron_flags(size: Dict[str, Any], micro: int, args: argparse.Namespace,
                   extra: List[str]) -> List[str]:
    """pretrain flags of gigatron's path: the zoo model, --tiny's overrides, the bench's run."""
    model = [f"--model={size['zoo']}"]
    for field, value in size["overrides"].items():
        model += TINY_FLAGS[field] + [str(value)]
    precision = ["--bf16"] if args.dtype == "bf16" else []
    return model + precision + [
        "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
        "--micro-batch-size", str(micro), "--global-batch-size", str(micro),
        "--train-iters", "1000000", "--lr", "1e-4", "--clip-grad", "1.0", "--mock-data",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--attention-backend", "flash",
        "--seed", "1234"] + extra


def model_config(flags: List[str]) -> Any:
    """The TransformerConfig gigatron's path trains with these flags: the one architecture
    every path builds and the FLOP count reads."""
    from gigatron.training.config.arguments import parse_args

    return parse_args(flags, 1).model


def build_gigatron(flags: List[str], device: torch.device):
    """(session, step(tokens, labels)): the run's own builders and the loop's train_step."""
    from gigatron.parallel.topology import ProcessGroups, Topology
    from gigatron.training.run import builders
    from gigatron.training.config.arguments import parse_args
    from gigatron.training.run.loop import Session, train_step
    from gigatron.training.checkpoint.orchestrator import TrainProgress
    from gigatron.training.observe.timers import Timers

    run = parse_args(flags, 1)
    groups = ProcessGroups(Topology(tp=1, dp=1, pp=1), 0)
    chunks = builders.build_model_chunks(run, groups, device)
    zero = builders.build_optimizer(run, chunks, groups)
    pipeline = builders.build_pipeline(run, groups, chunks, zero, device)
    session = Session(run, groups, device, chunks, zero, zero, pipeline, [], None,
                      Timers(None), metrics.flops_per_token(run.model), None)
    progress = TrainProgress()
    mask = None

    def step(tokens: torch.Tensor, labels: torch.Tensor):
        nonlocal mask
        if mask is None:
            mask = torch.ones(labels.shape, device=device)
        batch = {"input_ids": tokens, "labels": labels, "loss_mask": mask,
                 "position_ids": torch.arange(tokens.shape[1], device=device).expand_as(tokens)}
        return train_step(session, [batch], progress).loss

    return session, step


def plain_config(arch: Any) -> plain_gpt.PlainConfig:
    """bench/plain_gpt.py's config of gigatron's TransformerConfig `arch`; raises on what
    the plain models do not build."""
    got = (arch.position_embedding_type, arch.normalization, arch.activation,
           arch.add_bias_linear, arch.untie_embeddings_and_output_weights,
           arch.kv_channels * arch.num_attention_heads == arch.hidden_size)
    if got not in PLAIN_ARCHITECTURES:
        raise ValueError(f"(positions, norm, activation, biases, untied, heads x kv_channels "
                         f"== hidden) = {got}: plain_gpt.py builds only {PLAIN_ARCHITECTURES}")
    vocab = metrics.padded_vocab_size(arch.vocab_size, arch.make_vocab_size_divisible_by, 1)
    return plain_gpt.PlainConfig(
        arch.num_layers, arch.hidden_size, arch.num_attention_heads, vocab, arch.seq_length,
        ffn_hidden_size=arch.ffn_hidden_size, layernorm_epsilon=arch.layernorm_epsilon,
        gelu_approximate="tanh" if arch.activation == "gelu_tanh" else "none",
        num_query_groups=arch.num_query_groups, rotary_base=arch.rotary_base,
        rope_scaling_factor=arch.rope_scaling_factor if arch.rope_scaling else None,
        rope_scaling_low_freq_factor=arch.rope_scaling_low_freq_factor,
        rope_scaling_high_freq_factor=arch.rope_scaling_high_freq_factor,
        rope_scaling_original_max_position_embeddings=(
            arch.rope_scaling_original_max_position_embeddings),
        tie_embeddings=not arch.untie_embeddings_and_output_weights)


def build_plain(cfg: plain_gpt.PlainConfig, llama: bool, device: torch.device,
                dtype: torch.dtype, compile_backend: str) -> Tuple[torch.nn.Module, Step]:
    """(model, step): the plain model under torch.compile with fused AdamW."""
    model = plain_gpt.plain_model(cfg, llama).to(device)
    fused = device.type in ("cuda", "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    compiled = torch.compile(model, backend=compile_backend)
    return model, lambda tokens, labels: plain_gpt.train_step(compiled, optimizer, tokens, labels,
                                                       dtype)


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight counts once


def path_builders(size: Dict[str, Any], args: argparse.Namespace, device: torch.device,
                  arch: Any) -> Dict[str, Callable[[int], Built]]:
    """path -> build(micro) -> (parameters, step) for the paths asked for, all on `arch`
    (gigatron's model config)."""
    dtype = DTYPES[args.dtype]
    recompute = [] if not args.recompute else ["--recompute-granularity", "full",
                                               "--recompute-method", "uniform",
                                               "--recompute-num-layers", "1"]

    def gigatron(micro: int) -> Built:
        session, step = build_gigatron(
            gigatron_flags(size, micro, args, recompute + args.gigatron_flags), device)
        return sum(_parameters(c) for c in session.chunks), step

    def plain(micro: int) -> Built:
        model, step = build_plain(plain_config(arch), arch.position_embedding_type == "rope",
                                  device, dtype, args.compile_backend)
        return _parameters(model), step

    def megatron(micro: int) -> Built:
        vocab = metrics.padded_vocab_size(arch.vocab_size, arch.make_vocab_size_divisible_by, 1)
        model, step = megatron_gpt.build(arch, vocab, arch.seq_length, device, dtype)
        return _parameters(model), step

    builders = {"gigatron": gigatron}
    if "plain" in args.paths:
        builders["torch.compile"] = plain
    if "megatron" in args.paths:
        builders["megatron-core"] = megatron
    return builders
