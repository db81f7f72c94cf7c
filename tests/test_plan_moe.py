"""`gigatron plan` on mixtures of experts: parameters per rank, expert ZeRO state over edp,
MoE activations with top-k, the token exchange's bytes and time, FLOPs on active
parameters, --search over ep; each by hand on a tiny MoE config."""
import json
from types import SimpleNamespace

import pytest
import torch

from gigatron.cli import plan as plan_cli
from gigatron.models.config import TransformerConfig
from gigatron.parallel.comm import ShapeOnlyGroup
from gigatron.parallel.expert.topology import ExpertTopology
from gigatron.parallel.pipeline.partition import partition_layers
from gigatron.parallel.topology import Topology
from gigatron.parallel.zero.config import ZeroConfig
from gigatron.training.observe.flops import flops_per_token, matmul_parameter_count
from gigatron.training.plan.experts import exchange_bytes
from gigatron.training.plan.memory import activation_terms, chunk_activations, \
    moe_mlp_bytes, stage_memory
from gigatron.training.plan.parameters import is_expert_parallel, stage_parameters
from gigatron.training.plan.search import expert_sizes

H, E, K, F, FFN = 64, 4, 2, 48, 128


def tiny(**kw) -> TransformerConfig:
    """2 layers (MoE, dense), SwiGLU, 4 experts of 48, top-2, bf16, no biases."""
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN,
                vocab_size=100, seq_length=16, max_position_embeddings=16,
                num_moe_experts=E, moe_ffn_hidden_size=F, moe_router_topk=K,
                moe_layer_freq=[1, 0], activation="swiglu", add_bias_linear=False,
                normalization="RMSNorm", position_embedding_type="rope",
                sequence_parallel=True, params_dtype=torch.bfloat16, hidden_dropout=0.0,
                attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def _experts(specs):
    return {s.name: s for chunk in specs for s in chunk if s.is_expert}


