"""The MoE layer in the model: equal to a hand-written reference and to Hugging Face's Mixtral
block, Megatron-Core's balancing losses, placement by moe_layer_freq, recompute, tensor
parallelism around it, the trainer's hooks (models/moe/stats.py) and config problems."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.models.moe.layer import MoELayer
from gigatron.models.moe.router import updated_expert_bias
from gigatron.models.moe.stats import moe_layers, take_moe_stats, update_expert_biases
from multirank import run_on_ranks

VOCAB, SEQ, BATCH = 64, 8, 3
TOL = dict(atol=1e-5, rtol=1e-5)


def _config(**overrides: Any) -> TransformerConfig:
    """A tiny fp32 Llama-style MoE model without dropout."""
    fields: Dict[str, Any] = dict(
        num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
        vocab_size=VOCAB, seq_length=SEQ, ffn_hidden_size=24, position_embedding_type="rope",
        normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8,
        moe_shared_expert_intermediate_size=12, moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model: GPTModel, ids: torch.Tensor) -> tuple[torch.Tensor, Dict[str, torch.Tensor],
                                                              Dict[str, torch.Tensor]]:
    """LM loss + layer losses, back-propagated: (total, layer losses, grads by name)."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).mean()
    layer_losses = model.layer_losses.take()
    total = loss + sum(layer_losses.values())
    total.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return total.detach(), {k: v.detach() for k, v in layer_losses.items()}, grads


