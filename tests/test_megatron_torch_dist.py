"""Megatron-Core torch_dist checkpoints continue in gigatron with Megatron's own losses.

Megatron-Core (0.16.1) trains a tiny GPTModel (local spec: RoPE, SwiGLU, GQA 4/2, RMSNorm,
untied) on forked gloo CPU ranks with its own optimizer, scheduler and gradient clipping,
on the batches gigatron's --mock-data gives, saves after 2 iterations as Megatron-LM saves
torch_dist (tests/megatron_torch_dist_writer.py) and trains 2 more. gigatron converts the
checkpoint (`gigatron convert megatron-to-gigatron`), and

* its model's logits equal Megatron-Core's at the save (fp32, 1e-5);
* `pretrain_gpt.py --load` of the converted checkpoint (forked ranks, in process), and of
  Megatron's root itself (converted on the fly into its gigatron/ folder), resumes at
  iteration 2 with the consumed samples, lr schedule, Adam moments and step count Megatron
  saved, and its losses of iterations 3 and 4 equal Megatron-Core's own continuation
  (1e-5). Iteration 4's loss depends on the moments: started afresh (--no-load-optim) it
  differs from Megatron's by 1.3e-2 (measured at 1 rank; with the moments the losses are
  equal to the last bit), far beyond the tolerance;
* with --finetune it starts at iteration 1 on batch 0 with the loss of Megatron's logits.

Covered: 1 rank with the distributed optimizer in both its formats (`fully_reshardable`:
per parameter; `dp_reshardable`, Megatron-LM's default: its gradient buckets), tp 2 on 2
ranks with the non-distributed optimizer and with the distributed one's buckets (gigatron
continues at tp 2), dp 2 with the buckets sharded over dp, and a pp 2 save (GPT-style,
tied embeddings: logits equal Megatron-Core's pipelined forward; the buckets' fp32 mains
equal the weights after a step of zero gradients).
A bf16 save's fp32 mains are read from its two dtype buffers (no training: Megatron-Core's
bf16 model here keeps fp32 norms, unlike Megatron-LM's Float16Module, so its losses are not
gigatron's bf16 ones). Mixtures of experts (4 experts top-2, aux and z losses, a dense layer
among MoE ones) saved on 1 rank and at ep 2 with a shared expert continue on one rank with
Megatron-Core's logits and losses; their dp_reshardable buckets give the same state; a tp 2 x ep 2
save gives Megatron-Core's logits. Not covered:
training under pp (Megatron-Core's pipeline schedule on CPU ranks was not tried), bf16
continuation losses, fp16, training from a tp x ep MoE save (its logits are checked),
grouped-GEMM experts.
"""
import json
import os
import re

import pytest
import torch

from megatron_layout import megatron_args
from multirank import run_on_ranks

pytest.importorskip("megatron.core")

from gigatron.models.gpt import GPTModel  # noqa: E402
from gigatron.models.hf_common import ConversionError  # noqa: E402
from gigatron.models.megatron.args import config_from_megatron_args  # noqa: E402
from gigatron.training.checkpoint.convert import (load_model, megatron_to_gigatron,  # noqa: E402
                                                  model_flags)

SAVE_AFTER, ITERS, GBS = 2, 4, 2
RUN = ["--micro-batch-size", str(GBS), "--global-batch-size", str(GBS), "--mock-data",
       "--train-iters", str(ITERS), "--lr", "1e-3", "--min-lr", "0.0", "--lr-decay-style",
       "constant", "--weight-decay", "0.1", "--clip-grad", "1.0", "--eval-iters", "0",
       "--log-interval", "1", "--no-progress", "--num-workers", "0"]


def _batches(flags):
    """The first ITERS global batches of gigatron's --mock-data for these flags."""
    from gigatron.data.samplers import build_pretraining_data_loader
    from gigatron.training.config.arguments import build_run, build_settings, parse_flags
    from gigatron.training.run.builders import build_datasets

    run, tokenizer = build_run(build_settings(parse_flags(flags)), 1)
    loader = build_pretraining_data_loader(build_datasets(run, tokenizer)[0], 0, GBS, 0, 1,
                                           num_workers=0, seed=run.train.seed)
    return [batch for _, batch in zip(range(ITERS), loader)]


def _pretrain(rank, world, argv):
    from gigatron.training.run import pretrain

    return pretrain.main(argv)


def _losses(path):
    with open(path) as f:
        return {r["iteration"]: r["lm loss"] for r in map(json.loads, f) if r["type"] == "train"}