@pytest.mark.parametrize("tp,ep,etp,local,ffn,kind", [
    (2, 2, 1, 2, F, "expert"),  # 2 of 4 experts, whole ffn
    (2, 2, 2, 2, F // 2, "expert"),  # and half of each ffn
    (2, 1, 1, 4, F, "expert"),  # etp 1 != tp: expert-parallel, every expert
    (2, 1, 2, 4, F, "default"),  # ep 1, etp = tp: replicated, as the trainer keeps them
])
def test_expert_weights_per_rank_equal_a_hand_count(tp, ep, etp, local, ffn, kind):
    part = partition_layers(2, 1)
    experts = _experts(stage_parameters(tiny(), tp, part, 0, ep, etp))
    assert set(experts) == {"decoder.layers.0.mlp.experts.weight1",
                            "decoder.layers.0.mlp.experts.weight2"}  # layer 1 is dense
    w1, w2 = experts.values()
    assert w1.shape == (local, H, 2 * ffn) and w2.shape == (local, ffn, H)
    assert w1.kind == w2.kind == kind


def test_planner_shards_experts_where_the_trainer_does():
    from gigatron.training.run.builders import dispatcher_factory

    class Groups:
        def __init__(self, expert):
            self.expert = expert

        def __getitem__(self, name):
            return ShapeOnlyGroup(self.expert.size(name))

    for tp, dp, ep, etp in [(1, 4, 1, 1), (1, 4, 4, 1), (2, 2, 1, 2), (2, 2, 1, 1),
                            (2, 2, 2, 2), (4, 1, 1, 4), (4, 2, 2, 1)]:
        run = SimpleNamespace(parallel=SimpleNamespace(tp=tp), model=tiny())
        groups = Groups(ExpertTopology(Topology(tp=tp, dp=dp, pp=1), ep=ep, etp=etp))
        assert (dispatcher_factory(run, groups) is not None) == is_expert_parallel(tp, ep, etp)


def test_expert_state_is_sharded_over_edp_and_dense_state_over_dp():
    # tp 2, dp 2, ep 1, etp 1: edp = 4 while dp = 2; one bucket, stage 1, bf16 + Adam
    c = tiny()
    zero = ZeroConfig(zero_stage=1, reduce_bucket_size=10 ** 9)
    m = stage_memory(c, partition_layers(2, 1), 0, 2, 2, zero, 1, 1, False, ep=1, etp=1)
    per_rank = E * (H * 2 * F + F * H)  # every expert, whole ffn: 36864
    assert m.expert_parameters == per_rank
    e = m.expert_state
    assert e.params == 2 * per_rank and e.grads == 4 * per_rank  # stage 1: full grads
    assert e.master_params == 4 * per_rank // 4 and e.optimizer_state == 8 * per_rank // 4
    dense = stage_memory(c, partition_layers(2, 1), 0, 2, 2, zero, 1, 1, False, 1, 2)
    assert dense.expert_state.optimizer_state == 8 * per_rank // 2  # replicated: over dp


def test_moe_activations_count_topk_rows_router_and_expert_fc1():
    c = tiny()
    w, tp = 2, 2
    # ep 2, etp 1: each rank routes half the tokens; rows k x etp / tp = 1 per token
    router = 0.5 * (w * H + (2 * w + 4 + 1) * E)  # input, logits, scores, aux scores, map
    experts = 1 * (w * H + 4 * w * F)  # rows, fc1 output [gate, up], silu, product
    combine = K * 0.5 * (w * H + 4 + 8)  # weighted outputs, probs, token indices
    assert moe_mlp_bytes(c, tp, 2, 1) == router + experts + combine == 734
    # ep 1, etp = tp: every rank routes every token through whole experts (k rows/token)
    assert moe_mlp_bytes(c, tp, 1, 2) == (w * H + 9 * E) + K * (w * H + 4 * w * F) + \
        K * (w * H + 12)
    shared = tiny(moe_shared_expert_intermediate_size=32)
    assert moe_mlp_bytes(shared, tp, 2, 1) == 734 + w * H + 4 * w * 32 / tp
    terms = activation_terms(c, tp, on_gpu=True, ep=2, etp=1)
    dense_mlp = w * H + 4 * w * FFN / tp
    assert terms.moe_layer == pytest.approx(terms.layer - dense_mlp + 734)
    held, _ = chunk_activations(c, terms, 2, False, False, 16, [True, False])
    assert held == pytest.approx(16 * (terms.moe_layer + terms.layer) + terms.per_chunk_constant)


def test_exchange_bytes_by_hand():
    c, tokens, w = tiny(moe_token_dispatcher_type="alltoall"), 32, 2
    local = tokens // 2  # tp 2: each rank dispatches its sequence slice
    one_way = local * K * H * w * (2 - 1) / 2  # to the other ep rank
    assert exchange_bytes(c, tokens, 2, 2, 1) == (2 * one_way, 2 * one_way)
    gather = (2 - 1) * local * K * H * w  # the etp all-gather (and reduce-scatter) of rows
    assert exchange_bytes(c, tokens, 2, 2, 2) == (2 * (one_way + gather),) * 2
    assert exchange_bytes(c, tokens, 2, 1, 2) == (0.0, 0.0)  # replicated: nothing moves
    ag = tiny(moe_token_dispatcher_type="allgather")
    assert exchange_bytes(ag, tokens, 2, 2, 1) == (local * (2 * H * w + E * (w + 1)),
                                                    local * (2 * H * w + E * w))


TINY_FLAGS = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
              "--max-position-embeddings 512 --vocab-size 1000 --micro-batch-size 1 "
              "--global-batch-size 16 --bf16 --lr 1e-4 --train-iters 1 --mock-data "
              "--num-experts 8 --moe-ffn-hidden-size 512 --swiglu "
              "--moe-token-dispatcher-type alltoall --disable-bias-linear "
              "--normalization RMSNorm").split()


