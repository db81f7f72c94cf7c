"""Causal attention inside a band (a sliding window) with per-head sink logits, block by block.

A query at position i sees the keys at i - window .. i (Megatron-Core's `window_size
(window, 0)`; window None: every earlier key). Queries and keys come as chunks with their
global start positions; each (query chunk, key chunk) pair is classified by positions alone
(`pair_block`): skipped when the keys are all in the future or all older than the window,
attended whole or as a top-left causal square through the fused kernels (kernels.py), and
only the few pairs that straddle an edge of the band are trimmed to the rows and columns
that see something and masked (a block-sized mask, never a sequence x sequence one). The
partial outputs merge exactly by their log-sum-exps.

Documents packed in one sequence (data/documents.py) cut the chunks where a document starts
(`document_pieces`); only pieces of the same document are paired, so attention stays inside
each document with no mask beyond a band edge's, composing with the window and the sinks.

A sink (gpt-oss's learned logit per head, or off-by-one's fixed 0) is one more key whose
score is the sink and whose value is zero: it merges like a block of output 0 and
log-sum-exp `sink`. Given the merged output and log-sum-exp every block's backward is the
kernel's own; the sink's gradient is -sum_i p_sink(i) (dO_i . O_i).
"""
from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from gigatron.parallel.context import kernels
from gigatron.parallel.context.kernels import BlockContext

# a chunk of the sequence: (first local row, rows, global position of the first row)
Chunk = Tuple[int, int, int]
# (query rows, key rows, how): how is "full", "causal" or an additive mask [rows, cols]
Block = Tuple[slice, slice, Union[str, torch.Tensor]]
DEFAULT_BLOCK = 128


def pair_block(q_chunk: Chunk, k_chunk: Chunk, window: Optional[int],
               device: Optional[torch.device] = None) -> Optional[Block]:
    """The block of a query chunk against a key chunk under the causal band, None when no
    query of the chunk sees any of its keys."""
    (q_row, q_len, qa), (k_row, k_len, ka) = q_chunk, k_chunk
    qb, kb = qa + q_len, ka + k_len  # global ends (exclusive)
    far = window if window is not None else qb  # farther than any key can be
    # the rows that see a key of the chunk, and the keys some row sees
    row_lo, row_hi = max(qa, ka), min(qb, kb + far)
    col_lo, col_hi = max(ka, qa - far), min(kb, qb)
    if row_lo >= row_hi or col_lo >= col_hi:
        return None
    rows = slice(q_row + row_lo - qa, q_row + row_hi - qa)
    cols = slice(k_row + col_lo - ka, k_row + col_hi - ka)
    if col_hi - 1 <= row_lo and row_hi - 1 - col_lo <= far:
        return rows, cols, "full"
    if row_lo == col_lo and row_hi == col_hi and row_hi - 1 - row_lo <= far:
        return rows, cols, "causal"
    q_pos = torch.arange(row_lo, row_hi, device=device)[:, None]
    k_pos = torch.arange(col_lo, col_hi, device=device)[None, :]
    seen = (k_pos <= q_pos) & (q_pos - k_pos <= far)
    mask = torch.zeros(seen.shape, device=device).masked_fill(~seen, float("-inf"))
    return rows, cols, mask


def document_pieces(chunks: Sequence[Chunk], documents: Sequence[int]
                    ) -> List[Tuple[int, Chunk]]:
    """(document number, piece) of each chunk cut where a document starts; `documents`: the
    sequence's increasing boundaries in global positions, from 0 to its length."""
    pieces = []
    for row, rows, start in chunks:
        end, pos = start + rows, start
        doc = bisect_right(documents, start) - 1
        while pos < end:
            stop = min(end, documents[doc + 1])
            pieces.append((doc, (row + pos - start, stop - pos, pos)))
            pos, doc = stop, doc + 1
    return pieces