def _megatron_run(tmp_path, tp, distributed, saves, dp=1, **model):
    """Megatron-Core trains and saves; returns (gigatron's run flags, Megatron's result).
    With dp > 1 every dp rank trains on the whole batch: the averaged gradients, and so the
    losses, are the one-rank run's, while the distributed optimizer shards its state."""
    import megatron_torch_dist_writer

    args = megatron_args(tp=tp, **model)  # vocabulary: Megatron's padded 128 rows
    flags = model_flags(config_from_megatron_args(args)) + RUN
    batches = _batches(flags)
    results = run_on_ranks(megatron_torch_dist_writer.train_and_save, tp * dp, args, batches,
                           {str(tmp_path / name): kind for name, kind in saves.items()},
                           SAVE_AFTER, distributed, timeout=180)
    return flags, dict(results[0], tokens=batches[0]["tokens"])


def _continue_in_gigatron(tmp_path, flags, megatron, converted, world, extra=()):
    tokens = megatron["tokens"]
    config, state = load_model(converted)
    model = GPTModel(config)
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model.eval()(tokens)
    torch.testing.assert_close(logits, megatron["logits"].transpose(0, 1)
                               if megatron["logits"].shape[0] != tokens.shape[0]
                               else megatron["logits"], rtol=0, atol=1e-5)
    metrics = str(tmp_path / "metrics.jsonl")
    codes = run_on_ranks(_pretrain, world, flags + list(extra) + [
        "--load", converted, "--metrics-file", metrics], timeout=180)
    assert codes == [0] * world
    ours = _losses(metrics)
    assert sorted(ours) == list(range(SAVE_AFTER + 1, ITERS + 1))
    torch.testing.assert_close(torch.tensor([ours[i] for i in sorted(ours)]),
                               torch.tensor(megatron["losses"][SAVE_AFTER:]), rtol=0, atol=1e-5)


def test_one_rank_distributed_optimizer_checkpoint_continues_with_megatron_losses(tmp_path):
    flags, megatron = _megatron_run(tmp_path, 1, True, {"full": "fully_reshardable",
                                                        "buckets": "dp_reshardable"})
    converted = str(tmp_path / "gig")
    config = megatron_to_gigatron(str(tmp_path / "full"), converted)
    assert config.vocab_size == 128 and config.num_query_groups == 2
    _continue_in_gigatron(tmp_path, flags, megatron, converted, 1)

    # pretrain_gpt.py --load of Megatron's own root: converted on the fly, the same losses
    metrics = str(tmp_path / "direct.jsonl")
    assert run_on_ranks(_pretrain, 1, flags + ["--load", str(tmp_path / "full"),
                                               "--metrics-file", metrics]) == [0]
    direct = _losses(metrics)
    assert sorted(direct) == list(range(SAVE_AFTER + 1, ITERS + 1))
    # within the converted run's tolerance: gigatron's and Megatron's kernels sum in their own
    # orders (equal to the bit on the old mock data by luck; 1 ulp apart on Megatron-Core's)
    torch.testing.assert_close(torch.tensor([direct[i] for i in sorted(direct)]),
                               torch.tensor(megatron["losses"][SAVE_AFTER:]), rtol=0, atol=1e-5)
    # --finetune: Megatron's weights from iteration 0 on batch 0 (its loss from the logits)
    batch = _batches(flags)[0]
    expected = torch.nn.functional.cross_entropy(megatron["logits"].flatten(0, 1),
                                                 batch["labels"].flatten()).item()
    metrics = str(tmp_path / "finetune.jsonl")
    assert run_on_ranks(_pretrain, 1, flags + [
        "--load", str(tmp_path / "full"), "--finetune", "--train-iters", "1",
        "--metrics-file", metrics]) == [0]
    assert _losses(metrics) == pytest.approx({1: expected}, abs=1e-5)

    # Megatron's default format of the distributed optimizer: its gradient buckets
    buckets = str(tmp_path / "from_buckets")
    megatron_to_gigatron(str(tmp_path / "buckets"), buckets)
    (tmp_path / "metrics.jsonl").unlink()
    _continue_in_gigatron(tmp_path, flags, megatron, buckets, 1)
    megatron_to_gigatron(str(tmp_path / "buckets"), str(tmp_path / "weights"),
                         with_optimizer=False)
    _, weights = load_model(str(tmp_path / "weights"))
    _, full = load_model(converted)
    assert all(torch.equal(weights[k], full[k]) for k in full)