def _plan(capsys, *argv):
    assert plan_cli.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_exchange_is_in_the_step_and_scales_with_the_link(capsys):
    # tp 1, pp 1: only the exchange and the dp reduction use the links
    args = ("--json", "--gpu", "h100-sxm", "--num-gpus", "4", "--expert-model-parallel-size",
            "4", *TINY_FLAGS)
    fast = _plan(capsys, *args)
    slow = _plan(capsys, *args, "--intra-node-bandwidth", "45")
    tokens, h, k, w, layers, m = 512, 256, 2, 2, 4, 4
    per_pass = 2 * tokens * k * h * w * 3 / 4  # dispatch + combine, 3/4 leave the rank
    assert fast["step"]["expert_bytes"] == m * layers * 2 * per_pass
    rate = 450e9 * 0.7
    assert fast["step"]["expert_communication_s"] == pytest.approx(
        m * layers * 2 * per_pass / rate)
    assert slow["step"]["forward_s"] - fast["step"]["forward_s"] == pytest.approx(
        layers * per_pass / (45e9 * 0.7) - layers * per_pass / rate)
    assert slow["step"]["step_s"] > fast["step"]["step_s"]


def test_model_flops_are_the_trainers_active_parameter_count(capsys):
    doc = _plan(capsys, "--json", "--num-gpus", "2", *TINY_FLAGS)
    from gigatron.training.config.arguments import build_run_config, parse_flags

    c = build_run_config(parse_flags(TINY_FLAGS, "t"), 2).model
    h, f, layers, vocab = 256, 512, 4, 1024
    attention = h * 3 * h + h * h
    active = 8 * h + 2 * (h * 2 * f + f * h)  # router + top-2 SwiGLU experts
    assert matmul_parameter_count(c) == layers * (attention + 2 * h + active) + h + vocab * h
    tokens = 16 * 512
    assert doc["rates"]["model_tflops_per_gpu"] == pytest.approx(
        flops_per_token(c) * tokens / doc["step"]["step_s"] / 2 / 1e12)


def test_search_tries_each_expert_parallel_size(capsys):
    assert expert_sizes(8, 2, 4, None) == [1, 2, 4]  # etp = tp 2: etp x ep divides 8
    assert expert_sizes(8, 2, 4, 1) == [1, 2, 4, 8]
    assert expert_sizes(6, 1, 4, None) == [1, 2]
    assert expert_sizes(None, 2, 4, None) == [None]
    doc = _plan(capsys, "--search", "--json", "--gpu", "a100-40gb", "--num-gpus", "4",
                *TINY_FLAGS)
    tried = {p["layout"]["ep"] for p in doc["ranked"]} | \
        {r["layout"]["ep"] for r in doc["refused"]}
    assert tried == {1, 2, 4}
    assert {p["layout"]["ep"] for p in doc["ranked"]} >= {2, 4}


def test_mixtral_on_64_gpus_prints_sane_numbers(capsys):
    doc = _plan(capsys, "--json", "--gpu", "h100-sxm", "--num-gpus", "64", "--model",
                "mixtral-8x7b", "--tensor-model-parallel-size", "2",
                "--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8",
                "--sequence-parallel", "--use-distributed-optimizer",
                "--moe-token-dispatcher-type", "alltoall", "--micro-batch-size", "1",
                "--global-batch-size", "256", "--bf16", "--lr", "1e-4", "--train-iters", "1",
                "--mock-data")
    lay = doc["layout"]
    assert (lay["ep"], lay["etp"], lay["edp"]) == (8, 2, 1)
    experts = 32 * 8 * 3 * 4096 * 14336  # 45.1e9 of Mixtral's 46.7e9
    assert sum(s["expert_parameters"] for s in doc["stages"]) * 8 * 2 == experts
    total = sum(s["parameters"] for s in doc["stages"])
    # every stage holds about 46.7e9 / (pp x ep x etp) experts + its share of the rest
    assert 0.9e9 < max(s["parameters"] for s in doc["stages"]) < 1.0e9
    assert total * 2 == pytest.approx(46.7e9 - experts + experts / 8, rel=0.02)
    assert doc["fits"] and 0.1 < doc["rates"]["mfu"] < 0.7
    assert doc["step"]["expert_bytes"] > 0 and doc["step"]["expert_communication_s"] > 0


def test_dense_plan_json_has_no_expert_keys(capsys):
    doc = _plan(capsys, "--json", "--num-gpus", "2", *TINY_FLAGS[:22])
    assert "ep" not in doc["layout"] and "expert_bytes" not in doc["step"]
    assert all("expert_parameters" not in s for s in doc["stages"])
