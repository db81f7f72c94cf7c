"""The per-document context-parallel split (parallel/context/split.py): Megatron-Core's THD
split of packed documents, each in 2 x cp chunks, rank i holding chunks i and 2cp-1-i of
every document."""
import pytest
import torch

from gigatron.data.documents import cu_seqlens_from_lengths
from gigatron.parallel.context.split import (document_chunks, document_rank_positions,
                                             document_split_applies, split_documents_for_rank)


def test_rule_needs_every_document_divisible_by_2cp():
    assert document_split_applies(cu_seqlens_from_lengths([8, 4, 12], 32), 2)  # rest 8
    assert not document_split_applies(cu_seqlens_from_lengths([8, 4, 12], 30), 2)  # rest 6
    assert not document_split_applies(cu_seqlens_from_lengths([8, 6], 16), 2)
    assert not document_split_applies(cu_seqlens_from_lengths([8, 8], 16), 1)
    with pytest.raises(ValueError, match="--context-parallel-size"):
        document_chunks(cu_seqlens_from_lengths([8, 6], 16), 2, 0)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_each_rank_holds_chunks_i_and_mirror_of_every_document(cp):
    lengths = [2 * cp * 5, 2 * cp, 2 * cp * 2]  # one long document among short ones
    cu = cu_seqlens_from_lengths(lengths, sum(lengths))
    held = [document_rank_positions(cu, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(sum(lengths)))  # a partition
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    for r in range(cp):
        expected = []
        for start, n in zip(starts, lengths):
            chunk = n // (2 * cp)
            for c in (r, 2 * cp - 1 - r):
                expected += list(range(start + c * chunk, start + (c + 1) * chunk))
        assert held[r].tolist() == expected
        for start, n in zip(starts, lengths):  # balanced: the same tokens of each document
            mine = ((held[r] >= start) & (held[r] < start + n)).sum().item()
            assert mine == n // cp


def test_split_selects_positions_and_ignores_empty_documents():
    cu = cu_seqlens_from_lengths([4, 8], 16)  # a last (padding) document of 4, then repeats
    assert document_chunks(cu, 2, 1) == [(1, 1), (2, 1), (6, 2), (8, 2), (13, 1), (14, 1)]
    x = torch.arange(2 * 16).reshape(2, 16)
    assert split_documents_for_rank(x, cu, 2, 1, seq_dim=1).tolist() == [
        [1, 2, 6, 7, 8, 9, 13, 14], [17, 18, 22, 23, 24, 25, 29, 30]]
