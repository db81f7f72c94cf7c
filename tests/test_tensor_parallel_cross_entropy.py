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


# Issue 33: the loss works in place on a private fp32 copy and backward turns the saved
# softmax into the gradient in place; these guard what that must not change.

def _fp64_reference(logits, target, vocab, smoothing):
    """Loss and grad (of sum(loss * weights)) in float64 over the real vocab columns."""
    x = logits[..., :vocab].double().detach().requires_grad_(True)
    loss = F.cross_entropy(x.reshape(-1, vocab), target.reshape(-1), reduction="none",
                           label_smoothing=smoothing).view(target.shape)
    weights = torch.linspace(0.5, 1.5, loss.numel(), dtype=torch.float64).view_as(loss)
    (loss * weights).sum().backward()
    grad = torch.zeros(logits.shape, dtype=torch.float64)
    grad[..., :vocab] = x.grad
    return loss.detach(), grad


def _check_fp64(rank, world_size):
    """Every slice shape: unpadded, a partly padded slice, slices that are all padding."""
    group = dist.new_group(list(range(world_size))) if world_size > 1 else None
    logits, _ = _inputs()
    for vocab in (PADDED, VOCAB, 10):  # 10 of 48: over tp=4 two slices hold only padding
        target = torch.randint(0, vocab, logits.shape[:-1], generator=torch.Generator()
                               .manual_seed(vocab))
        for smoothing in (0.0, 0.1):
            ref_loss, ref_grad = _fp64_reference(logits, target, vocab, smoothing)
            part = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
            loss = vocab_parallel_cross_entropy(part, target, group, vocab_size=vocab,
                                                label_smoothing=smoothing)
            weights = torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)
            (loss * weights).sum().backward()
            torch.testing.assert_close(loss.double(), ref_loss, rtol=2e-6, atol=1e-6)
            want = ref_grad.chunk(world_size, dim=-1)[rank]
            torch.testing.assert_close(part.grad.double(), want, rtol=2e-6, atol=1e-7)
            padded = torch.arange(rank * part.shape[-1], (rank + 1) * part.shape[-1]) >= vocab
            assert torch.all(part.grad[..., padded] == 0)  # padding gets exactly nothing
    return True


def test_loss_and_grad_equal_the_fp64_reference_with_padding_and_smoothing():
    assert _check_fp64(0, 1)


def test_tp4_with_slices_of_only_padding_equals_the_fp64_reference():
    assert all(run_on_ranks(_check_fp64, 4))


def test_callers_fp32_logits_are_not_modified():
    logits, target = _inputs()
    logits.requires_grad_(True)
    before = logits.detach().clone()
    loss = vocab_parallel_cross_entropy(logits, target, vocab_size=VOCAB, label_smoothing=0.1)
    assert torch.equal(logits.detach(), before)
    loss.sum().backward()
    assert torch.equal(logits.detach(), before)


def test_bf16_logits_give_bf16_grads_equal_to_the_fp64_reference_rounded():
    logits, target = _inputs()
    low = logits.bfloat16().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(low, target, vocab_size=VOCAB, label_smoothing=0.1)
    weights = torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)
    (loss * weights).sum().backward()
    assert loss.dtype == torch.float32 and low.grad.dtype == torch.bfloat16
    ref_loss, ref_grad = _fp64_reference(low.detach().float(), target, VOCAB, 0.1)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=2e-6, atol=1e-6)
    # the only bf16 rounding is the final one: within half a bf16 step of the reference
    torch.testing.assert_close(low.grad.double(), ref_grad, rtol=1.01 * 2 ** -8, atol=1e-30)


def test_second_backward_through_the_same_loss_raises_one_clear_line():
    logits, target = _inputs()
    logits.requires_grad_(True)
    loss = vocab_parallel_cross_entropy(logits, target, vocab_size=VOCAB).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice") as error:
        loss.backward()
    assert "\n" not in str(error.value)