@pytest.mark.parametrize("tp, dp, distributed, sharding_type", [
    (2, 1, False, None), (2, 1, True, "dp_reshardable"), (1, 2, True, "dp_reshardable")],
    ids=["tp2_plain_optimizer", "tp2_distributed_optimizer_buckets",
         "dp2_distributed_optimizer_buckets"])
def test_two_rank_checkpoint_continues_with_megatron_losses(tmp_path, tp, dp, distributed,
                                                            sharding_type):
    """Saved on 2 ranks; gigatron continues at tp 2 (the tp saves) or on 1 rank."""
    flags, megatron = _megatron_run(tmp_path, tp, distributed, {"meg": sharding_type}, dp)
    converted = str(tmp_path / "gig")
    megatron_to_gigatron(str(tmp_path / "meg"), converted)
    _continue_in_gigatron(tmp_path, flags, megatron, converted, tp,
                          ["--tensor-model-parallel-size", str(tp)])


def test_megatron_checkpoint_names_what_it_refuses(tmp_path):
    from gigatron.models.megatron.torch_dist import read_torch_dist, unstack_layers

    stacked = {"decoder.layers.mlp.linear_fc2.weight": torch.arange(6.).view(3, 2),
               "output_layer.weight": torch.ones(1)}
    split = unstack_layers(stacked, 3)
    assert split["decoder.layers.2.mlp.linear_fc2.weight"].tolist() == [4., 5.]
    with pytest.raises(ConversionError, match="stacks 3 layers, the args say num_layers=4"):
        unstack_layers(stacked, 4)
    from gigatron.models.megatron.buckets import unflatten_buckets

    params = [("a", (3,)), ("b", (2, 2))]  # reversed: b at 0..4, a at 64..67 (64-aligned)
    flat = unflatten_buckets([torch.arange(67.)], params, "here")
    assert flat["a"].tolist() == [64., 65., 66.] and flat["b"].flatten().tolist() == [0, 1, 2, 3]
    assert unflatten_buckets([torch.arange(4.), torch.arange(3.)], params, "")["a"].tolist() \
        == [0., 1., 2.]  # a bucket ends where its last parameter ends
    with pytest.raises(ConversionError, match="fill 4 of bucket 0's 66 elements"):
        unflatten_buckets([torch.arange(66.)], params[1:], "here")
    with pytest.raises(ConversionError, match="no Megatron torch_dist checkpoint"):
        read_torch_dist(str(tmp_path))
    moe = megatron_args(**MOE, moe_latent_size=None, moe_router_force_load_balancing=False)
    assert config_from_megatron_args(moe).moe_aux_loss_coeff == 0.1  # Megatron's defaults
    # Megatron-Core's benchmark routing (random logits, RandomSTE) runs here too: kept
    forced = megatron_args(**MOE, moe_router_force_load_balancing=True)
    assert config_from_megatron_args(forced).moe_router_force_load_balancing is True
    for change, named in [(dict(moe_latent_size=8), "moe_latent_size=8 (experts in a latent"),
                          (dict(add_bias_linear=True), "add_bias_linear with num_experts")]:
        with pytest.raises(ConversionError, match=re.escape(named)):
            config_from_megatron_args(megatron_args(**MOE, **change))
    os.makedirs(tmp_path / "iter_0000001")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    (tmp_path / "iter_0000001" / "common.pt").write_bytes(b"not a pickle")
    (tmp_path / "iter_0000001" / ".metadata").write_bytes(b"")
    with pytest.raises(ConversionError, match="common.pt cannot be read"):
        read_torch_dist(str(tmp_path))


def test_use_checkpoint_args_takes_the_model_shape_from_each_format(tmp_path):
    """Megatron's rule: sizes given on the command line stay, the other shape flags are the
    checkpoint's even when given; the legacy torch format, torch_dist's common.pt and a
    gigatron checkpoint all answer."""
    import argparse

    from test_megatron_import import GPT_LIKE, _reference, _write_layout

    from gigatron.training.config.arguments import parse_flags

    args = megatron_args(tp=2, vocab_size=100, **GPT_LIKE)
    config, state = _reference(args)
    _write_layout(str(tmp_path / "torch"), args, state, config)
    torch_dist = tmp_path / "torch_dist" / "iter_0000003"
    torch_dist.mkdir(parents=True)
    torch.save({"args": argparse.Namespace(**{**vars(args), "ckpt_format": "torch_dist"}),
                "iteration": 3}, torch_dist / "common.pt")
    (torch_dist / ".metadata").write_bytes(b"")
    (tmp_path / "torch_dist" / "latest_checkpointed_iteration.txt").write_text("3")
    megatron_to_gigatron(str(tmp_path / "torch"), str(tmp_path / "gigatron"))
    expected = parse_flags(model_flags(config))
    for root in ("torch", "torch_dist", "gigatron"):
        flags = parse_flags(["--use-checkpoint-args", "--load", str(tmp_path / root),
                             "--num-layers", "2", "--normalization", "RMSNorm", "--swiglu"])
        assert flags.num_layers == 2, root  # a size given on the command line stays
        for dest in ("hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
                     "normalization", "swiglu", "position_embedding_type",
                     "untie_embeddings_and_output_weights", "disable_bias_linear",
                     "group_query_attention", "seq_length", "max_position_embeddings"):
            assert getattr(flags, dest) == getattr(expected, dest), (root, dest)
    assert parse_flags(["--use-checkpoint-args", "--load", str(tmp_path / "none")]) \
        .num_layers is None  # no checkpoint: the flags as given (Megatron)


