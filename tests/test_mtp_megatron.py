"""Multi-token prediction equals Megatron-Core's own (megatron.core's MultiTokenPredictionBlock,
local spec, on the CPU): a tiny Megatron-Core GPTModel with two MTP depths
(mtp_loss_scaling_factor 0.3; RoPE, SwiGLU, GQA, RMSNorm, untied) is randomised and written
as Megatron-LM writes a torch checkpoint, gigatron imports it (the mtp.layers.N.* weights
under Megatron-Core's names), and on the same tokens, labels and loss mask (zeros inside):
the main per-token loss, each depth's logged loss (MTPLossLoggingHelper's tracker: the masked
mean over the mask rolled k places) and every parameter's gradient of the main masked mean
plus the MTP terms Megatron-Core back-propagates (MTPLossAutoScaler: factor / depths x each
depth's masked mean) agree within 1e-5 (fp32). A gigatron forward with the depths' inputs
unrolled (the main token's embedding) is far off, so the check sees the roll.
"""
from __future__ import annotations

import pytest
import torch

from megatron_layout import megatron_args
from multirank import run_on_ranks

pytest.importorskip("megatron.core")

DEPTHS, FACTOR = 2, 0.3


def _batch(vocab=100, b=2, s=16):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.ones(b, s)
    mask[0, 5:8] = 0
    mask[1, -2] = 0
    return tokens, labels, mask


def _megatron(rank, world, args, root, tokens, labels, mask, per_token=False):
    """Megatron-Core's model with MTP: its checkpoint, main per-token loss, tracked depth
    losses and the parameters' gradients (by Megatron-Core's names)."""
    import megatron_reference as ref
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                        get_gpt_mtp_block_spec)
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    ref.init_parallel(args)
    config = ref.core_config(args)
    config.mtp_num_layers, config.mtp_loss_scaling_factor = DEPTHS, FACTOR
    config.calculate_per_token_loss = per_token
    spec = get_gpt_layer_local_spec(normalization=args.normalization)
    model = GPTModel(config, spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings,
                     share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", rotary_base=args.rotary_base,
                     mtp_block_spec=get_gpt_mtp_block_spec(config, spec, False))
    ref.randomize([model], seed=7)
    ref.save_like_megatron(root, 10, args, [model])
    b, s = tokens.shape
    causal = torch.triu(torch.ones(s, s), diagonal=1).bool()[None, None]
    losses = model(tokens, torch.arange(s).expand(b, s), causal, labels=labels,
                   loss_mask=mask)
    masked = (losses * mask).sum()  # --calculate-per-token-loss: the step divides later
    (masked if per_token else masked / mask.sum()).backward()
    tracked = MTPLossLoggingHelper.tracker["values"].clone()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), tracked, grads


def _gigatron(root, tokens, labels, mask, per_token=False):
    from gigatron.models.gpt import GPTModel
    from gigatron.models.megatron.legacy import read_megatron
    from gigatron.models.pipeline_chunks import GPTMicroBatchStep

    config, state = read_megatron(root)
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (DEPTHS, FACTOR)
    model = GPTModel(config)
    model.load_state_dict(state, strict=True)
    out = model(input_ids=tokens, labels=labels)
    stage = GPTMicroBatchStep(per_token, True, FACTOR).loss(out, {"labels": labels,
                                                                   "loss_mask": mask})
    (stage.loss + sum(stage.aux_losses.values())).backward()
    return out.detach(), stage, model


@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per_token_loss"])
def test_mtp_matches_megatron_core_losses_and_gradients(tmp_path, per_token):
    """per_token_loss: Megatron-Core's calculate_per_token_loss (the MTP terms are masked
    sums x factor / depths, like the main loss divided by the step's tokens later)."""
    args = megatron_args(num_layers=2, mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=FACTOR)
    tokens, labels, mask = _batch()
    root = str(tmp_path / "meg")
    per_token_loss, tracked, grads = run_on_ranks(_megatron, 1, args, root, tokens, labels,
                                                  mask, per_token, timeout=240)[0]
    out, stage, model = _gigatron(root, tokens, labels, mask, per_token)
    torch.testing.assert_close(out[0], per_token_loss, rtol=0, atol=1e-5)
    ours = torch.stack([stage.aux_losses[f"mtp_{k} loss"] for k in range(1, DEPTHS + 1)])
    torch.testing.assert_close(ours.detach(), tracked, rtol=0, atol=1e-5)
    params = dict(model.named_parameters())
    assert {n for n in grads if n.startswith("mtp.")} == {n for n in params
                                                          if n.startswith("mtp.")}
    worst = 0.0
    for name, grad in grads.items():
        mine = params[name].grad
        assert mine is not None, name
        worst = max(worst, ((mine - grad).norm() / grad.norm().clamp(min=1e-30)).item())
        torch.testing.assert_close(mine, grad, rtol=1e-4, atol=1e-5, msg=name)
    print(f"max relative gradient error {worst:.2e} over {len(grads)} parameters")


def test_mtp_without_the_roll_would_differ(tmp_path):
    """The comparison above sees the roll: depth 1 on the unrolled tokens is another loss."""
    from gigatron.models.gpt import GPTModel
    from gigatron.models.mtp import block

    args = megatron_args(num_layers=2, mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=FACTOR)
    from gigatron.models.megatron.args import config_from_megatron_args

    model = GPTModel(config_from_megatron_args(args))
    tokens, labels, _ = _batch()
    rolled = model(input_ids=tokens, labels=labels)
    real = block.roll_left
    try:
        block.roll_left = lambda t: t
        unrolled = model(input_ids=tokens, labels=labels)
    finally:
        block.roll_left = real
    assert (rolled[1] - unrolled[1]).abs().max() > 1e-2
