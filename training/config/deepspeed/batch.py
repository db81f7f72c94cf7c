"""DeepSpeed's batch triple: train_batch_size = train_micro_batch_size_per_gpu x
gradient_accumulation_steps x data-parallel size, any two giving the third. The one rule
pretrain_gpt.py's --deepspeed-config and `gigatron.initialize` complete and check batches by.
"""
from __future__ import annotations

from typing import Optional, Tuple

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps")


def deepspeed_batch_triple(train: Optional[int], micro: Optional[int],
                           grad_acc: Optional[int], dp: int) -> Tuple[int, int, int]:
    """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps) completed
    by DeepSpeed's rule (`_set_batch_related_parameters`, then `_batch_assertion`): two given
    imply the third by floor division; train alone: accumulation 1, micro = train // dp; micro
    alone: accumulation 1, train = micro x dp. Then train = micro x accumulation x dp must hold;
    a ValueError of one line with the arithmetic otherwise."""
    for name, value in zip(BATCH_KEYS, (train, micro, grad_acc)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if train is None and micro is None:
        raise ValueError("give train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed "
                         "infers the rest; gradient_accumulation_steps alone is not enough)")
    how, divisor = "", ""
    if train is not None and micro is not None and grad_acc is None:
        grad_acc = train // micro // dp
        how = f"gradient_accumulation_steps inferred as {train} // {micro} // {dp} = {grad_acc}"
        divisor = f"train_micro_batch_size_per_gpu {micro} x data-parallel size {dp}"
    elif train is not None and micro is None:
        grad_acc = 1 if grad_acc is None else grad_acc
        micro = train // dp // grad_acc
        how = f"train_micro_batch_size_per_gpu inferred as {train} // {dp} // {grad_acc} = {micro}"
        divisor = f"data-parallel size {dp} x gradient_accumulation_steps {grad_acc}"
    elif train is None:
        assert micro is not None  # one of the two is given (checked above)
        grad_acc = 1 if grad_acc is None else grad_acc
        train = micro * grad_acc * dp
    assert train is not None and micro is not None and grad_acc is not None
    if micro < 1 or grad_acc < 1:
        raise ValueError(f"{how}, which must be >= 1: make train_batch_size {train} a multiple "
                         f"of {divisor}")
    product = micro * grad_acc * dp
    if train != product:
        note = f" ({how})" if how else ""
        raise ValueError(f"train_batch_size {train} != train_micro_batch_size_per_gpu {micro} x "
                         f"gradient_accumulation_steps {grad_acc} x data-parallel size {dp} = "
                         f"{product}{note}: make them agree, or leave one out to be inferred")
    return train, micro, grad_acc