def plan_blocks(q_chunks: Sequence[Chunk], k_chunks: Sequence[Chunk], window: Optional[int],
                device: Optional[torch.device] = None,
                documents: Optional[Sequence[int]] = None) -> List[Block]:
    """Every block the query chunks attend among the key chunks (the rest is skipped);
    with `documents` (boundaries, see document_pieces) only within each document."""
    if documents is None:
        pairs = [(q, k) for q in q_chunks for k in k_chunks]
    else:
        keys: Dict[int, List[Chunk]] = defaultdict(list)
        for doc, piece in document_pieces(k_chunks, documents):
            keys[doc].append(piece)
        pairs = [(q, k) for doc, q in document_pieces(q_chunks, documents) for k in keys[doc]]
    blocks = [pair_block(q, k, window, device) for q, k in pairs]
    return [block for block in blocks if block is not None]


def sequence_chunks(length: int, window: Optional[int], start: int = 0) -> List[Chunk]:
    """One sequence cut into blocks about the window's size (one block without a window)."""
    size = length if window is None else min(length, max(window + 1, DEFAULT_BLOCK))
    return [(row, min(size, length - row), start + row) for row in range(0, length, size)]


def _repeat(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, heads, s, d = grad.shape
    return grad if heads == kv_heads else grad.view(b, kv_heads, heads // kv_heads, s, d).sum(2)


def _masked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float, keep: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """A block-sized masked block in plain torch (fp32): (output, log-sum-exp); `keep`: the
    dropout multiplier of its probabilities (0 or 1 / (1 - p))."""
    heads = q.shape[1]
    scores = torch.matmul(q.float(), _repeat(k, heads).float().transpose(-1, -2)) * scale + mask
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    if keep is not None:
        probs = probs * keep
    return torch.matmul(probs, _repeat(v, heads).float()), lse


def _masked_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor, scale: float,
                     keep: Optional[torch.Tensor] = None
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The masked block's share of (dq, dk, dv) given the merged output and log-sum-exp
    (`keep`: the forward's dropout multiplier)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kr, vr, go = _repeat(k, heads).float(), _repeat(v, heads).float(), grad_out.float()
    scores = torch.matmul(q.float(), kr.transpose(-1, -2)) * scale + mask
    probs = torch.exp(scores - lse[..., None])
    delta = (go * out.float()).sum(-1, keepdim=True)  # = sum_j P_ij dP_ij, dropout or not
    dprobs = torch.matmul(go, vr.transpose(-1, -2))
    kept = probs
    if keep is not None:
        dprobs, kept = dprobs * keep, probs * keep
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, kr)
    dk = torch.matmul(dscores.transpose(-1, -2), q.float())
    dv = torch.matmul(kept.transpose(-1, -2), go)
    return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    return t[:, :, rows]


def _with_dropout(blocks: Sequence[Block], dropout: Optional[Tuple[float, int]],
                  q: torch.Tensor) -> List[Tuple[Block, Optional[torch.Tensor]]]:
    """Each block with its dropout multiplier [b, h, rows, cols] (None without dropout);
    with dropout every block runs the plain-torch path with an explicit (block-sized) mask.
    The multipliers are drawn from (seed + block index), so the backward redraws them."""
    if dropout is None:
        return [(block, None) for block in blocks]
    p, seed = dropout
    out: List[Tuple[Block, Optional[torch.Tensor]]] = []
    for index, (rows, cols, how) in enumerate(blocks):
        shape = (rows.stop - rows.start, cols.stop - cols.start)
        if how == "causal":  # a square block on the diagonal: keys up to the query
            how = torch.full(shape, float("-inf"), device=q.device).triu(1)
        elif not isinstance(how, torch.Tensor):  # "full"
            how = torch.zeros(shape, device=q.device)
        gen = torch.Generator(device=q.device).manual_seed(seed + index)
        draw = torch.rand(q.shape[:2] + shape, generator=gen, device=q.device)
        out.append(((rows, cols, how), (draw >= p).float() / (1 - p)))
    return out


def band_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: Sequence[Block],
                 ctx: BlockContext, out: Optional[torch.Tensor] = None,
                 lse: Optional[torch.Tensor] = None,
                 dropout: Optional[Tuple[float, int]] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(output fp32, log-sum-exp) of q over the blocks of k, v, merged into `out`/`lse`
    when given (a ring's earlier steps); rows no block covers keep lse -inf. `dropout`:
    (p, seed) of attention dropout on the probabilities."""
    if out is None or lse is None:
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
    scale = ctx.scale if ctx.scale is not None else q.shape[-1] ** -0.5
    for (rows, cols, how), keep in _with_dropout(blocks, dropout, q):
        qb, kb, vb = _rows(q, rows), _rows(k, cols), _rows(v, cols)
        if isinstance(how, torch.Tensor):
            block_out, block_lse = _masked_forward(qb, kb, vb, how, scale, keep)
        else:
            block_out, block_lse = kernels.block_forward(qb, kb, vb, how == "causal", ctx)
        out[:, :, rows], lse[:, :, rows] = kernels.merge_partial(
            _rows(out, rows), _rows(lse, rows), block_out, block_lse)
    return out, lse


def band_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, blocks: Sequence[Block],
                  ctx: BlockContext, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                  dropout: Optional[Tuple[float, int]] = None) -> None:
    """Add the blocks' shares of the gradients into dq, dk, dv (fp32); `dropout`: the
    forward's (p, seed)."""
    scale = ctx.scale if ctx.scale is not None else q.shape[-1] ** -0.5
    for (rows, cols, how), keep in _with_dropout(blocks, dropout, q):
        args = (_rows(grad_out, rows), _rows(q, rows), _rows(k, cols), _rows(v, cols),
                _rows(out, rows), _rows(lse, rows))
        if isinstance(how, torch.Tensor):
            grads = _masked_backward(*args, how, scale, keep)
        else:
            grads = kernels.block_backward(*args, how == "causal", ctx)
        dq[:, :, rows] += grads[0]
        dk[:, :, cols] += grads[1]
        dv[:, :, cols] += grads[2]


def merge_sink(out: torch.Tensor, lse: torch.Tensor, sink: Optional[torch.Tensor]
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Add the sink key (score `sink` [heads], value 0) to a finished attention."""
    if sink is None:
        return out, lse
    sink_lse = sink.float()[None, :, None].expand_as(lse)
    merged = torch.logaddexp(lse, sink_lse)
    return out * torch.exp(lse - merged)[..., None], merged


def sink_grad(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              sink: torch.Tensor) -> torch.Tensor:
    """d loss / d sink [heads], from the final output and log-sum-exp (sink merged in)."""
    delta = (grad_out.float() * out.float()).sum(-1)
    p_sink = torch.exp(sink.float()[None, :, None] - lse)
    return -(p_sink * delta).sum((0, 2)).to(sink.dtype)


class BandAttention(torch.autograd.Function):
    """Attention of q [b, h, sq, d] over k, v [b, g, sk, d] on the blocks planned from their
    chunks, with an optional sink [h]; one device (context parallelism builds on the parts)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                sink: Optional[torch.Tensor], blocks: List[Block], scale: Optional[float],
                dropout: Optional[Tuple[float, int]] = None) -> torch.Tensor:
        block_ctx = BlockContext(kernels.pick_kernel(q), scale)
        out, lse = band_forward(q, k, v, blocks, block_ctx, dropout=dropout)
        out, lse = merge_sink(out, lse, sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.blocks, ctx.block_ctx, ctx.dropout = blocks, block_ctx, dropout
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor  # type: ignore[override]
                 ) -> Tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse, sink = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        band_backward(grad_out, q, k, v, out, lse, ctx.blocks, ctx.block_ctx, dq, dk, dv,
                      ctx.dropout)
        dsink = (sink_grad(grad_out, out, lse, sink)
                 if sink is not None and ctx.needs_input_grad[3] else None)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None, None, None


def band_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: Optional[int],
                   sink: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                   documents: Optional[Sequence[int]] = None, dropout_p: float = 0.0,
                   seed: int = 0) -> torch.Tensor:
    """Causal attention of q [b, h, s, d] over k, v [b, g, s, d] (one device) inside the
    band `window` (None: no window), with sink logits [h] (None: none), within each of the
    `documents` (boundaries, shared by the b sequences; None: one document); `dropout_p`:
    attention dropout drawn from `seed` (blocks of at most DEFAULT_BLOCK rows then)."""
    size = window if window is not None or not dropout_p else DEFAULT_BLOCK - 1
    chunks = sequence_chunks(q.shape[2], size)
    blocks = plan_blocks(chunks, chunks, window, q.device, documents)
    dropout = (dropout_p, seed) if dropout_p else None
    return BandAttention.apply(q, k, v, sink, blocks, scale, dropout)
