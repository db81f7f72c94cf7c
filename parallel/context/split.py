"""The causal load-balanced sequence split of Megatron-Core, as pure functions.

With causal attention the last tokens of a sequence attend to many more keys than the first,
so a plain split in cp pieces gives the last rank most of the work. The sequence is cut into
2 x cp chunks instead, and rank i holds chunks i and 2cp-1-i: an early chunk and a late one,
so every rank does the same attention work. Positions (learned or RoPE) stay the global ones.

Packed documents whose lengths all divide by 2 x cp (SFT's conversations padded to a multiple
of 2 x cp, as Megatron-LM's --sft does under cp) can be split per document instead, as
Megatron-Core splits packed (THD) sequences: each document in 2 x cp chunks, rank i holding
chunks i and 2cp-1-i of every document, so each rank holds the same tokens of every document
however unequal the documents are. `document_split_applies` is the one rule that picks it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
HIERARCHICAL_FLAG = "--hierarchical-context-parallel-sizes"


def check_context_parallel(seq_length: int, cp: int, num_heads: int, num_query_groups: int,
                           comm_type: str = "p2p",
                           hierarchical_sizes: Optional[Sequence[int]] = None) -> None:
    """Raise one line naming the flag and the fix when a layout cannot split the attention
    (`hierarchical_sizes`: a2a+p2p's (A, P))."""
    if cp < 1:
        raise ValueError(f"--context-parallel-size {cp}: must be at least 1")
    if comm_type == "a2a+p2p":
        inner = check_hierarchical_sizes(cp, hierarchical_sizes)
        for flag, heads in (("--num-attention-heads", num_heads),
                            ("--num-query-groups", num_query_groups)):
            if heads % inner:
                raise ValueError(f"{flag} {heads} is not divisible by the a2a size {inner} of "
                                 f"{HIERARCHICAL_FLAG} (a2a+p2p splits the heads over it): "
                                 f"pick an a2a size that divides it")
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type!r}: choose one of {', '.join(COMM_TYPES)}")
    if seq_length % (2 * cp):
        raise ValueError(f"--seq-length {seq_length} is not divisible by 2 x "
                         f"--context-parallel-size = {2 * cp} (the causal load-balanced "
                         f"split): pick a multiple of {2 * cp}")
    if num_heads % num_query_groups:
        raise ValueError(f"--num-attention-heads {num_heads} is not divisible by "
                         f"--num-query-groups {num_query_groups}")
    if comm_type == "a2a" and num_query_groups % cp:
        flag = ("--num-attention-heads" if num_query_groups == num_heads
                else "--num-query-groups")
        raise ValueError(f"{flag} {num_query_groups} is not divisible by "
                         f"--context-parallel-size {cp} (--cp-comm-type a2a splits the "
                         f"{'heads' if flag == '--num-attention-heads' else 'key/value heads'}"
                         f" over cp): pick a cp that divides it, or --cp-comm-type p2p")


def check_hierarchical_sizes(cp: int, sizes: Optional[Sequence[int]]) -> int:
    """a2a+p2p's sizes A P: two, their product cp; returns A."""
    if sizes is None or len(sizes) != 2 or min(sizes) < 1:
        raise ValueError(f"--cp-comm-type a2a+p2p needs {HIERARCHICAL_FLAG} A P (a2a within "
                         f"groups of A cp ranks, p2p ring across P of them), got {sizes}")
    inner, outer = sizes
    if inner * outer != cp:
        raise ValueError(f"{HIERARCHICAL_FLAG} {inner} {outer}: the product {inner * outer} "
                         f"must equal --context-parallel-size {cp}")
    return inner


def rank_chunks(cp: int, rank: int) -> Tuple[int, int]:
    """The two of the 2 x cp sequence chunks that context-parallel rank `rank` holds."""
    if not 0 <= rank < cp:
        raise ValueError(f"context-parallel rank {rank} is outside 0..{cp - 1}")
    return rank, 2 * cp - 1 - rank


def gather_order(cp: int) -> List[int]:
    """The chunk ids of the cp ranks' pieces concatenated in rank order."""
    return [chunk for rank in range(cp) for chunk in rank_chunks(cp, rank)]


