"""A user's own small transformer as DeepSpeed pipeline layers, and its plain-torch twin.

Nothing of gigatron's model code: its own embedding (tied to the output projection through
TiedLayerSpec), its own pre-norm block with causal self-attention, stages that pass a
tuple (hidden states, int64 positions) so messages of mixed dtypes and several tensors
travel between stages. Shared by the pipeline tests (and usable by the 3D test).
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from gigatron.pipe import LayerSpec, TiedLayerSpec

VOCAB, HIDDEN, HEADS, SEQ = 32, 16, 2, 8
BASE_SEED = 1234


class Embed(nn.Module):
    """Token embedding; also returns the positions, which the blocks read."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, hidden) * 0.1)

    def forward(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return F.embedding(ids, self.weight), positions


def lm_head(embed: Embed, hidden: torch.Tensor) -> torch.Tensor:
    """The output projection through the (tied) embedding weight."""
    return hidden @ embed.weight.t()


class Block(nn.Module):
    """Pre-norm block: learned position bias, causal self-attention, GELU MLP."""

    def __init__(self, hidden: int, heads: int, max_seq: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.pos = nn.Embedding(max_seq, hidden)
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        # no qkv bias: a key bias has a zero gradient (softmax ignores a shift shared by a
        # row), which Adam would turn from float noise into full-size updates
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, inputs: Tuple[torch.Tensor, torch.Tensor]
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        h, positions = inputs
        h = h + self.pos(positions)
        b, s, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool, device=h.device).triu(1)
        attention = self.drop(scores.masked_fill(causal, float("-inf")).softmax(-1))
        h = h + self.proj(torch.einsum("bhqk,bkhd->bqhd", attention, v).reshape(b, s, d))
        return h + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(h))))), positions


def take_hidden(inputs: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return inputs[0]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def layers(num_blocks: int = 4, dropout: float = 0.0) -> list:
    """embedding -> blocks -> (take hidden) -> LayerNorm -> tied output projection."""
    return ([TiedLayerSpec("embed", Embed, VOCAB, HIDDEN)]
            + [LayerSpec(Block, HIDDEN, HEADS, SEQ, dropout) for _ in range(num_blocks)]
            + [take_hidden, LayerSpec(nn.LayerNorm, HIDDEN),
               TiedLayerSpec("embed", Embed, VOCAB, HIDDEN, forward_fn=lm_head)])


class PlainModel(nn.Module):
    """The same model as one nn.Module, each layer built under seed BASE_SEED + its index
    (what PipelineModule(seed_layers=True) does), to train with a plain torch loop."""

    def __init__(self, num_blocks: int = 4) -> None:
        super().__init__()
        torch.manual_seed(BASE_SEED)
        self.embed = Embed(VOCAB, HIDDEN)
        blocks: List[nn.Module] = []
        for i in range(num_blocks):
            torch.manual_seed(BASE_SEED + 1 + i)
            blocks.append(Block(HIDDEN, HEADS, SEQ))
        self.blocks = nn.ModuleList(blocks)
        torch.manual_seed(BASE_SEED + num_blocks + 2)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return lm_head(self.embed, self.norm(take_hidden(x)))


def micro_batch(step: int, index: int, micro_batch_size: int = 2
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(token ids, next-token labels) of micro-batch `index` of `step` (deterministic)."""
    g = torch.Generator().manual_seed(1000 * step + index)
    tokens = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
