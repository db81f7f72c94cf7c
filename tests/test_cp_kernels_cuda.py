"""Context parallelism's block kernels (parallel/context/kernels.py) on each device's fused
attention: the second half of a causal sequence attends the first half (a full block) and
itself (the causal diagonal block) one block at a time; merged by log-sum-exp, the output and
the gradients of q, k, v equal one causal attention over the whole sequence.

The CPU case runs everywhere (the flash kernel for CPU); the CUDA cases (flash for fp16/bf16,
memory-efficient for fp32, GQA by repeated key/value heads) run on the device machine
(`pytest -m cuda`). Tolerances: 2e-5 in fp32, 2e-2 in fp16/bf16 (relative to the largest
value), measured against torch's own scaled_dot_product_attention on the same device.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gigatron.parallel.context.kernels import (BlockContext, block_backward, block_forward,
                                               merge_partial, pick_kernel)

CASES = [("cpu", torch.float32, 4, 4), ("cpu", torch.float32, 4, 2)] + [
    pytest.param("cuda", dtype, 4, kv_heads, marks=pytest.mark.cuda)
    for dtype in (torch.float32, torch.float16, torch.bfloat16) for kv_heads in (4, 2)]


def _blockwise(q, k, v, grad):
    """Output and (dq, dk, dv) of the second half of the rows, computed block by block."""
    half = q.shape[2] // 2
    q2 = q[:, :, half:]
    blocks = [(slice(0, half), False), (slice(half, 2 * half), True)]
    ctx = BlockContext(pick_kernel(q2), None)
    out = lse = None
    saved = []
    for cols, causal in blocks:
        block_ctx = BlockContext(ctx.kernel, None)
        o, l = block_forward(q2, k[:, :, cols], v[:, :, cols], causal, block_ctx)
        saved.append(block_ctx)
        out, lse = (o.float(), l) if out is None else merge_partial(out, lse, o, l)
    out = out.to(q.dtype)
    dq = torch.zeros_like(q2, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    for (cols, causal), block_ctx in zip(blocks, saved):
        gq, gk, gv = block_backward(grad, q2, k[:, :, cols], v[:, :, cols], out, lse, causal,
                                    block_ctx)
        dq += gq.float()
        dk[:, :, cols] += gk.float()
        dv[:, :, cols] += gv.float()
    return out, dq, dk, dv


def _close(got, want, tol):
    scale = want.float().abs().max().clamp(min=1e-6)
    return ((got.float() - want.float()).abs().max() / scale).item() <= tol


@pytest.mark.parametrize("device,dtype,heads,kv_heads", CASES)
def test_blocks_merged_by_lse_equal_one_causal_attention(device, dtype, heads, kv_heads):
    torch.manual_seed(0)
    b, s, d = 2, 128, 64
    q = torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, kv_heads, s, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(b, kv_heads, s, d, device=device, dtype=dtype, requires_grad=True)
    groups = heads // kv_heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                         v.repeat_interleave(groups, 1), is_causal=True)
    grad = torch.randn_like(ref[:, :, s // 2:])
    ref[:, :, s // 2:].backward(grad)
    with torch.no_grad():
        out, dq, dk, dv = _blockwise(q.detach(), k.detach(), v.detach(), grad.contiguous())
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert _close(out, ref[:, :, s // 2:], tol)
    assert _close(dq, q.grad[:, :, s // 2:], tol)
    assert _close(dk, k.grad, tol) and _close(dv, v.grad, tol)
