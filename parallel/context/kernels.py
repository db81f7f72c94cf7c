"""One attention block through torch's fused kernels, with the log-sum-exp they return.

Context parallelism attends the local queries to key/value blocks one at a time and merges
the partial outputs exactly: for two blocks with outputs o1, o2 and log-sum-exps l1, l2 of
the softmax denominators, the output over both is o1 e^(l1-l) + o2 e^(l2-l) with
l = log(e^l1 + e^l2). The backward of each block is the kernel's own backward given the
merged output and the merged log-sum-exp, which yields that block's exact share of the
gradients. Kernels: CPU `_scaled_dot_product_flash_attention_for_cpu` (any float dtype,
native GQA); CUDA `_scaled_dot_product_flash_attention` for fp16/bf16 and
`_scaled_dot_product_efficient_attention` otherwise (key/value heads repeated for GQA).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

import torch

aten = torch.ops.aten


@dataclass
class BlockContext:
    """What a block's backward needs from its forward besides tensors: the kernel used and
    its placeholders (random-number state, sequence offsets), shared by every block."""

    kernel: str
    scale: Optional[float]
    extras: Tuple[Any, ...] = field(default_factory=tuple)


def pick_kernel(q: torch.Tensor) -> str:
    """The fused kernel for q's device and dtype."""
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type == "cuda":
        return "flash" if q.dtype in (torch.float16, torch.bfloat16) else "efficient"
    raise ValueError(f"context-parallel attention: no fused attention kernel for device "
                     f"{q.device.type!r}; run on cpu or cuda")


def _repeat_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    groups = heads // k.shape[1]
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _sum_kv_grad(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, heads, s, d = grad.shape
    if heads == kv_heads:
        return grad
    return grad.view(b, kv_heads, heads // kv_heads, s, d).sum(2)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  ctx: BlockContext) -> Tuple[torch.Tensor, torch.Tensor]:
    """(output [b, h, sq, d], fp32 log-sum-exp [b, h, sq]) of q attending k, v; a causal
    block is square and masked top-left, as torch's is_causal."""
    if ctx.kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=ctx.scale)
        return out, lse.float()
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    if ctx.kernel == "flash":
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=ctx.scale)
        ctx.extras = (cum_q, cum_k, seed, offset)
    else:
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=ctx.scale)
        ctx.extras = (seed, offset)
    return out, lse[..., :q.shape[2]].float()


def block_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, ctx: BlockContext
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of (dq, dk, dv), given the merged output and log-sum-exp."""
    lse = lse.contiguous()
    if ctx.kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=ctx.scale)
    kv_heads = k.shape[1]
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    if ctx.kernel == "flash":
        cum_q, cum_k, seed, offset = ctx.extras
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal,
            seed, offset, scale=ctx.scale)
    else:
        seed, offset = ctx.extras
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False],
            causal, scale=ctx.scale)
    return dq, _sum_kv_grad(dk, kv_heads), _sum_kv_grad(dv, kv_heads)


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                  block_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax merge of two partial attentions over disjoint key sets (fp32)."""
    merged_lse = torch.logaddexp(lse, block_lse)
    merged = (out * torch.exp(lse - merged_lse).unsqueeze(-1)
              + block_out.float() * torch.exp(block_lse - merged_lse).unsqueeze(-1))
    return merged, merged_lse
