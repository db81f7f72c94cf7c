"""What multi-latent attention keeps for backward, per token and layer on one rank (bytes):
the planner's MLA term in `memory.activation_terms`' attention place, counted tensor by
tensor as models/mla/attention.py runs on one rank of a tp group without cp.

Kept: the query latent (its norm's input, normalised copy and output; or the down-
projection's output without --qk-layernorm), the key/value latent storage with the
positional key beside it (the norm reads a view of it) and its normalised output, the
query and the key SDPA reads (cat of the no-position and rotated channels, heads of this
rank), the values: zero-padded to the q/k head size when narrower (a copy) or a view of
the up-projection's output, and with the padding the padded SDPA output too (the projection
reads a sliced copy, which the layer's common terms count), and SDPA's log-sum-exp. The
latents are whole on every tp rank, also under sequence parallelism (not divided).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig
    from gigatron.training.plan.context import ContextLayout


def _latent(width: int, storage: int, w: int, norm: bool, on_gpu: bool, rms: bool) -> float:
    """A latent of `width` channels read from a storage of `storage` channels, through its
    norm (input, normalised copy on CPU, statistics) to the up-projection that keeps the
    output; without a norm the up-projection keeps the storage."""
    if not norm:
        return w * storage
    if on_gpu:
        return w * storage + 8 + w * width
    if rms:  # the fp32 input (the storage itself in fp32, a copy otherwise), normalised, rstd
        return (w * storage if w == 4 else 4 * width) + 4 * width + 4 + w * width
    return (w * storage if w == 4 else 4 * width) + 8 + w * width


def mla_attention_bytes(c: "TransformerConfig", w: int, tp: int,
                        on_gpu: bool) -> Tuple[float, float]:
    """(bytes per token MLA keeps between the layer's input norm and linear_proj's input,
    of which what selective recomputation keeps: the core attention's inputs, the values a
    view of the up-projection's output, and the latents)."""
    rms, norm = c.normalization == "RMSNorm", bool(c.qk_layernorm)
    heads = c.num_attention_heads / tp
    q_head = c.qk_head_dim + c.qk_pos_emb_head_dim
    query = 0.0 if c.q_lora_rank is None else \
        _latent(c.q_lora_rank, c.q_lora_rank, w, norm, on_gpu, rms)
    latent = _latent(c.kv_lora_rank, c.kv_lora_rank + c.qk_pos_emb_head_dim, w, norm, on_gpu,
                     rms)
    dv = c.v_head_dim
    kv_storage = w * heads * (c.qk_head_dim + dv)  # what a v view keeps
    if dv == q_head:  # SDPA's output is the projection's input (the common terms')
        q_and_k, values = 2 * w * heads * q_head, kv_storage
    elif dv < q_head:  # v padded (a copy), SDPA's padded output beside the sliced copy
        q_and_k, values = 2 * w * heads * q_head, 2 * w * heads * q_head
    else:  # q and k padded (copies), v a view, SDPA's output beside the projection's copy
        q_and_k, values = 2 * w * heads * dv, kv_storage + w * heads * dv
    inputs = query + latent + 2 * w * heads * q_head + kv_storage
    return query + latent + q_and_k + values + 4 * heads, inputs


def mla_context_bytes(c: "TransformerConfig", w: int, tp: int, on_gpu: bool,
                      layout: "ContextLayout") -> Tuple[float, float, float]:
    """(bytes per local token MLA keeps under context parallelism between the layer's input
    norm and linear_proj's input, of which selective recomputation keeps, bytes per layer
    and micro-batch): the latents as without cp, and the cp attention's own tensors
    (context.attention_held) at the one head size it runs, P = max(q/k head, v head):
    equal_head_dims pads v (or q and k) before the call, so the keys and values the blocks
    exchange and keep are P wide; p2p and all_gather keep one P-wide tensor more when the
    head sizes differ (the padded output beside linear_proj's sliced copy when the v head is
    narrower). The up-projections' outputs are read by cat / pad, which keep nothing.
    Selective recomputation keeps the core attention's inputs: the latents, q, k and the
    kv up-projection's output that v views (tests/test_plan_mla_mtp.py: exact)."""
    from gigatron.training.plan.context import attention_held

    rms, norm = c.normalization == "RMSNorm", bool(c.qk_layernorm)
    heads = c.num_attention_heads / tp
    q_head, dv = c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim
    width = max(q_head, dv)
    query = 0.0 if c.q_lora_rank is None else \
        _latent(c.q_lora_rank, c.q_lora_rank, w, norm, on_gpu, rms)
    latent = _latent(c.kv_lora_rank, c.kv_lora_rank + c.qk_pos_emb_head_dim, w, norm, on_gpu,
                     rms)
    held, constant = attention_held(layout, w * heads * width, w, heads * width,
                                    c.seq_length)
    # p2p / all_gather: one P-wide tensor more where the head sizes differ (the padded
    # output beside the sliced copy when v is narrower; as measured when it is wider)
    padded = w * heads * width if dv != q_head and \
        layout.comm_type in ("p2p", "all_gather") else 0.0
    inputs = query + latent + w * heads * (2 * q_head + c.qk_head_dim + dv)  # v: kv's view
    return query + latent + held + padded, inputs, constant
