"""A DeepSpeed user's training script, run by gigatron: only the import differs.

    python train.py --deepspeed --deepspeed_config ds_config.json            # one process
    torchrun --nproc-per-node 2 train.py --deepspeed --deepspeed_config ds_config_zero3.json

A small classifier on random data, written the way DeepSpeed's tutorials write it: argparse
with --local_rank and deepspeed.add_config_arguments, deepspeed.initialize with the training
data, then engine(x) / engine.backward(loss) / engine.step() per micro-batch.
"""
import argparse

import torch
from torch.utils.data import Dataset

import gigatron as deepspeed  # the one line that differs from the DeepSpeed script


class RandomData(Dataset):
    """Random inputs whose label is the arg-max of a fixed projection: learnable."""

    def __init__(self, samples: int, dim: int, classes: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, dim, generator=g)
        self.y = (self.x @ torch.randn(dim, classes, generator=g)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Classifier(torch.nn.Module):
    def __init__(self, dim: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(), torch.nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="small classifier on random data")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = get_args()
    torch.manual_seed(42)
    model = Classifier(args.dim, 64, 8)
    engine, optimizer, train_loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(),
        training_data=RandomData(1024, args.dim, 8))
    criterion = torch.nn.CrossEntropyLoss()
    dtype = next(engine.parameters()).dtype
    losses = []
    for epoch in range(args.epochs):
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(engine.device, dtype=dtype), y.to(engine.device)
            loss = criterion(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if engine.global_rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step} loss {losses[-1]:.4f}", flush=True)
    if engine.global_rank == 0:
        first, last = (sum(part) / len(part) for part in (losses[:10], losses[-10:]))
        print(f"done: {engine.global_steps} steps, loss {first:.4f} -> {last:.4f} (mean of the "
              f"first and last 10 micro-batches), loss scale {engine.loss_scale:g}, skipped "
              f"{engine.skipped_steps}", flush=True)


if __name__ == "__main__":
    main()
