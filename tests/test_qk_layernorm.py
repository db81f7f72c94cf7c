"""--qk-layernorm (Megatron-Core's qk_layernorm, Qwen3's q_norm / k_norm): each head's query
and key normalised over its channels before RoPE, one weight per channel shared by the heads.

The attention equals a hand-written reference (RMSNorm and LayerNorm, zero-centred too,
values and every grad), tp2 with and without sequence parallelism equals one device (the
norms' grads are partial per rank, each rank holding its heads, so they are summed over tp),
and the flag reaches the model config. Importing Megatron-LM checkpoints with qk_layernorm
is checked against megatron-core in tests/test_megatron_import.py.
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multirank import run_on_ranks

from gigatron.models.gpt import GPTModel
from gigatron.models.transformer import SelfAttention, rotary_cos_sin
from gigatron.models.zoo import load_config
from gigatron.parallel.tensor import allreduce_sequence_parallel_grads, gather_full_parameter
from gigatron.training.config.arguments import parse_args

NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)


def _norm(x, weight, bias, config):
    """The config's norm over the last dim, written out."""
    w = weight + 1 if config.layernorm_zero_centered_gamma else weight
    if config.normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon) * w
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + config.layernorm_epsilon) * w + bias


def _rope(x, positions, config):
    """Rotate-half RoPE on x [s, b, n, d] written out."""
    d = x.shape[-1]
    inv_freq = config.rotary_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions[:, None].double() * inv_freq  # [s, d/2]
    cos, sin = angles.cos()[:, None, None, :].float(), angles.sin()[:, None, None, :].float()
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _reference_attention(attn, x, config):
    """SelfAttention's output from its weights: split each query group's heads, normalise q
    and k per head, RoPE, causal softmax attention, output projection."""
    s, b, _ = x.shape
    g, n, d = config.num_query_groups, config.num_attention_heads, config.kv_channels
    hpg = n // g
    qkv = (x @ attn.linear_qkv.weight.t()).view(s, b, g, hpg + 2, d)
    q = qkv[:, :, :, :hpg].reshape(s, b, n, d)
    k, v = qkv[:, :, :, hpg], qkv[:, :, :, hpg + 1]
    qn, kn = attn.q_layernorm, attn.k_layernorm
    q, k = _norm(q, qn.weight, qn.bias, config), _norm(k, kn.weight, kn.bias, config)
    positions = torch.arange(s)
    q, k = _rope(q, positions, config), _rope(k, positions, config)
    k, v = k.repeat_interleave(hpg, dim=2), v.repeat_interleave(hpg, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    out = torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, n * d)
    return out @ attn.linear_proj.weight.t()


@pytest.mark.parametrize("norm", [dict(normalization="RMSNorm"),
                                  dict(normalization="LayerNorm"),
                                  dict(normalization="RMSNorm",
                                       layernorm_zero_centered_gamma=True)],
                         ids=["rmsnorm", "layernorm", "zero_centred"])
