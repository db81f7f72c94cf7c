"""Vocab-parallel cross-entropy equals torch's cross_entropy (± label smoothing), never
gives probability to padded vocab entries, and its grads match. Tolerance: rtol 1e-5,
atol 1e-7 (fp32)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multirank import run_on_ranks

from gigatron.parallel.tensor import vocab_parallel_cross_entropy

VOCAB, PADDED = 37, 48  # 11 padded entries; 48 splits into 1, 2 or 4 parts


def _inputs():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 3, PADDED, generator=g) * 3
    logits[..., VOCAB:] = 50.0  # padded entries with huge logits must still get nothing
    target = torch.randint(0, VOCAB, (5, 3), generator=g)
    return logits, target


def _reference(logits, target, smoothing):
    x = logits[..., :VOCAB].detach().clone().requires_grad_(True)
    loss = F.cross_entropy(x.reshape(-1, VOCAB), target.reshape(-1), reduction="none",
                           label_smoothing=smoothing).view(target.shape)
    weights = torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)
    (loss * weights).sum().backward()
    grad = torch.zeros_like(logits)
    grad[..., :VOCAB] = x.grad
    return loss.detach(), grad


def _parallel(logits, target, smoothing, group, rank, n):
    part = logits.chunk(n, dim=-1)[rank].detach().clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(part, target, group, vocab_size=VOCAB,
                                        label_smoothing=smoothing)
    weights = torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)
    (loss * weights).sum().backward()
    return loss.detach(), part.grad


def _check_all(rank, world_size):
    group = dist.new_group(list(range(world_size))) if world_size > 1 else None
    logits, target = _inputs()
    for smoothing in (0.0, 0.1):
        ref_loss, ref_grad = _reference(logits, target, smoothing)
        loss, grad = _parallel(logits, target, smoothing, group, rank, world_size)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grad, ref_grad.chunk(world_size, dim=-1)[rank],
                                   rtol=1e-5, atol=1e-7)
    return True


def test_single_rank_equals_torch_cross_entropy_with_and_without_label_smoothing():
    assert _check_all(0, 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_equals_torch_cross_entropy_and_padding_gets_no_grad(world_size):
    assert all(run_on_ranks(_check_all, world_size))


def test_bad_label_smoothing_names_the_field():
    logits, target = _inputs()
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(logits, target, vocab_size=VOCAB, label_smoothing=1.5)
