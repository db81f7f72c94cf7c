"""Band attention (sliding windows, sink logits: parallel/context/band.py) equals the dense
masked softmax it stands for, on one device and over a context-parallel split.

Reference: the full [s, s] scores masked to i - window <= j <= i, with the sink as one more
column (softmax over [scores, sink], the sink column dropped), which is gpt-oss's and
Megatron-Core's definition. Checked in fp32 within 2e-5: outputs and the grads of q, k, v
and the sinks, for windows 0 (itself only), 5, 20 and none, block sizes that split the
window's edges differently, MHA and GQA. The planner is checked without tensors: key chunks
wholly outside a query chunk's window are skipped (not masked), and masks stay block-sized.
Over cp 2 (p2p, all_gather, a2a) on forked gloo ranks the local outputs and grads, put back
in global order, equal one device, and the ranks' sink grads sum to the one-device grad.
Megatron-Core's own unfused softmax (window_size, SoftmaxOne's sink) gives the same output.
"""
import pytest
import torch

from gigatron.parallel.context import band
from gigatron.parallel.context.attention import context_parallel_attention
from gigatron.parallel.context.split import restore_sequence, split_for_rank
from multirank import run_on_ranks

B, H, S, D = 2, 4, 32, 8


def dense_reference(q, k, v, window, sink, scale):
    """softmax over the masked scores and the sink column, as gpt-oss writes it."""
    heads, s = q.shape[1], q.shape[2]
    k, v = (t.repeat_interleave(heads // t.shape[1], 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    seen = (j <= i) & ((i - j <= window) if window is not None else True)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink[None, :, None, None].expand(*scores.shape[:3], 1)], -1)
    probs = scores.softmax(-1)
    return (probs[..., :s] if sink is not None else probs) @ v


def inputs(kv_heads, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=gen)
    k = torch.randn(B, kv_heads, S, D, generator=gen)
    v = torch.randn(B, kv_heads, S, D, generator=gen)
    sink = torch.randn(H, generator=gen)
    return q, k, v, sink, torch.randn(B, H, S, D, generator=gen)


def _grads(fn, q, k, v, sink, grad_out):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = None if sink is None else sink.clone().requires_grad_()
    out = fn(*leaves, s)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves] + ([s.grad] if s is not None else [])


def _assert_close(got, want, what):
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsink"), got, want):
        err = (g - w).abs().max().item()
        assert err < 2e-5, f"{what}: {name} differs by {err:.2e}"


@pytest.mark.parametrize("window", [None, 0, 5, 20])
@pytest.mark.parametrize("block", [7, 128])
def test_band_attention_equals_dense_masked_softmax(window, block, monkeypatch):
    monkeypatch.setattr(band, "DEFAULT_BLOCK", block)
    for kv_heads, use_sink in ((H, True), (H // 2, True), (H // 2, False)):
        q, k, v, sink, grad_out = inputs(kv_heads)
        sink = sink if use_sink else None
        got = _grads(lambda q, k, v, s: band.band_attention(q, k, v, window, s, 0.3),
                     q, k, v, sink, grad_out)
        want = _grads(lambda q, k, v, s: dense_reference(q, k, v, window, s, 0.3),
                      q, k, v, sink, grad_out)
        _assert_close(got, want, f"window {window} block {block} kv {kv_heads}")


def test_blocks_outside_the_window_are_skipped_and_masks_stay_block_sized():
    chunks = band.sequence_chunks(4096, 127)
    blocks = band.plan_blocks(chunks, chunks, 127)
    assert len(chunks) == 32 and len(blocks) == 2 * 32 - 1  # the diagonal and the one before
    for rows, cols, how in blocks:
        assert cols.start >= rows.start - 127 and cols.stop <= rows.stop
        if isinstance(how, torch.Tensor):
            assert how.shape == (rows.stop - rows.start, cols.stop - cols.start)
            assert how.numel() <= 128 * 128
    # no window: one causal block
    assert [how for _, _, how in band.plan_blocks(*[band.sequence_chunks(64, None)] * 2,
                                                  None)] == ["causal"]
    # a key chunk wholly older than the window, or wholly in the future: no block
    assert band.pair_block((0, 8, 100), (0, 8, 80), 10) is None
    assert band.pair_block((0, 8, 100), (0, 8, 108), 10) is None
    assert band.pair_block((0, 8, 100), (0, 8, 92), 15)[2] == "full"


def _cp_band(rank, cp, cases):
    results = {}
    for comm_type, kv_heads, window in cases:
        q, k, v, sink, grad_out = inputs(kv_heads)
        q, k, v, grad_out = (split_for_rank(t, cp, rank, seq_dim=2) for t in (q, k, v, grad_out))
        results[comm_type, kv_heads, window] = _grads(
            lambda q, k, v, s: context_parallel_attention(q, k, v, None, comm_type, scale=0.3,
                                                          window=window, sink=s),
            q, k, v, sink, grad_out)
    return results


def test_context_parallel_band_attention_equals_one_device():
    cases = [(c, kv, w) for c in ("p2p", "all_gather", "a2a") for kv, w in
             ((H, 5), (H // 2, 11), (H // 2, None))]
    per_rank = run_on_ranks(_cp_band, 2, cases)
    for case in cases:
        got = [restore_sequence([r[case][i] for r in per_rank], seq_dim=2) for i in range(4)]
        got.append(sum(r[case][4] for r in per_rank))
        q, k, v, sink, grad_out = inputs(case[1])
        want = _grads(lambda q, k, v, s: dense_reference(q, k, v, case[2], s, 0.3),
                      q, k, v, sink, grad_out)
        _assert_close(got, want, f"cp2 {case}")


@pytest.mark.parametrize("window, softmax_type", [(5, "learnable"), (0, "off-by-one"),
                                                  (None, "learnable")])
def test_band_attention_equals_megatron_core_scale_mask_softmax(window, softmax_type,
                                                                monkeypatch):
    """Megatron-Core 0.16.1's own unfused path (FusedScaleMaskSoftmax's torch softmax with
    window_size (window, 0), its causal mask and SoftmaxOne's sink) gives the same output:
    the window and sink semantics are Megatron's. Its masks are built on "cuda"; here on
    the CPU (the one change)."""
    import warnings
    from types import SimpleNamespace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Apex / Transformer Engine missing
        from megatron.core.fusions import fused_softmax
        from megatron.core.transformer import utils
        from megatron.core.transformer.enums import AttnMaskType

    real = torch
    cpu_torch = SimpleNamespace(**{n: getattr(real, n) for n in dir(real)
                                   if not n.startswith("__")})
    cpu_torch.ones = lambda *a, **k: real.ones(*a, **{**k, "device": "cpu"})
    monkeypatch.setattr(utils, "torch", cpu_torch)
    softmax = fused_softmax.FusedScaleMaskSoftmax(
        input_in_fp16=False, input_in_bf16=False, attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False, mask_func=utils.attention_mask_func,
        softmax_in_fp32=True, scale=None,
        window_size=None if window is None else (window, 0))
    q, k, v, sink, _ = inputs(H)
    sink = sink if softmax_type == "learnable" else torch.zeros(H)
    probs = softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.3, None, sink)
    want = torch.matmul(probs, v)
    got = band.band_attention(q, k, v, window, sink, 0.3)
    assert (got - want).abs().max() < 2e-5


@pytest.mark.parametrize("window", [5, None])
def test_band_attention_dropout_equals_dense_dropout_with_the_same_masks(window, monkeypatch):
    """Attention dropout (Megatron's default 0.1 applies to window/sink layers too): each
    block's multiplier, redrawn from (seed + block index) in the backward, placed into a
    dense [s, s] one, gives the dense softmax's dropout output and grads (q, k, v, sinks)."""
    monkeypatch.setattr(band, "DEFAULT_BLOCK", 7)
    q, k, v, sink, grad_out = inputs(H // 2)
    size = window if window is not None else band.DEFAULT_BLOCK - 1
    chunks = band.sequence_chunks(S, size)
    dense_keep = torch.zeros(B, H, S, S)
    for (rows, cols, _), keep in band._with_dropout(band.plan_blocks(chunks, chunks, window),
                                                   (0.3, 11), q):
        dense_keep[:, :, rows, cols] = keep

    def reference(q, k, v, s):
        heads = q.shape[1]
        kr, vr = (t.repeat_interleave(heads // t.shape[1], 1) for t in (k, v))
        scores = (q @ kr.transpose(-1, -2)) * 0.3
        i, j = torch.arange(S)[:, None], torch.arange(S)[None]
        seen = (j <= i) & ((i - j <= window) if window is not None else True)
        scores = torch.cat([scores.masked_fill(~seen, float("-inf")),
                            s[None, :, None, None].expand(B, heads, S, 1)], -1)
        return (scores.softmax(-1)[..., :S] * dense_keep) @ vr

    got = _grads(lambda q, k, v, s: band.band_attention(q, k, v, window, s, 0.3,
                                                        dropout_p=0.3, seed=11),
                 q, k, v, sink, grad_out)
    want = _grads(reference, q, k, v, sink, grad_out)
    _assert_close(got, want, f"dropout window {window}")
    no_dropout = band.band_attention(q, k, v, window, sink, 0.3)
    assert (got[0] - no_dropout).abs().max() > 0.1  # it does drop


def test_off_by_one_layer_builds_with_a_zero_sink_buffer_and_attends_as_band():
    """--softmax-type off-by-one: CoreAttention holds the fixed 0 sink as a non-persistent
    buffer (it raised KeyError, the attribute set before the buffer was registered) and its
    output is band attention with a zero sink."""
    from gigatron.models.attention.core import CoreAttention
    from gigatron.models.config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H * D, num_attention_heads=H,
                               vocab_size=8, seq_length=S, softmax_type="off-by-one",
                               attention_dropout=0.0)
    core = CoreAttention(config, None)
    assert core.band and torch.equal(core.softmax_offset, torch.zeros(H))
    assert "softmax_offset" not in core.state_dict()
    q, k, v, _, _ = inputs(H)
    got = core(*(t.permute(2, 0, 1, 3) for t in (q, k, v)))  # [s, b, n, d] in
    want = dense_reference(q, k, v, None, torch.zeros(H), D ** -0.5)
    assert (got - want.permute(2, 0, 1, 3).reshape(S, B, H * D)).abs().max() < 2e-5
