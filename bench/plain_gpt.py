"""Plain PyTorch GPT and Llama models for the torch.compile baseline of bench_train_gpu.py.

PlainGPT is the zoo's GPT-2/GPT-3 architecture: learned positions, pre-LayerNorm blocks,
fused QKV, causal SDPA (flash attention on a GPU), GeLU MLP, tied input/output embedding,
biases on every linear. PlainLlama is the zoo's Llama architecture: RMSNorm, fused QKV with
grouped key/value heads (repeated to the query heads, as gigatron and megatron-core do),
RoPE in Llama's half-rotation layout (optionally with Llama 3.1's frequency scaling), SwiGLU
MLP, no biases, tied or untied output. Nothing gigatron is imported: it is the "what you
would write by hand" reference the trainer must beat.
"""
from __future__ import annotations

from dataclasses import dataclass

import math
from typing import Optional

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
    gelu_approximate: str = "tanh"  # GPT: "tanh" (gelu_tanh) or "none" (gelu)
    # Llama only (PlainLlama):
    num_query_groups: int = 0  # 0: one per head
    rotary_base: float = 10000.0
    rope_scaling_factor: Optional[float] = None  # Llama 3.1 scaling; None: none
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    tie_embeddings: bool = True

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads


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
        self.approximate = c.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x)), approximate=self.approximate))


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


def rope_inverse_frequencies(c: PlainConfig, head_dim: int) -> torch.Tensor:
    """RoPE's per-pair frequencies base^(-2i/d), with Llama 3.1's scaling when configured:
    long wavelengths divided by the factor, short ones kept, the band between blended."""
    inv = 1.0 / c.rotary_base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if c.rope_scaling_factor is None:
        return inv.float()
    factor, old = c.rope_scaling_factor, c.rope_scaling_original_max_position_embeddings
    low, high = c.rope_scaling_low_freq_factor, c.rope_scaling_high_freq_factor
    wavelength = 2 * math.pi / inv
    blend = ((old / wavelength - low) / (high - low)).clamp(0, 1)  # 0: long, 1: short
    return ((1 - blend) * inv / factor + blend * inv).float()


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's RoPE: channel i pairs with i + d/2 (not interleaved)."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, c: PlainConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.heads, self.groups, self.head_dim = c.num_attention_heads, c.groups, \
            h // c.num_attention_heads
        self.attention_norm = nn.RMSNorm(h, eps=c.layernorm_epsilon)
        self.qkv = nn.Linear(h, (self.heads + 2 * self.groups) * self.head_dim, bias=False)
        self.proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=c.layernorm_epsilon)
        self.gate_up = nn.Linear(h, 2 * c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(b, s, -1, self.head_dim).transpose(
            1, 2).split([self.heads, self.groups, self.groups], dim=1)
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        repeat = self.heads // self.groups
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class PlainLlama(nn.Module):
    def __init__(self, c: PlainConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(c.vocab_size, c.hidden_size)
        self.blocks = nn.ModuleList(LlamaBlock(c) for _ in range(c.num_layers))
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.layernorm_epsilon)
        self.output = None if c.tie_embeddings else nn.Linear(c.hidden_size, c.vocab_size,
                                                               bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)
        head_dim = c.hidden_size // c.num_attention_heads
        angles = torch.outer(torch.arange(c.seq_length, dtype=torch.float32),
                             rope_inverse_frequencies(c, head_dim)).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of `labels` given `tokens` ([b, s] each)."""
        x = self.embedding(tokens)
        cos, sin = self.cos[:tokens.shape[1]], self.sin[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x, cos, sin)
        weight = self.embedding.weight if self.output is None else self.output.weight
        logits = F.linear(self.norm(x), weight)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def plain_model(c: PlainConfig, llama: bool) -> nn.Module:
    """The plain model of the architecture: PlainLlama (llama=True) or PlainGPT."""
    return PlainLlama(c) if llama else PlainGPT(c)


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