def _reference_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Softmax-after-top-k routing, each token's experts one by one, the shared expert, and
    the switch / z losses written out: no permutation, no code of the layer."""
    s, b, h = x.shape
    tokens = x.reshape(s * b, h)
    logits = tokens @ layer.router.weight.t()
    if layer.router.bias is not None:
        logits = logits + layer.router.bias
    topk = layer.router.config.topk
    top = logits.topk(topk, dim=-1)
    weights = torch.softmax(top.values, dim=-1)
    w1, w2 = layer.experts.weight1, layer.experts.weight2
    rows = []
    for t in range(s * b):
        total = torch.zeros(h)
        for j in range(topk):
            e = int(top.indices[t, j])
            b1, b2 = (0, 0) if layer.experts.bias1 is None else \
                (layer.experts.bias1[e], layer.experts.bias2[e])  # type: ignore[index]
            gate, up = (tokens[t] @ w1[e] + b1).chunk(2)
            total = total + weights[t, j] * ((F.silu(gate) * up) @ w2[e] + b2)
        rows.append(total)
    out = torch.stack(rows)
    shared = layer.shared_experts
    if shared is not None:
        gate, up = (tokens @ shared.linear_fc1.weight.t()).chunk(2, dim=-1)
        out = out + (F.silu(gate) * up) @ shared.linear_fc2.weight.t()
    # Switch Transformer: coeff * E * sum_i (share of choices of i) * (mean softmax score of i)
    experts, num_tokens = logits.shape[1], s * b
    scores = torch.softmax(logits, dim=-1)
    chosen = torch.zeros_like(logits).scatter(1, scores.topk(topk, dim=-1).indices, 1.0)
    share = chosen.sum(0) / (num_tokens * topk)
    layer.layer_losses.add("load_balancing_loss",
                           0.01 * experts * (share * scores.mean(0)).sum())
    layer.layer_losses.add("z_loss", 0.001 * torch.logsumexp(logits, -1).square().mean())
    return out.view(s, b, h)


def test_moe_model_equals_hand_written_reference_output_and_every_grad() -> None:
    model = GPTModel(_config(), seed=3)
    ids = _batch()
    total, losses, grads = _loss_and_grads(model, ids)
    for layer in moe_layers([model]):
        layer.forward = (lambda x, layer=layer: _reference_moe(layer, x))  # type: ignore
    ref_total, ref_losses, ref_grads = _loss_and_grads(model, ids)
    assert set(losses) == {"load_balancing_loss", "z_loss"} == set(ref_losses)
    for name in losses:
        torch.testing.assert_close(losses[name], ref_losses[name], **TOL)
    torch.testing.assert_close(total, ref_total, **TOL)
    assert set(grads) == set(ref_grads) and any("experts.weight1" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=name)


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_expert_biases_equal_hand_written_reference_output_and_every_grad(grouped: bool) -> None:
    """--add-bias-linear (Megatron's default) with experts: a router bias and per-expert fc1
    and fc2 biases, the fc2 bias weighted by the router probability (Megatron-Core's
    TEGroupedMLP / SequentialMLP)."""
    model = GPTModel(_config(add_bias_linear=True, moe_shared_expert_intermediate_size=None,
                             moe_grouped_gemm=grouped), seed=3)
    with torch.no_grad():  # the expert biases start at zero: make them count
        for name, param in model.named_parameters():
            if ".experts.bias" in name:
                param.normal_(generator=torch.Generator().manual_seed(len(name)))
    ids = _batch()
    total, _, grads = _loss_and_grads(model, ids)
    for layer in moe_layers([model]):
        layer.forward = (lambda x, layer=layer: _reference_moe(layer, x))  # type: ignore
    ref_total, _, ref_grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(total, ref_total, **TOL)
    for name in ("router.bias", "experts.bias1", "experts.bias2"):
        assert any(n.endswith(name) for n in grads), name
    assert set(grads) == set(ref_grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=name)
    # stacked [E, n] but biases: no weight decay, as Megatron-Core's 1-D bias per expert
    from gigatron.parallel.zero.param_groups import megatron_param_groups

    decayed = {id(p) for g in megatron_param_groups([model], 0.1) if g["weight_decay"]
               for p in g["params"]}
    biases = [p for n, p in model.named_parameters() if ".experts.bias" in n]
    assert biases and not any(id(p) in decayed for p in biases)


def test_state_dict_names_are_the_agreed_ones() -> None:
    model = GPTModel(_config(moe_router_score_function="sigmoid",
                             moe_router_enable_expert_bias=True), seed=0)
    keys = set(model.state_dict())
    for suffix, shape in (("router.weight", (4, 16)), ("router.expert_bias", (4,)),
                          ("experts.weight1", (4, 16, 16)), ("experts.weight2", (4, 8, 16)),
                          ("shared_experts.linear_fc1.weight", (24, 16)),
                          ("shared_experts.linear_fc2.weight", (16, 12))):
        name = f"decoder.layers.1.mlp.{suffix}"
        assert name in keys and tuple(model.state_dict()[name].shape) == shape, name
    assert not any("stats_" in k or "bias_tokens" in k for k in keys)


def _mixtral_config_and_block(grouped: bool, seed: int = 0):
    """A tiny random HF MixtralSparseMoeBlock and the matching MoE config."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    hf = MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=8,
                       num_experts_per_tok=2, hidden_act="silu", router_jitter_noise=0.0)
    hf._experts_implementation = "eager"
    torch.manual_seed(seed)
    block = MixtralSparseMoeBlock(hf).eval()
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.2)
    config = _config(num_moe_experts=8, moe_ffn_hidden_size=32,
                     moe_shared_expert_intermediate_size=None, moe_aux_loss_coeff=0.0,
                     moe_z_loss_coeff=None, moe_grouped_gemm=grouped)
    return config, block


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_mixtral_layer_equals_hf_mixtral_sparse_moe_block(grouped: bool) -> None:
    config, block = _mixtral_config_and_block(grouped)
    layer = MoELayer(config)
    assert layer.experts.uses_grouped_mm(torch.zeros(1, 16)) == grouped
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.experts.weight1.copy_(block.experts.gate_up_proj.transpose(1, 2))
        layer.experts.weight2.copy_(block.experts.down_proj.transpose(1, 2))
    x = torch.randn(SEQ, BATCH, 16)
    expected = block(x.transpose(0, 1).contiguous()).transpose(0, 1)
    torch.testing.assert_close(layer(x), expected, **TOL)


def test_grouped_gemm_and_loop_give_the_same_loss_and_grads() -> None:
    ids = _batch(1)
    loop = GPTModel(_config(moe_ffn_hidden_size=16), seed=5)
    grouped = GPTModel(_config(moe_ffn_hidden_size=16, moe_grouped_gemm=True), seed=5)
    experts = moe_layers([grouped])[0].experts
    assert experts.uses_grouped_mm(torch.zeros(1, 16)), "the grouped path must really run"
    a, _, grads_a = _loss_and_grads(loop, ids)
    b, _, grads_b = _loss_and_grads(grouped, ids)
    torch.testing.assert_close(a, b, **TOL)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], **TOL, msg=name)


def test_moe_loss_differs_from_the_dense_model() -> None:
    ids = _batch(2)
    dense = GPTModel(_config(num_moe_experts=None, moe_ffn_hidden_size=None,
                             moe_shared_expert_intermediate_size=None), seed=7)
    moe = GPTModel(_config(), seed=7)
    assert not moe_layers([dense]) and len(moe_layers([moe])) == 2
    assert abs(float(dense(ids, labels=ids).mean()) - float(moe(ids, labels=ids).mean())) > 1e-4