def _exit_code_and_error(rank, world, argv):
    import contextlib
    import io

    from gigatron.training.run import pretrain

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = pretrain.main(argv)
    return code, err.getvalue()


def test_exit_on_missing_checkpoint_stops_instead_of_training_from_scratch(tmp_path):
    flags = model_flags(config_from_megatron_args(megatron_args())) + RUN + [
        "--load", str(tmp_path / "empty"), "--exit-on-missing-checkpoint"]
    [(code, err)] = run_on_ranks(_exit_code_and_error, 1, flags, timeout=120)
    assert code != 0 and "--exit-on-missing-checkpoint: no checkpoint in --load" in err


def test_pp2_gpt_checkpoint_imports_with_megatron_logits_and_its_optimizer_buckets(tmp_path):
    """A pipeline-parallel save (pp 2; GPT-style: LayerNorm with biases, learned positions,
    tied embeddings, whose last-stage copy is not a separate tensor but a parameter in a
    bucket of its own) reads as one model, and the fp32 mains cut out of each stage's
    dp_reshardable buckets are exactly the weights (a misplaced parameter would not be)."""
    import megatron_torch_dist_writer
    from test_megatron_import import GPT_LIKE, _gigatron_logits

    args = megatron_args(pp=2, **GPT_LIKE)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    results = run_on_ranks(megatron_torch_dist_writer.save_weights, 2, args,
                           str(tmp_path / "meg"), tokens, timeout=120)
    theirs = next(r for r in results if r is not None)
    from gigatron.models.megatron.torch_dist import read_torch_dist

    checkpoint = read_torch_dist(str(tmp_path / "meg"))
    assert checkpoint.iteration == 5
    # the distributed optimizer's buckets (not stepped): its fp32 mains are the weights
    masters = checkpoint.optimizer.masters
    assert masters.keys() == checkpoint.model.keys()
    assert all(torch.equal(masters[k], checkpoint.model[k]) for k in masters)
    ours = _gigatron_logits(checkpoint.config, checkpoint.model, tokens)
    torch.testing.assert_close(ours[..., :theirs.shape[-1]], theirs, rtol=0, atol=1e-5)


def test_bf16_checkpoint_reads_its_fp32_mains_from_each_dtype_buffer(tmp_path):
    """A bf16 model whose norms stay fp32 (Megatron-Core's torch norms built without
    Float16Module) has two gradient buffers, one per parameter dtype: the fp32 mains cut
    from them are the weights (bf16 ones exactly representable in fp32), in fp32."""
    import megatron_torch_dist_writer
    from gigatron.models.megatron.torch_dist import read_torch_dist

    args = megatron_args(params_dtype=torch.bfloat16, bf16=True)
    run_on_ranks(megatron_torch_dist_writer.save_weights, 1, args, str(tmp_path / "meg"),
                 torch.zeros(2, 16, dtype=torch.long), timeout=120)
    checkpoint = read_torch_dist(str(tmp_path / "meg"))
    model, masters = checkpoint.model, checkpoint.optimizer.masters
    assert {t.dtype for t in model.values()} == {torch.bfloat16, torch.float32}
    assert all(masters[k].dtype == torch.float32 and torch.equal(masters[k], model[k].float())
               for k in model)
    converted = str(tmp_path / "gig")
    megatron_to_gigatron(str(tmp_path / "meg"), converted)
    from gigatron.training.checkpoint.torch_dist.save_load import entries

    saved = entries(os.path.join(converted, "iter_0000005"))
    assert saved["optimizer.master.decoder.layers.0.mlp.linear_fc1.weight"].properties.dtype \
        == torch.float32


