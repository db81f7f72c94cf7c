"""Pipeline parallelism for your own model, with DeepSpeed's API.

    torchrun --nproc-per-node 2 examples/pipeline_user_model.py              # 2 stages
    torchrun --nproc-per-node 4 examples/pipeline_user_model.py --stages 2   # 2 stages x 2 replicas
    python examples/pipeline_user_model.py                                    # one process

The model below is plain PyTorch: an embedding, a few transformer blocks and an output
projection that reuses the embedding's weight. To pipeline it, write it as a list of
layers (each layer's output is the next one's input), hand the list to PipelineModule,
and train with engine.train_batch(). Each rank builds only the layers of its own stage.
The task: continue counting sequences (3, 4, 5, ... modulo the vocabulary).
"""
import argparse
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import gigatron
from gigatron.pipe import LayerSpec, PipelineModule, TiedLayerSpec

VOCAB, HIDDEN, HEADS, SEQ = 64, 32, 4, 16


# -- the model: ordinary nn.Modules ----------------------------------------------------------
class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class Positions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[:x.shape[1]]


def output_projection(embedding: Embedding, hidden: torch.Tensor) -> torch.Tensor:
    """Logits through the embedding's own weight (tied input/output embeddings)."""
    return hidden @ embedding.weight.t()


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(),
                                 nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, h // HEADS).transpose(1, 3).unbind(2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(h // HEADS)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        x = x + self.out(attention.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(self.norm2(x))


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


# -- the same model as pipeline layers ---------------------------------------------------------
def pipeline_layers(num_blocks: int) -> list:
    return [TiedLayerSpec("embedding", Embedding),        # built on the first stage
            LayerSpec(Positions),
            *[LayerSpec(Block) for _ in range(num_blocks)],
            LayerSpec(nn.LayerNorm, HIDDEN),
            TiedLayerSpec("embedding", Embedding,         # and on the last: kept equal
                          forward_fn=output_projection)]


class CountingSequences(Dataset):
    """(tokens, next tokens) of sequences that count up from a random start."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int):
        start = torch.randint(0, VOCAB, (1,), generator=torch.Generator().manual_seed(i))
        tokens = (start + torch.arange(SEQ + 1)) % VOCAB
        return tokens[:-1], tokens[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                        help="pipeline stages (default: one per rank)")
    parser.add_argument("--virtual-stages", type=int, default=1,
                        help="chunks per stage: > 1 runs the interleaved schedule")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    ds_config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 4,       # micro-batches in flight per step
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10,
    }
    net = PipelineModule(layers=pipeline_layers(args.blocks), num_stages=args.stages,
                         virtual_stages=args.virtual_stages, loss_fn=next_token_loss,
                         partition_method="parameters", seed_layers=True)
    engine, _, _, _ = gigatron.initialize(model=net, config=ds_config,
                                          training_data=CountingSequences())
    losses = []
    for step in range(1, args.steps + 1):
        losses.append(float(engine.train_batch()))  # reads from the training_data loader
        if engine.global_rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    if engine.global_rank == 0:
        print(f"done: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
