"""Packed documents' batch format (data/documents.py) against Megatron-Core's own masks."""
import numpy as np
import pytest
import torch

from gigatron.data.documents import (CU_SEQLENS, cu_seqlens_from_lengths, eod_boundaries,
                                     gpt_sample)

EOD = 0


def _implied_mask(cu_seqlens: np.ndarray) -> torch.Tensor:
    """Megatron's dense mask convention (True: masked) from the boundaries, for the test."""
    s = int(cu_seqlens[-1])
    doc = np.searchsorted(cu_seqlens, np.arange(s), side="right")
    same = torch.as_tensor(doc[:, None] == doc[None, :])
    return ~(same & torch.ones(s, s, dtype=torch.bool).tril())


@pytest.mark.parametrize("tokens", [
    [5, 6, EOD, 7, 8, 9, EOD, 3, 4, 2],  # three documents, the last one cut
    [EOD, 5, EOD, EOD, 6, 7, 8, 9, 1, EOD],  # leading eod, empty-looking runs, eod last
    [5, 6, 7, 8, 9, 1, 2, 3, 4, 6],  # no eod: one document
])
def test_boundaries_match_megatron_core_masks_and_positions(tokens):
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    sample = gpt_sample(np.array(tokens + [1]), EOD, eod_mask_loss=True,
                        reset_position_ids=True, reset_attention_mask=True)
    mask, loss_mask, positions = _get_ltor_masks_and_position_ids(
        torch.tensor(tokens), EOD, True, True, True, True)
    assert torch.equal(_implied_mask(sample[CU_SEQLENS]), mask[0])
    assert np.array_equal(sample["position_ids"], positions.numpy())
    assert np.array_equal(sample["loss_mask"], loss_mask.numpy())
    assert sample[CU_SEQLENS].shape == (len(tokens) + 1,)


def test_without_the_reset_flags_a_sample_is_one_stream():
    sample = gpt_sample(np.array([5, EOD, 6, 7, 1]), EOD)
    assert CU_SEQLENS not in sample
    assert sample["position_ids"].tolist() == [0, 1, 2, 3]
    only_positions = gpt_sample(np.array([5, EOD, 6, 7, 1]), EOD, reset_position_ids=True)
    assert CU_SEQLENS not in only_positions
    assert only_positions["position_ids"].tolist() == [0, 1, 0, 1]


def test_cu_seqlens_pads_by_repeating_the_length():
    assert cu_seqlens_from_lengths([3, 2], 8).tolist() == [0, 3, 5, 8, 8, 8, 8, 8, 8]
    assert eod_boundaries(np.array([4, EOD, 5, 6]), EOD).tolist() == [0, 2, 4, 4, 4]
    with pytest.raises(ValueError, match="do not fit"):
        cu_seqlens_from_lengths([5, 5], 8)
