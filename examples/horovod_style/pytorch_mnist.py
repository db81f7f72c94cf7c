"""A Horovod user's PyTorch script, run by gigatron: only the import differs.

    python pytorch_mnist.py                                   # one process
    mpirun -np 2 python pytorch_mnist.py                      # Open MPI, one host
    torchrun --nproc-per-node 2 pytorch_mnist.py
    gigatron launch -np 2 --no_local_rank pytorch_mnist.py --fp16-allreduce

Written the way Horovod's examples/pytorch/pytorch_mnist.py is: hvd.init(), a
DistributedSampler over hvd.size() ranks, the learning rate scaled by hvd.size(),
broadcast_parameters / broadcast_optimizer_state from rank 0, DistributedOptimizer, and a
torch.amp GradScaler loop (synchronize, unscale_, step inside skip_synchronize). The data are
random MNIST-shaped images whose label is the arg-max of a fixed projection (learnable, no
download), and the net has no dropout so runs on 1, 2 or 4 ranks can be compared exactly.
"""
import argparse
from typing import Any, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data.distributed

import gigatron.horovod as hvd  # the one line that differs: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST-style example (random data)")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
parser.add_argument("--test-batch-size", type=int, default=128)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.01, help="learning rate for one rank")
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--no-cuda", action="store_true", default=False)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--log-interval", type=int, default=10)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--use-mixed-precision", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--samples", type=int, default=512, help="training images")


class RandomMNIST(torch.utils.data.Dataset):
    """1x28x28 images; the label is the arg-max of a fixed projection of the patch means."""

    def __init__(self, samples: int, seed: int) -> None:
        self.x = torch.randn(samples, 1, 28, 28, generator=torch.Generator().manual_seed(seed))
        projection = torch.randn(16, 10, generator=torch.Generator().manual_seed(1234))
        coarse = F.avg_pool2d(self.x, 7).flatten(1)  # 4x4 patch means: easy to learn
        self.y = (coarse @ projection).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def main(args: argparse.Namespace) -> Dict[str, Any]:
    """Train; returns the per-step losses and the final model for comparisons."""
    hvd.init()
    torch.manual_seed(args.seed)
    device = torch.device("cuda", hvd.local_rank()) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)

    train_dataset = RandomMNIST(args.samples, seed=0)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_dataset = RandomMNIST(256, seed=1)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net().to(device)
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler,
                                momentum=args.momentum)

    # every rank starts from rank 0's weights and optimizer state
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor)

    scaler = torch.amp.GradScaler(device.type) if args.use_mixed_precision else None
    losses: List[float] = []
    for epoch in range(1, args.epochs + 1):
        train_epoch(args, model, optimizer, train_loader, train_sampler, epoch, device,
                    scaler, losses)
        accuracy = test(model, test_loader, test_sampler, device)
    if hvd.rank() == 0:
        print(f"done: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"test accuracy {accuracy:.3f}, {hvd.size()} ranks", flush=True)
    return {"losses": losses, "state": {k: v.cpu() for k, v in model.state_dict().items()}}


def train_epoch(args: argparse.Namespace, model: nn.Module, optimizer: Any,
                loader: Any, sampler: Any, epoch: int, device: torch.device,
                scaler: Any, losses: List[float]) -> None:
    model.train()
    sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        if scaler is None:
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
        else:
            with torch.autocast(device.type, dtype=amp_dtype):
                loss = F.nll_loss(model(data), target)
            scaler.scale(loss).backward()
            optimizer.synchronize()  # make sure all async allreduces are done
            scaler.unscale_(optimizer)  # in-place unscaling of the reduced gradients
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
        losses.append(loss.item())
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(sampler)}]\t"
                  f"Loss: {loss.item():.6f}", flush=True)


def metric_average(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value), name=name).item()


def test(model: nn.Module, loader: Any, sampler: Any, device: torch.device) -> float:
    model.eval()
    test_loss, correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).float().sum().item()
    test_loss = metric_average(test_loss / len(sampler), "avg_loss")
    accuracy = metric_average(correct / len(sampler), "avg_accuracy")
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100 * accuracy:.2f}%\n")
    return accuracy


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    main(args)
