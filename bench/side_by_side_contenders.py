"""The contenders of bench_side_by_side.py: each builds the one Llama-style model of a Shape
in its own framework and returns (parameters, step(tokens, labels) -> loss).

gigatron: its pretrain flags through bench/train_paths.py's build_gigatron (the loop's own
train_step), bf16 parameters with fp32 masters; variants add --torch-compile or FP8 flags.
torchtitan 0.3.0: its Llama3Model built from its own layer configs and parameter init, its
OptimizersContainer (default_adamw: AdamW, fused), its cross-entropy; fp32 parameters under
torch.autocast(bf16), which is what its trainer does on one device (no FSDP); flex attention
with its causal mask. Its trainer entry is not driven (it picks 'cuda' when no accelerator is
found and builds a device mesh): the step is this file's, the pieces are torchtitan's.
megatron-core: bench/megatron_gpt.py (GPTModel, local spec, Megatron's optimizer on a GPU;
torch's AdamW on the CPU, see that file).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LR, CLIP, ROPE_THETA, BETAS, WEIGHT_DECAY = 1e-4, 1.0, 500000.0, (0.9, 0.95), 0.1


@dataclass(frozen=True)
class Shape:
    """One model and batch. arch "llama": RMSNorm, SwiGLU, RoPE, grouped-query attention,
    untied embeddings, no biases; "gpt" (GPT-3's): LayerNorm, GeLU, learned absolute
    positions, biases, tied embeddings, multi-head attention (query groups = heads)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    micro_batch: int
    arch: str = "llama"


def gigatron_flags(shape: Shape, extra: List[str]) -> List[str]:
    """gigatron's pretrain flags of `shape` (global batch = micro batch: one rank, no
    accumulation); "gpt" keeps Megatron's defaults (LayerNorm, GeLU, learned positions,
    biases, tied embeddings)."""
    s = shape
    llama = ["--group-query-attention", "--num-query-groups", str(s.num_query_groups),
             "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
             "--rotary-base", str(int(ROPE_THETA)), "--disable-bias-linear",
             "--untie-embeddings-and-output-weights"] if s.arch == "llama" else []
    return [
        "--num-layers", str(s.num_layers), "--hidden-size", str(s.hidden_size),
        "--num-attention-heads", str(s.num_attention_heads), "--ffn-hidden-size",
        str(s.ffn_hidden_size), "--vocab-size", str(s.vocab_size)] + llama + ["--bf16",
        "--seq-length", str(s.seq_length), "--max-position-embeddings", str(s.seq_length),
        "--micro-batch-size", str(s.micro_batch), "--global-batch-size", str(s.micro_batch),
        "--train-iters", "1000000", "--lr", str(LR), "--clip-grad", str(CLIP),
        "--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]),
        "--weight-decay", str(WEIGHT_DECAY), "--mock-data", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--attention-backend", "flash", "--seed", "1234"] + extra


def model_config(shape: Shape) -> Any:
    """gigatron's TransformerConfig of `shape`: megatron-core's build and the FLOP count
    read it."""
    from gigatron.training.config.arguments import parse_args

    return parse_args(gigatron_flags(shape, []), 1).model


GIGATRON_VARIANTS: Dict[str, List[str]] = {
    "gigatron eager": [],
    "gigatron compiled": ["--torch-compile"],
    "gigatron fp8 tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "gigatron fp8 delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
}


def has_flag(flag: str) -> bool:
    """Whether gigatron's config table declares `flag` (a contender whose flag has not
    landed is skipped, not failed)."""
    from gigatron.training.config.table import table

    return any(flag in row.spec.flags for row in table())


def build_gigatron(name: str, shape: Shape, device: torch.device) -> Tuple[int, Step]:
    from train_paths import build_gigatron as build

    session, step = build(gigatron_flags(shape, GIGATRON_VARIANTS[name]), device)
    return sum(p.numel() for c in session.chunks for p in c.parameters()), step


def build_torchtitan(shape: Shape, device: torch.device, compiled: bool
                     ) -> Tuple[int, Step]:
    """torchtitan's Llama 3 model, optimizer and loss at `shape`, stepped as its trainer
    steps one device: autocast(bf16) forward, sum loss / tokens, clip, step. Attention is its
    default for Llama 3, flex (compiled by torchtitan), on a GPU; on a CPU, where
    FlexAttention has no backward, its causal ScaledDotProductAttention. `compiled`: its
    apply_compile (each block under torch.compile, as --compile.enable does for the model;
    the loss stays eager)."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, default_adamw
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model

    s = shape
    h, vocab = s.hidden_size, s.vocab_size
    layers = llama3._build_llama3_layers(
        n_layers=s.num_layers, dim=h, n_heads=s.num_attention_heads,
        n_kv_heads=s.num_query_groups, hidden_dim=s.ffn_hidden_size, fuse_qkv=True,
        rope=ComplexRoPE.Config(dim=h // s.num_attention_heads, max_seq_len=s.seq_length,
                                theta=ROPE_THETA, scaling="none"),
        attn_backend="flex")
    if device.type == "cpu":
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=h, vocab_size=vocab, enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=h,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=h, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=h, out_features=vocab,
                              param_init=llama3._output_linear_init(h)),
        layers=layers)
    torch.manual_seed(1234)
    with torch.device("meta"):  # as its trainer: built on meta, materialised, initialised
        model = config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=device)
    model.train()
    optimizer = OptimizersContainer(
        default_adamw(lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY),
        model_parts=[model])
    if compiled:
        from types import SimpleNamespace

        from torchtitan.config import CompileConfig
        from torchtitan.distributed.compile import apply_compile

        apply_compile(model, compile_config=CompileConfig(enable=True),
                      parallel_dims=SimpleNamespace(tp_enabled=False))
    positions = torch.arange(s.seq_length, device=device).expand(s.micro_batch, -1)
    masks = None if device.type == "cpu" else model.get_attention_masks(positions=positions)

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = model(tokens, positions=positions, attention_masks=masks)
            loss = cross_entropy_loss(pred, labels) / labels.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        optimizer.step()
        return loss.detach()

    return sum(p.numel() for p in model.parameters()), step


def build_megatron(shape: Shape, device: torch.device) -> Tuple[int, Step]:
    import megatron_gpt

    arch = model_config(shape)
    model, step = megatron_gpt.build(arch, shape.vocab_size, shape.seq_length, device,
                                     torch.bfloat16, lr=LR)
    return sum(p.numel() for p in model.parameters()), step


def build(name: str, shape: Shape, device: torch.device) -> Tuple[int, Step]:
    if name in GIGATRON_VARIANTS:
        return build_gigatron(name, shape, device)
    if name in ("torchtitan", "torchtitan compiled"):
        return build_torchtitan(shape, device, compiled=name == "torchtitan compiled")
    if name == "megatron-core":
        return build_megatron(shape, device)
    raise ValueError(f"unknown contender {name!r}")


def version(name: str) -> str:
    """The framework's installed version, for the table."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    package = name.split()[0]
    try:
        return installed(package) if package != "gigatron" else "main"
    except PackageNotFoundError:
        return "?"
