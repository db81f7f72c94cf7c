"""The attention kinds on a GPU's fused kernels (issue 44): standard causal attention, MLA's
unequal head sizes, sliding windows, sink logits (off-by-one and learned) and packed
documents, alone and combined, run by CoreAttention on CUDA (flash for bf16, memory-efficient
for fp32, through SDPA or the band blocks of parallel/context/band.py) and compared with the
same module on the CPU in float32 (the band path accumulates in fp32 and takes no
float64): the output and the grads of q, k, v (and of a learned
sink) within relative L2 2e-2 for bf16 operands, 2e-3 for fp32. Fresh random inputs per
case; the output is checked finite. Skipped without CUDA (conftest.py)."""
import copy

import pytest
import torch

from gigatron.models.attention.core import CoreAttention
from gigatron.models.config import TransformerConfig

pytestmark = pytest.mark.cuda

SEQ, BATCH, HEADS = 256, 2, 8
DOCUMENTS = [(0, 100, 101, 200, 256), (0, 256)]  # per sample; a one-token document too
# name: (config overrides, query groups, q/k head size, v head size, documents)
KINDS = {
    "causal": ({}, 8, 64, 64, None),
    "gqa": ({}, 2, 64, 64, None),
    "mla": ({}, 8, 192, 128, None),  # DeepSeek's 128 + 64 rotated channels, values 128
    "window": (dict(window_size=(64, 0)), 2, 64, 64, None),
    "window-every-other-layer-full": (dict(window_size=(64, 0), window_attn_skip_freq=2),
                                      2, 64, 64, None),
    "sink-off-by-one": (dict(softmax_type="off-by-one"), 8, 64, 64, None),
    "sink-learnable": (dict(softmax_type="learnable"), 2, 64, 64, None),
    "documents": ({}, 2, 64, 64, DOCUMENTS),
    "documents-mla": ({}, 8, 192, 128, DOCUMENTS),
    "window-sink-documents": (dict(window_size=(32, 0), softmax_type="learnable"), 2, 64, 64,
                              DOCUMENTS),
}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 2e-3}
DEVICE = "cuda"


def _config(overrides, groups):
    return TransformerConfig(num_layers=2, hidden_size=HEADS * 64, num_attention_heads=HEADS,
                             num_query_groups=groups, vocab_size=64, seq_length=SEQ,
                             hidden_dropout=0.0, attention_dropout=0.0, **overrides)


def _run(core, q, k, v, grad_out, documents):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = core(*leaves, documents=documents)
    out.backward(grad_out)
    grads = [t.grad for t in leaves]
    if isinstance(core.softmax_offset, torch.nn.Parameter):
        grads.append(core.softmax_offset.grad)
    return [out.detach()] + grads


def _rel(got, want):
    return ((got.float().cpu() - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_attention_kind_on_cuda_matches_float32_on_the_cpu(kind, dtype):
    overrides, groups, d, dv, documents = KINDS[kind]
    config = _config(overrides, groups)
    reference = CoreAttention(config, None, layer_number=0,
                              softmax_scale=d ** -0.5 if d != 64 else None)
    if reference.softmax_offset is not None:
        with torch.no_grad():
            reference.softmax_offset.copy_(torch.randn(HEADS))
    core = copy.deepcopy(reference).to(DEVICE, dtype)
    q = torch.randn(SEQ, BATCH, HEADS, d, dtype=torch.float32)
    k = torch.randn(SEQ, BATCH, groups, d, dtype=torch.float32)
    v = torch.randn(SEQ, BATCH, groups, dv, dtype=torch.float32)
    grad_out = torch.randn(SEQ, BATCH, HEADS * dv, dtype=torch.float32)
    want = _run(reference, q, k, v, grad_out, documents)
    got = _run(core, *(t.to(DEVICE, dtype) for t in (q, k, v, grad_out)), documents)
    assert torch.isfinite(got[0]).all(), f"{kind}: non-finite output"
    names = ("out", "dq", "dk", "dv", "dsink")
    errors = {n: _rel(g, w) for n, g, w in zip(names, got, want)}
    assert max(errors.values()) < TOLERANCE[dtype], f"{kind} {dtype}: {errors}"


def test_band_layers_on_cuda_pick_the_fused_kernel_for_their_dtype():
    from gigatron.parallel.context.kernels import pick_kernel

    x = torch.empty(1, 1, 1, 8, device="cuda")
    assert pick_kernel(x.bfloat16()) == "flash"
    assert pick_kernel(x) == "efficient"
