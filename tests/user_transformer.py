"""A user's own small transformer (its own classes, nothing of gigatron's) and its
tensor-parallel plan, shared by the plan tests and the 3D test.

Batch-first [b, s, h]; attention with a fused q/k/v of unequal blocks (GQA: 4 query heads,
2 key/value heads), learned positions, pre-norm blocks, tied input/output embeddings.
The attention takes its shapes from the fused projection's output, not from its own input,
so it also runs under sequence parallelism (where its input is split along dim 0).
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from gigatron.parallel.tensor import ColumnParallel, LocalAttributes, TensorParallelPlan
from gigatron.parallel.tensor.parallelize import StyleLike

VOCAB, HIDDEN, HEADS, KV_HEADS, SEQ = 64, 32, 4, 2, 8
HEAD_DIM = HIDDEN // HEADS


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = HEADS, KV_HEADS
        self.qkv = nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s = qkv.shape[:2]
        q, k, v = qkv.split([self.n_heads * HEAD_DIM, self.n_kv_heads * HEAD_DIM,
                             self.n_kv_heads * HEAD_DIM], dim=-1)
        q = q.view(b, s, self.n_heads, HEAD_DIM).transpose(1, 2)
        k, v = (t.view(b, s, self.n_kv_heads, HEAD_DIM).transpose(1, 2) for t in (k, v))
        group = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class UserTransformer(nn.Module):
    """ids [b, s] -> logits [b, s, VOCAB]."""

    def __init__(self, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        with torch.no_grad():  # GPT-2's embedding scale; non-trivial norms, so their
            for table in (self.tok, self.pos):  # (sequence-parallel) grads matter
                table.weight.normal_(0.0, 0.02)
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.add_(0.1 * torch.randn_like(m.weight))
                    m.bias.add_(0.1 * torch.randn_like(m.bias))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def user_plan(sequence_parallel: bool = False) -> TensorParallelPlan:
    """Megatron's split of the user's blocks; whole logits (the head gathers them)."""
    layers: Dict[str, StyleLike] = {
        "tok": "vocab_embedding",
        "blocks.*.attn": LocalAttributes(divide=("n_heads", "n_kv_heads")),
        "blocks.*.attn.qkv": ColumnParallel(fused=(HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM,
                                                   KV_HEADS * HEAD_DIM)),
        "blocks.*.attn.out": "row",
        "blocks.*.mlp.up": "column",
        "blocks.*.mlp.down": "row",
        "head": ColumnParallel(gather_output=True),
    }
    if sequence_parallel:
        layers.update({"blocks.*.norm?": "sequence_parallel_norm",
                       "norm": "sequence_parallel_norm", "pos": "sequence_parallel_norm"})
    return TensorParallelPlan(layers, sequence_parallel)
