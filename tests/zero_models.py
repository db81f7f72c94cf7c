"""Tiny models and the single-device references shared by the ZeRO tests."""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn
import torch.nn.functional as F

VOCAB, HIDDEN, SEQ = 32, 16, 8


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 2 * h)
        self.fc2 = nn.Linear(2 * h, h)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding -> residual MLP blocks -> norm -> untied output; returns per-token loss."""

    def __init__(self, layers: int = 2, dtype=torch.float32, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(HIDDEN) for _ in range(layers))
        self.final_norm = nn.LayerNorm(HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCAB)
        with torch.no_grad():  # non-trivial norm params so their grads/decay matter
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.add_(0.1 * torch.randn_like(m.weight))
                    m.bias.add_(0.1 * torch.randn_like(m.bias))
        self.to(dtype)

    def forward(self, tokens, labels):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.final_norm(x)).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                               reduction="none").view_as(labels)


def batches(steps: int, batch: int, seed: int = 1) -> List[tuple]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        t = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def torch_param_groups(model: nn.Module, weight_decay: float):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def reference_adamw(steps: int, batch: int, lr: float = 1e-2, wd: float = 0.1,
                    clip: float = 0.0) -> Dict[str, torch.Tensor]:
    """Single-process torch.optim.AdamW on the full batch: the ground truth."""
    model = TinyLM()
    opt = torch.optim.AdamW(torch_param_groups(model, wd), lr=lr)
    for tokens, labels in batches(steps, batch):
        opt.zero_grad()
        model(tokens, labels).mean().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_mixed_precision(steps: int, batch: int, dtype, lr: float = 1e-2,
                              wd: float = 0.1) -> Dict[str, torch.Tensor]:
    """Single device: low-precision model, fp32 master copies stepped by AdamW."""
    model = TinyLM(dtype=dtype)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    groups = [{"params": [m for m, p in zip(masters, model.parameters()) if p.dim() >= 2],
               "weight_decay": wd},
              {"params": [m for m, p in zip(masters, model.parameters()) if p.dim() < 2],
               "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr)
    for tokens, labels in batches(steps, batch):
        model.zero_grad()
        model(tokens, labels).mean().backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return {n: p.detach().clone() for n, p in model.named_parameters()}