# 4 experts top-2 (Megatron-Core's SequentialMLP, allgather dispatcher), layer 1 dense, the
# aux and z losses on and large enough to show: continued with either coefficient 0,
# iteration 4's loss differs from Megatron's by 2e-4 (aux) / 1.7e-3 (z) (measured, 1 rank)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq=[1, 0, 1, 1],
           moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1,
           moe_z_loss_coeff=0.05, moe_token_dispatcher_type="allgather")


@pytest.mark.parametrize("ep, shared", [(1, None), (2, 16)], ids=["one_rank", "ep2_shared"])
def test_moe_checkpoint_continues_with_megatron_losses(tmp_path, ep, shared):
    """A mixture-of-experts save (on 1 rank, or ep 2 on 2 ranks with a shared expert: each
    rank its 2 experts, the router and the rest replicated) continues on one rank: logits at
    the save and the losses of iterations 3 and 4 equal Megatron-Core's."""
    saves = {"meg": "fully_reshardable", "buckets": "dp_reshardable"}
    flags, megatron = _megatron_run(tmp_path, 1, True, saves, ep, expert_model_parallel_size=ep,
                                    moe_shared_expert_intermediate_size=shared, **MOE)
    converted = str(tmp_path / "gig")
    config = megatron_to_gigatron(str(tmp_path / "meg"), converted)
    assert (config.num_moe_experts, config.moe_layer_freq, config.moe_z_loss_coeff) == \
        (4, [1, 0, 1, 1], 0.05)
    _, state = load_model(converted)
    assert state["decoder.layers.0.mlp.experts.weight1"].shape == (4, 32, 48)
    assert "decoder.layers.1.mlp.linear_fc1.weight" in state  # the dense layer
    assert ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight" in state) == bool(shared)
    _continue_in_gigatron(tmp_path, flags, megatron, converted, 1)
    # the distributed optimizer's buckets (at ep 2: a second, expert optimizer's, per ep
    # rank): the same weights, Adam moments and fp32 mains, exactly, as the per-parameter save
    from gigatron.models.megatron.torch_dist import read_torch_dist

    full, buckets = read_torch_dist(str(tmp_path / "meg")), read_torch_dist(
        str(tmp_path / "buckets"))
    assert buckets.optimizer.step == full.optimizer.step == SAVE_AFTER
    for name, ours in [("model", buckets.model), ("master", buckets.optimizer.masters),
                       *buckets.optimizer.per_element.items()]:
        theirs = full.model if name in ("model", "master") else \
            full.optimizer.per_element[name]
        assert ours.keys() == theirs.keys(), name
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name


def test_tp2_ep2_moe_checkpoint_gives_megatron_logits(tmp_path):
    """Saved on 4 ranks at tp 2 x ep 2 (expert tp 2: each expert's fc1 split [gate_r; up_r]
    over tp, a shared expert too; sigmoid routing with a random expert bias): the weights give
    Megatron-Core's logits (fp32, 1e-5) and the optimizer's buckets hold them as its fp32
    mains. Not trained: Megatron-Core trains MoE under tp only with sequence parallelism,
    which its torch norms (no Apex / transformer_engine here) refuse."""
    import megatron_torch_dist_writer
    from test_megatron_import import _gigatron_logits

    from gigatron.models.megatron.torch_dist import read_torch_dist

    args = megatron_args(tp=2, expert_model_parallel_size=2, **{
        **MOE, "moe_shared_expert_intermediate_size": 16, "moe_router_score_function":
        "sigmoid", "moe_router_enable_expert_bias": True})
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    results = run_on_ranks(megatron_torch_dist_writer.save_weights, 4, args,
                           str(tmp_path / "meg"), tokens, timeout=120)
    theirs = next(r for r in results if r is not None)
    checkpoint = read_torch_dist(str(tmp_path / "meg"))
    assert checkpoint.config.num_moe_experts == 4
    # dp_reshardable after a step of zero gradients: the fp32 mains cut from the dense and
    # the expert optimizer's buckets (per tp x ep rank) are the weights
    masters, model = checkpoint.optimizer.masters, checkpoint.model
    bias = "decoder.layers.0.mlp.router.expert_bias"  # a buffer: in no optimizer
    assert masters.keys() == model.keys() - {k for k in model if k.endswith("expert_bias")}
    assert all(torch.equal(masters[k], model[k]) for k in masters)
    assert model[bias].abs().min() > 0
    ours = _gigatron_logits(checkpoint.config, checkpoint.model, tokens)
    torch.testing.assert_close(ours[..., :theirs.shape[-1]], theirs, rtol=0, atol=1e-5)