def _megatron_losses(logits: torch.Tensor, kind: str, topk: int, seq: int) -> Dict[str, float]:
    from megatron.core.transformer.moe.moe_utils import (compute_routing_scores_for_aux_loss,
                                                          switch_load_balancing_loss_func,
                                                          z_loss_func)
    routing_map, scores = compute_routing_scores_for_aux_loss(logits, topk, "softmax")
    tokens, experts = logits.shape
    if kind == "aux_loss":
        aux = switch_load_balancing_loss_func(scores, routing_map.sum(0), tokens, topk,
                                              experts, 0.01)
    else:  # Megatron's seq_aux_loss: sequences as extra experts, divided by the batch size
        batch = tokens // seq
        aux = switch_load_balancing_loss_func(
            scores.reshape(seq, -1), routing_map.reshape(seq, -1).sum(0), seq, topk,
            experts, 0.01) / batch
    return {"load_balancing_loss": float(aux), "z_loss": float(z_loss_func(logits, 0.001))}


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_balancing_losses_equal_megatron_on_the_same_logits(kind: str) -> None:
    layer = MoELayer(_config(moe_router_load_balancing_type=kind)).train()
    x = torch.randn(SEQ, BATCH, 16)
    layer(x)
    ours = {k: float(v) for k, v in layer.layer_losses.take().items()}
    logits = (x.reshape(-1, 16) @ layer.router.weight.t()).detach()
    expected = _megatron_losses(logits, kind, 2, SEQ)
    assert ours == pytest.approx(expected, rel=1e-5)
    layer.eval()
    layer(x)
    assert layer.layer_losses.take() == {}, "no balancing loss outside training"


def test_no_balancing_loss_with_zero_coefficient_or_none_type() -> None:
    for overrides in ({"moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None},
                      {"moe_router_load_balancing_type": "none", "moe_z_loss_coeff": None}):
        layer = MoELayer(_config(**overrides)).train()
        layer(torch.randn(SEQ, BATCH, 16))
        assert layer.layer_losses.take() == {}


def test_moe_layer_freq_int_and_list_put_moe_where_asked() -> None:
    def moe_numbers(**overrides: Any) -> List[int]:
        model = GPTModel(_config(num_layers=6, **overrides), device=torch.device("meta"))
        return [layer.layer_number for layer in moe_layers([model])]
    assert moe_numbers() == [0, 1, 2, 3, 4, 5]
    assert moe_numbers(moe_layer_freq=2) == [0, 2, 4]
    assert moe_numbers(moe_layer_freq=[0, 0, 0, 1, 1, 1]) == [3, 4, 5]
    stage = GPTModel(_config(num_layers=6, moe_layer_freq=[1, 0] * 3), layer_range=[3, 4],
                     pre_process=False, device=torch.device("meta"))
    assert [layer.layer_number for layer in moe_layers([stage])] == [4]


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="selective")], ids=["uniform", "block", "selective"])
def test_recompute_gives_the_same_grads_losses_and_counts(recompute: Dict[str, Any]) -> None:
    ids = _batch(3)
    plain = GPTModel(_config(), seed=11)
    again = GPTModel(_config(**recompute), seed=11)
    a, losses_a, grads_a = _loss_and_grads(plain, ids)
    b, losses_b, grads_b = _loss_and_grads(again, ids)
    torch.testing.assert_close(a, b, **TOL)
    assert again.layer_losses.take() == {}, "the recompute left no losses for the next forward"
    for name in losses_a:
        torch.testing.assert_close(losses_a[name], losses_b[name], **TOL)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], **TOL, msg=name)
    for x, y in zip(moe_layers([plain]), moe_layers([again])):
        assert torch.equal(x.stats_tokens_per_expert, y.stats_tokens_per_expert)
        assert float(x.stats_tokens_per_expert.sum()) == SEQ * BATCH * 2


def test_take_moe_stats_reports_imbalance_and_drops_then_resets() -> None:
    model = GPTModel(_config(moe_expert_capacity_factor=1.0), seed=1)
    ids = _batch(4)
    model(ids, labels=ids).mean().backward()
    model(ids, labels=ids).mean().backward()
    layer = moe_layers([model])[0]
    counts = layer.stats_tokens_per_expert.clone()
    dropped, routed = float(layer.stats_dropped), float(layer.stats_routed)
    assert routed == 2 * SEQ * BATCH * 2 and float(counts.sum()) == routed - dropped
    stats = take_moe_stats([model])
    assert set(stats) == {f"moe/layer_{n}/{k}" for n in (0, 1)
                          for k in ("tokens_per_expert_max_over_mean", "dropped_token_share")}
    assert float(stats["moe/layer_0/tokens_per_expert_max_over_mean"]) == \
        pytest.approx(float(counts.max() / counts.mean()))
    assert float(stats["moe/layer_0/dropped_token_share"]) == pytest.approx(dropped / routed)
    assert float(layer.stats_routed) == 0 and float(layer.stats_tokens_per_expert.sum()) == 0
    with torch.no_grad():
        model(ids, labels=ids)
    assert float(layer.stats_routed) == 0, "a no-grad forward (evaluation) counts nothing"