def test_attention_with_qk_layernorm_equals_hand_reference(norm):
    config = load_config("debug-llama", qk_layernorm=True, kv_channels=8, layernorm_epsilon=1e-3,
                         **NO_DROPOUT, **norm)
    attn = SelfAttention(config, None, None)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "layernorm" in name else 0.5)
                    + (1.0 if "layernorm.weight" in name and not
                       config.layernorm_zero_centered_gamma else 0.0))
    assert attn.q_layernorm.weight.shape == (8,) and attn.k_layernorm.weight.shape == (8,)
    x = torch.randn(config.seq_length, 2, config.hidden_size, requires_grad=True)
    ours = attn(x, rotary_cos_sin(config.seq_length, config, None))
    cotangent = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, [x, *attn.parameters()], cotangent)
    ref = _reference_attention(attn, x, config)
    ref_grads = torch.autograd.grad(ref, [x, *attn.parameters()], cotangent)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for name, g, r in zip(["x"] + [n for n, _ in attn.named_parameters()], grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * r.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")
    # the norms matter: without them the output is another
    attn.q_layernorm = attn.k_layernorm = None
    assert not torch.allclose(attn(x, rotary_cos_sin(config.seq_length, config, None)), ours,
                              atol=1e-2)


def test_qk_layernorm_names_and_shapes_follow_megatron_core():
    dense = GPTModel(load_config("debug-llama", normalization="LayerNorm"))
    model = GPTModel(load_config("debug-llama", qk_layernorm=True, normalization="LayerNorm"))
    added = set(model.state_dict()) - set(dense.state_dict())
    d = model.config.kv_channels
    assert added == {f"decoder.layers.{i}.self_attention.{qk}_layernorm.{w}"
                     for i in range(2) for qk in "qk" for w in ("weight", "bias")}
    assert all(model.state_dict()[name].shape == (d,) for name in added)


def _tp_matches_one_device(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    for sp in (False, True):
        config = dict(qk_layernorm=True, **NO_DROPOUT)
        ref = GPTModel(load_config("debug-llama", **config))
        tp = GPTModel(load_config("debug-llama", sequence_parallel=sp, **config), tp_group=group)
        for model in (ref, tp):  # norm weights off 1 so that a wrong head's weight shows
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "q_layernorm" in name or "k_layernorm" in name:
                        p.copy_(1 + 0.5 * torch.randn(p.shape,
                                                      generator=torch.Generator().manual_seed(7)))
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 200, (2, 16), generator=g)
        labels = torch.randint(0, 200, (2, 16), generator=g)
        ref(ids, labels=labels).mean().backward()
        loss = tp(ids, labels=labels)
        loss.mean().backward()
        allreduce_sequence_parallel_grads(tp.parameters(), group)
        torch.testing.assert_close(loss, ref(ids, labels=labels), rtol=1e-5, atol=1e-7)
        ref_params = dict(ref.named_parameters())
        for name, p in tp.named_parameters():
            if "layernorm" in name and name.split(".")[-2] in ("q_layernorm", "k_layernorm"):
                assert p.sequence_parallel and not p.tensor_model_parallel, name
            full_g = gather_full_parameter(p, group, p.grad)
            rows = min(full_g.shape[0], ref_params[name].shape[0])
            torch.testing.assert_close(full_g[:rows], ref_params[name].grad[:rows], rtol=1e-5,
                                       atol=1e-7, msg=lambda m: f"sp={sp} grad {name}: {m}")
    return True


def test_tp2_with_qk_layernorm_matches_single_device():
    assert run_on_ranks(_tp_matches_one_device, 2) == [True, True]


def test_qk_layernorm_flag_reaches_the_model_config():
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --global-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data "
            "--vocab-size 100")
    assert parse_args((base + " --qk-layernorm").split(), 1).model.qk_layernorm
    assert not parse_args(base.split(), 1).model.qk_layernorm
    zoo = parse_args("--model qwen3-30b-a3b --num-layers 2 --micro-batch-size 1 --train-iters 1 "
                     "--lr 1e-4 --mock-data".split(), 1)
    assert zoo.model.qk_layernorm  # the zoo's value shows through the flag left out


def test_checkpoint_without_qk_norms_names_the_flag():
    from gigatron.training.checkpoint.shapes import check_global_shapes

    def shapes(**kw):
        return {k: tuple(v.shape) for k, v in
                GPTModel(load_config("debug-llama", **kw), device=torch.device("meta"))
                .state_dict().items()}

    with pytest.raises(ValueError) as err:
        check_global_shapes(shapes(), shapes(qk_layernorm=True), {"qk_layernorm": None},
                            {"qk_layernorm": True}, "ckpt")
    message = str(err.value)
    assert "self_attention.q_layernorm.weight is missing from the checkpoint" in message
    assert "decided by --qk-layernorm" in message and "\n" not in message
    with pytest.raises(ValueError, match=r"q_layernorm.weight has shape \(4,\) in the "
                                         r"checkpoint but \(8,\).*--kv-channels"):
        check_global_shapes(shapes(qk_layernorm=True, kv_channels=4),
                            shapes(qk_layernorm=True, kv_channels=8), {}, {}, "ckpt")


def _train_losses(rank, world, argv, metrics):
    from test_generation_cli import _command

    code, out, err = _command(rank, world, "cli.pretrain", argv + ["--metrics-file", metrics])
    assert code == 0, err[-3000:]
    return True


@pytest.mark.parametrize("extra", [[], ["--sequence-parallel"]], ids=["tp2", "tp2_sp"])
def test_pretraining_with_qk_layernorm_at_tp2_logs_one_device_losses(tmp_path, extra):
    """The trainer's grad sync sums the q/k norms' grads over tp (ZeRO's sequence-parallel
    kind): without it the replicas drift apart and the losses leave one device's."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --mock-data --vocab-size 100 "
            "--hidden-dropout 0 --attention-dropout 0 --train-iters 6 --eval-iters 0 "
            "--log-interval 1 --no-progress --position-embedding-type rope --normalization "
            "RMSNorm --swiglu --disable-bias-linear --group-query-attention "
            "--num-query-groups 2 --qk-layernorm").split()
    losses = []
    for world, flags in ((1, []), (2, ["--tensor-model-parallel-size", "2", *extra])):
        metrics = str(tmp_path / f"metrics{world}.jsonl")
        run_on_ranks(_train_losses, world, argv + flags, metrics)
        with open(metrics) as f:
            losses.append([r["lm loss"] for r in map(json.loads, f) if r["type"] == "train"])
    assert len(losses[0]) == 6 and losses[0][-1] < losses[0][0]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
