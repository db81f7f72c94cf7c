"""A plain PyTorch GPT (nanoGPT-sized) for the torch.compile baseline of bench_train_gpu.py.

The same architecture as gigatron's GPT for the zoo's GPT-2/GPT-3 configs: learned positions,
pre-LayerNorm blocks, fused QKV, causal SDPA (flash attention on a GPU), tanh-GeLU MLP of
4h, tied input/output embedding, biases on every linear. Nothing gigatron is imported: it is
the "what you would write by hand" reference the trainer must beat.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class PlainConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # padded as gigatron pads it, so both compute the same logits
    seq_length: int
    ffn_hidden_size: int = 0  # 0: 4 x hidden
    layernorm_epsilon: float = 1e-5

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size


class Block(nn.Module):
    def __init__(self, c: PlainConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.ln_1 = nn.LayerNorm(h, eps=c.layernorm_epsilon)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h, eps=c.layernorm_epsilon)
        self.fc1 = nn.Linear(h, c.ffn)
        self.fc2 = nn.Linear(c.ffn, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, c: PlainConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position = nn.Embedding(c.seq_length, c.hidden_size)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.ln_f = nn.LayerNorm(c.hidden_size, eps=c.layernorm_epsilon)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of `labels` given `tokens` ([b, s] each)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.embedding.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               labels: torch.Tensor, autocast_dtype: torch.dtype) -> torch.Tensor:
    """One step of the plain loop: bf16 autocast over fp32 params, backward, optimizer step;
    the loss stays on the device (no host read)."""
    with torch.autocast(tokens.device.type, dtype=autocast_dtype,
                        enabled=autocast_dtype != torch.float32):
        loss = model(tokens, labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