def rank_positions(seq_length: int, cp: int, rank: int) -> torch.Tensor:
    """Global token positions held by `rank`, in its local order (for position ids, masks)."""
    _check_divisible(seq_length, cp)
    chunk = seq_length // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in rank_chunks(cp, rank)])


def split_for_rank(x: torch.Tensor, cp: int, rank: int, seq_dim: int) -> torch.Tensor:
    """`rank`'s piece of a full-sequence tensor ([b, s, ...] with seq_dim 1, [s, b, ...] with 0)."""
    _check_divisible(x.shape[seq_dim], cp)
    chunks = x.chunk(2 * cp, dim=seq_dim)
    return torch.cat([chunks[c] for c in rank_chunks(cp, rank)], dim=seq_dim)


def restore_sequence(pieces: Sequence[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """The full sequence in global order from every rank's piece (the inverse of
    split_for_rank over ranks 0..cp-1)."""
    cp = len(pieces)
    halves = [half for piece in pieces for half in piece.chunk(2, dim=seq_dim)]
    by_chunk = dict(zip(gather_order(cp), halves))
    return torch.cat([by_chunk[c] for c in range(2 * cp)], dim=seq_dim)


def global_order_index(seq_length: int, cp: int) -> torch.Tensor:
    """Index that puts the rank-order concatenation of the pieces into global order."""
    gathered = torch.cat([rank_positions(seq_length, cp, r) for r in range(cp)])
    return torch.argsort(gathered)


def document_split_applies(cu_seqlens: Sequence[int], cp: int, comm_type: str = "p2p") -> bool:
    """The rule: the per-document split when cp > 1 (any comm type) and every document of the
    sample (a padded `cu_seqlens`, data/documents.py) has a length divisible by 2 x cp;
    otherwise the whole-sequence split above. The data's shard and the attention both ask
    it, so they agree."""
    bounds = [int(b) for b in cu_seqlens]
    return cp > 1 and comm_type in COMM_TYPES and all((end - start) % (2 * cp) == 0
                                                      for start, end in zip(bounds, bounds[1:]))


def document_chunks(cu_seqlens: Sequence[int], cp: int, rank: int) -> List[Tuple[int, int]]:
    """(global start, length) of the chunks `rank` holds under the per-document split, in
    its local order: chunk i then chunk 2cp-1-i of each document in turn (Megatron-Core's
    THD order)."""
    if not document_split_applies(cu_seqlens, cp):
        raise ValueError(f"the per-document context-parallel split needs every document "
                         f"length divisible by 2 x --context-parallel-size = {2 * cp}; pad "
                         f"the documents (--sft does) or use the whole-sequence split")
    bounds = [int(b) for b in cu_seqlens]
    out = []
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            chunk = (end - start) // (2 * cp)
            out += [(start + c * chunk, chunk) for c in rank_chunks(cp, rank)]
    return out


def document_rank_positions(cu_seqlens: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """Global token positions held by `rank` under the per-document split, in local order."""
    return torch.cat([torch.arange(start, start + n)
                      for start, n in document_chunks(cu_seqlens, cp, rank)])


def split_documents_for_rank(x: torch.Tensor, cu_seqlens: Sequence[int], cp: int, rank: int,
                             seq_dim: int) -> torch.Tensor:
    """`rank`'s piece of a full-sequence tensor under the per-document split."""
    index = document_rank_positions(cu_seqlens, cp, rank).to(x.device)
    return x.index_select(seq_dim, index)


def document_local_chunks(cu_seqlens: Sequence[int], cp: int,
                          rank: int) -> List[Tuple[int, int, int]]:
    """`rank`'s chunks under the per-document split as (local row, rows, global start)."""
    out, row = [], 0
    for start, n in document_chunks(cu_seqlens, cp, rank):
        out.append((row, n, start))
        row += n
    return out


def document_order_index(cu_seqlens: Sequence[int], cp: int) -> torch.Tensor:
    """Index that puts the rank-order concatenation of the per-document pieces into global
    order."""
    return torch.argsort(torch.cat([document_rank_positions(cu_seqlens, cp, r)
                                    for r in range(cp)]))


def _check_divisible(seq_length: int, cp: int) -> None:
    if seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x "
                         f"--context-parallel-size = {2 * cp}: pick a multiple of {2 * cp}")
