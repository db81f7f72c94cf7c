"""Attention that stays inside each packed document: from a micro-batch's `cu_seqlens`
(data/documents.py) to per-document attention, with no sequence x sequence mask.

`document_bounds` turns the host tensor [b, s + 1] into each sample's increasing boundaries
once per forward (no device read: the tensor stays on the host). `per_sample` runs an
attention once per sample with that sample's boundaries (samples of a micro-batch hold
different documents). The attention itself is CoreAttention's: on one rank without a window
or sinks it calls its usual kernel (SDPA or the unfused softmax, with dropout) once per
document; with a window, sinks or context parallelism band attention plans blocks only
within documents (parallel/context/band.py), so the kinds compose. Memory stays linear in
the sequence either way.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

CU_SEQLENS = "cu_seqlens"  # the micro-batch key, as data/documents.py names it

# per sample, its document boundaries 0 = c0 < c1 < ... < cn = s (global positions)
Documents = List[Tuple[int, ...]]


def document_bounds(cu_seqlens: Optional[torch.Tensor]) -> Optional[Documents]:
    """Each sample's boundaries from the padded `cu_seqlens` [b, s + 1] (or [s + 1]); empty
    documents dropped. None passes through (one causal stream)."""
    if cu_seqlens is None:
        return None
    if cu_seqlens.device.type != "cpu":
        raise ValueError("cu_seqlens must stay a host (CPU) tensor: attention plans its "
                         "document blocks from it without reading the device")
    rows = cu_seqlens.reshape(-1, cu_seqlens.shape[-1]).tolist()
    return [tuple(sorted(set(int(c) for c in row))) for row in rows]


def per_sample(attention: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, documents: Documents) -> torch.Tensor:
    """attention(q_i, k_i, v_i, documents_i) for each sample i of q, k, v [b, heads, s, d],
    concatenated over the batch (one call when every sample has the same documents)."""
    if len(documents) != q.shape[0]:
        raise ValueError(f"{len(documents)} samples of document boundaries for a "
                         f"micro-batch of {q.shape[0]}")
    if all(bounds == documents[0] for bounds in documents):
        return attention(q, k, v, documents[0])
    return torch.cat([attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], bounds)
                      for i, bounds in enumerate(documents)])


def per_document(attention: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """A causal attention(q, k, v) [b, heads, s, d] on each document's rows alone, the
    outputs laid back in sequence order."""
    if len(bounds) == 2:
        return attention(q, k, v)
    # one split per tensor, not a slice per document: a split's backward is one cat of the
    # documents' grads, where each slice's would zero-fill a sequence-sized grad
    sizes = [e - a for a, e in zip(bounds, bounds[1:])]
    pieces = zip(*(torch.split(t, sizes, dim=2) for t in (q, k, v)))
    return torch.cat([attention(*qkv) for qkv in pieces], dim=2)