def test_update_expert_biases_applies_megatron_update_from_the_step_counts() -> None:
    model = GPTModel(_config(moe_router_score_function="sigmoid",
                             moe_router_enable_expert_bias=True,
                             moe_router_bias_update_rate=0.25), seed=2)
    ids = _batch(5)
    model(ids, labels=ids).mean().backward()
    layer = moe_layers([model])[1]
    counts = layer.bias_tokens_per_expert.clone()
    expected = updated_expert_bias(counts, torch.zeros(4), 0.25)
    assert counts.sum() == SEQ * BATCH * 2 and expected.abs().sum() > 0
    take_moe_stats([model])  # the log's take leaves the bias counts alone
    update_expert_biases([model], group=None)
    torch.testing.assert_close(layer.router.expert_bias, expected)
    assert float(layer.bias_tokens_per_expert.sum()) == 0


def test_sinkhorn_model_trains_and_routes_top1_by_sigmoid() -> None:
    model = GPTModel(_config(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1,
                             moe_aux_loss_coeff=0.0), seed=4)
    ids = _batch(6)
    total, losses, grads = _loss_and_grads(model, ids)
    assert set(losses) == {"z_loss"} and torch.isfinite(total)
    assert grads["decoder.layers.0.mlp.router.weight"].abs().sum() > 0


def test_bad_moe_config_gives_one_line_per_problem() -> None:
    with pytest.raises(ValueError) as err:
        _config(moe_router_topk=5, moe_router_group_topk=2, moe_expert_capacity_factor=0.0,
                moe_router_score_function="tanh", moe_token_dispatcher_type="flex",
                moe_layer_freq=[1, 0, 1], moe_shared_expert_gate=True)
    lines = str(err.value).splitlines()
    for field in ("moe_router_topk", "moe_router_group_topk", "moe_expert_capacity_factor",
                  "moe_router_score_function", "moe_token_dispatcher_type", "moe_layer_freq",
                  "moe_shared_expert_gate"):
        assert sum(line.startswith(field) for line in lines) == 1, (field, lines)
    assert len(lines) == 7
    with pytest.raises(ValueError, match="^num_moe_experts .* divisible by moe_router_num_groups"):
        _config(moe_router_num_groups=3)
    with pytest.raises(ValueError, match="^moe_shared_expert_intermediate_size needs "
                       "add_bias_linear=False"):
        _config(add_bias_linear=True)
    with pytest.raises(ValueError, match="moe_aux_loss_coeff must be 0 with"):
        _config(moe_router_load_balancing_type="sinkhorn")
    assert _config(moe_expert_capacity_factor=-1.0).moe_expert_capacity_factor is None
    assert _config(moe_ffn_hidden_size=None).moe_ffn_hidden_size == 24


def _tp2_equals_one_device(rank: int, world_size: int, sequence_parallel: bool) -> Dict[str, float]:
    import torch.distributed as dist
    group = dist.new_group(list(range(world_size)))
    config = _config(sequence_parallel=sequence_parallel)
    ids = _batch(8)
    one = GPTModel(_config(), seed=9)
    tp = GPTModel(config, tp_group=group, seed=9)
    a, losses_a, grads_a = _loss_and_grads(one, ids)
    b, losses_b, grads_b = _loss_and_grads(tp, ids)
    worst = 0.0
    for name, grad in grads_b.items():
        if ".mlp.router." in name or ".mlp.experts." in name:
            worst = max(worst, float((grad - grads_a[name]).abs().max()))
    return {"loss": float((a - b).abs()), "worst_moe_grad": worst,
            "aux": max(float((losses_a[k] - losses_b[k]).abs()) for k in losses_a)}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_moe_model_equals_one_device(sequence_parallel: bool) -> None:
    results = run_on_ranks(_tp2_equals_one_device, 2, sequence_parallel)
    for result in results:
        assert result["loss"] < 1e-5 and result["aux"] < 1e-6 and \
            result["worst_moe_grad"] < 1e-5, result
