"""The attention core shared by every attention kind: softmax(QK^T * scale, causal) V with
attention dropout, per document, over context-parallel ranks, with sliding windows and sinks
(DESIGN decision 17: kinds are variants of one module, chosen by the config)."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from gigatron import ops
from gigatron.models.attention_kinds import (cached_band_attention, dropout_seed, has_sink,
                                             layer_window)
from gigatron.models.config import TransformerConfig
from gigatron.models.documents import Documents, per_document, per_sample
from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.context.attention import context_parallel_attention
from gigatron.parallel.context.band import band_attention
from gigatron.parallel.tensor import TensorParallelRNGTracker
from gigatron.parallel.tensor.init import InitSpec, set_parallel_attributes


def dropout(x: torch.Tensor, p: float, training: bool,
            tracker: Optional[TensorParallelRNGTracker]) -> torch.Tensor:
    """Dropout; with a tracker, drawn from the per-tp-rank stream (split activations)."""
    if p == 0.0 or not training:
        return x
    if tracker is None:
        return F.dropout(x, p, True)
    with tracker.fork(x.device):
        return F.dropout(x, p, True)


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d), causal) V with attention dropout; no parameters.

    Under context parallelism (`set_context_parallel`) the local queries attend to the keys
    and values of the whole cp group (parallel/context), the sequence being split over it."""

    def __init__(self, config: TransformerConfig,
                 tracker: Optional[TensorParallelRNGTracker], layer_number: int = 0,
                 tp: int = 1, device: Optional[torch.device] = None,
                 softmax_scale: Optional[float] = None) -> None:
        """`layer_number` (global, 0-based) picks its window; `tp` splits the sinks;
        `softmax_scale`: instead of 1/sqrt(d) (MLA's, with YaRN's mscale)."""
        super().__init__()
        self.backend = config.attention_backend
        self.softmax_in_fp32 = config.attention_softmax_in_fp32
        self.p = config.attention_dropout
        self.tracker = tracker
        self.scale = 1.0 / math.sqrt(config.head_dim) if softmax_scale is None \
            else softmax_scale
        self.sdpa_scale = softmax_scale  # None: SDPA's own 1/sqrt(d), the same number
        self.cp_group: Group = None
        self.cp_comm_type = "p2p"
        self.window = layer_window(config, layer_number)
        # the sink logit per head (Megatron-Core's softmax_offset), split with the heads
        # (off-by-one's is a zero buffer, registered before any plain attribute of that name)
        self.softmax_offset: Optional[torch.Tensor]
        heads = config.num_attention_heads
        if config.softmax_type == "learnable":
            self.softmax_offset = nn.Parameter(torch.empty(
                heads // tp, dtype=config.params_dtype, device=device))
            set_parallel_attributes(self.softmax_offset,
                                    InitSpec("normal", (heads,), config.init_method_std),
                                    partition_dim=0)
        elif has_sink(config):
            self.register_buffer("softmax_offset", torch.zeros(
                heads // tp, dtype=config.params_dtype, device=device), persistent=False)
        else:
            self.softmax_offset = None
        self.band = self.window is not None or self.softmax_offset is not None

    def set_context_parallel(self, cp_group: Group, comm_type: str = "p2p") -> None:
        """Attend over the sequence split across `cp_group` (None or one rank: no split)."""
        self.cp_group = (cp_group if cp_group is not None and comm.group_size(cp_group) > 1
                         else None)
        self.cp_comm_type = comm_type

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Optional[Documents] = None) -> torch.Tensor:
        """q, k [s, b, n or g, d]; v [s, b, g, dv] (g query groups) -> [s, b, n*dv];
        `documents`: each sample's document boundaries (models/documents.py), attended
        apart (None: one causal stream)."""
        s, b, n, d = q.shape
        dv = v.shape[-1]
        if k.shape[2] != n:
            k = k.repeat_interleave(n // k.shape[2], dim=2)
            v = v.repeat_interleave(n // v.shape[2], dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        out = self._attend(q, k, v) if documents is None else \
            per_sample(self._attend, q, k, v, documents)
        return out.permute(2, 0, 1, 3).reshape(s, b, n * dv)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                bounds: Optional[Sequence[int]] = None) -> torch.Tensor:
        """[b, n, s, d] -> [b, n, s, dv], within the documents `bounds` when given."""
        p = self.p if self.training else 0.0
        if self.cp_group is not None:
            return context_parallel_attention(*equal_head_dims(q, k, v), self.cp_group,
                                              self.cp_comm_type, scale=self.scale, dropout_p=p,
                                              documents=bounds,
                                              **self._band_kwargs())[..., :v.shape[-1]]
        if self.band:
            return band_attention(q, k, v, self.window, self.softmax_offset, self.scale,
                                  bounds, p, dropout_seed(self.tracker, q.device) if p else 0)
        if bounds is not None:
            return per_document(self._attend, q, k, v, bounds)
        b, n, s, d = q.shape
        dv = v.shape[-1]
        if self.backend == "sdpa":
            if dv != d:  # MLA: one head size, or torch falls back to its s x s math kernel
                return self._attend(*equal_head_dims(q, k, v))[..., :dv]
            if p > 0 and self.tracker is not None:
                with self.tracker.fork(q.device):
                    out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                         scale=self.sdpa_scale)
            elif p > 0:
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                     scale=self.sdpa_scale)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                     scale=self.sdpa_scale)
        else:
            scores = torch.matmul(q.reshape(b * n, s, d), k.reshape(b * n, s, d).transpose(1, 2))
            probs = dropout(self._softmax(scores), p, True, self.tracker)
            out = torch.bmm(probs, v.reshape(b * n, s, dv)).view(b, n, s, dv)
        return out

    def _band_kwargs(self) -> Dict[str, Any]:
        """The window and sink of a band layer for the context-parallel call (none else)."""
        return dict(window=self.window, sink=self.softmax_offset) if self.band else {}

    def _softmax(self, scores: torch.Tensor) -> torch.Tensor:
        """The unfused causal softmax, as Megatron's FusedScaleMaskSoftmax: in fp32 (the
        fused kernels always; torch's softmax with --attention-softmax-in-fp32), else in the
        fp16/bf16 scores' own dtype; probabilities in the scores' dtype either way."""
        name = "scaled_upper_triang_masked_softmax"
        if self.softmax_in_fp32 or scores.dtype not in (torch.float16, torch.bfloat16) or \
                ops.chosen_backend(name, scores) != "torch":
            return ops.scaled_upper_triang_masked_softmax(scores, self.scale)
        s = scores.shape[-1]
        mask = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
        return torch.softmax((scores * self.scale).masked_fill(mask, float("-inf")), dim=-1)

    def forward_masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """Inference over a KV cache: q [s, b, n, d], k [b, g, t, d] and v [b, g, t, dv]
        (every cached slot), mask [b, 1, s, t] (True: may attend) -> [s, b, n*dv]. No
        dropout; torch's SDPA whichever backend is configured (same numbers within float
        rounding)."""
        if self.band:
            return cached_band_attention(q, k, v, mask, self.window, self.softmax_offset,
                                         self.scale)
        s, b, n, _ = q.shape
        if k.shape[1] != n:
            k = k.repeat_interleave(n // k.shape[1], dim=1)
            v = v.repeat_interleave(n // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k, v, attn_mask=mask,
                                             scale=self.sdpa_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, n * v.shape[-1])


def equal_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [b, n, s, d] with the smaller head size zero-padded to the larger (MLA's
    values are narrower than its queries and keys): the scores and the first dv output
    channels stay exact, as context parallelism's blocks need one head size."""
    d, dv = q.shape[-1], v.shape[-1]
    if d == dv:
        return q, k, v
    if dv < d:
        return q, k, F.pad(v, (0, d - dv))
    return F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d)), v
