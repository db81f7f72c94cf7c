"""`gigatron plan`'s step time charges what runs (issues 39, 42):

- selective recomputation: each --recompute-modules set and torchtitan's op rule
  (--selective-ac-option op) adds exactly its recomputed forward to the backward (FLOPs
  executed and seconds), not the core attention whatever the modules;
- the overlaps are read from the run's flags and follow one rule (training/plan/layer.py
  `exposed`): --tp-comm-overlap hides each tp chunk behind its GEMM but the first,
  --overlap-param-gather the ZeRO-1/2 gather behind the next forward but the first bucket,
  ZeRO-3's prefetch each unit but the first, --overlap-grad-reduce the same rule;
- multi-latent attention's GEMMs have MLA's shapes.
"""
from dataclasses import replace

import pytest

from gigatron.cli import plan as plan_cli
from gigatron.models.config import TransformerConfig
from gigatron.training.observe.devices import hardware, with_overrides
from gigatron.training.observe.flops import _mla_parameters
from gigatron.training.plan import cost, gemm
from gigatron.training.plan.planner import partition_of, plan_run

SMALL = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 "
         "--max-position-embeddings 2048 --vocab-size 1000 --micro-batch-size 1 "
         "--global-batch-size 16 --bf16 --hidden-dropout 0 --attention-dropout 0").split()
DENSE = SMALL + ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
                 "rope", "--disable-bias-linear"]
LLAMA = DENSE + ["--group-query-attention", "--num-query-groups", "8"]
MOE = LLAMA + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size",
               "512", "--moe-shared-expert-intermediate-size", "768"]
MLA = DENSE + ["--multi-latent-attention", "--q-lora-rank", "256", "--kv-lora-rank", "128",
               "--qk-head-dim", "64", "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64"]


def _plan(argv, gpus=1, gpu="h100-sxm", **overrides):
    _, _, run, _, _ = plan_cli.configure(["--gpu", gpu, "--num-gpus", str(gpus)] + argv)
    return plan_run(run, with_overrides(hardware(gpu), overrides))


def _selective(*modules):
    return ["--recompute-granularity", "selective"] + \
        (["--recompute-modules", *modules] if modules else [])


def _rates(plan):
    c, hw = plan.run.model, plan.hardware
    return gemm.gemm_rate(hw, "bf16"), hw.hbm_gbps * 1e9 * cost.MEMORY_EFFICIENCY


def _step_flops_per_layer(plan):
    """Executed FLOPs of one layer's micro-batch (4 layers, m micro-batches, no logits)."""
    return plan.cost.gemm_flops / plan.run.train.num_microbatches


# ---- recomputation ----------------------------------------------------------------------

def test_each_recompute_module_charges_its_own_forward_flops():
    """The executed FLOPs grow by exactly the recomputed matmuls: mlp its fc1 and fc2,
    core_attn the attention core, layernorm none; before, every selective set was charged
    the core attention."""
    none = _plan(LLAMA)
    c, tokens, layers = none.run.model, 2048, 4
    h, ffn = c.hidden_size, c.ffn_hidden_size
    core = cost._layer_flops(c, tokens, 1)["core"]
    mlp = 2.0 * tokens * (h * 2 * ffn + ffn * h)
    for modules, extra in (((), core), (("core_attn",), core), (("mlp",), mlp),
                           (("layernorm",), 0.0), (("core_attn", "mlp"), core + mlp)):
        plan = _plan(LLAMA + _selective(*modules))
        grown = _step_flops_per_layer(plan) - _step_flops_per_layer(none)
        assert grown == pytest.approx(layers * extra, rel=1e-9, abs=1.0), modules


def test_recompute_modules_charge_their_forward_seconds():
    """The backward grows by the recomputed parts' forward seconds: mlp its GEMMs and
    activation bytes, layernorm the norms' bytes (tp 1: no collectives)."""
    none = _plan(LLAMA)
    c, tokens, layers = none.run.model, 2048, 4
    flop_rate, byte_rate = _rates(none)
    h, ffn, w = c.hidden_size, c.ffn_hidden_size, 2
    fc1, fc2 = gemm.named_linears(c, 1)["linear_fc1"], gemm.named_linears(c, 1)["linear_fc2"]
    mlp = gemm.linears_seconds((fc1, fc2), tokens, flop_rate, none.hardware.sms)[0] + \
        3 * w * ffn * tokens / byte_rate
    norms = 2 * 2 * w * h * tokens / byte_rate
    for modules, extra in ((("mlp",), mlp), (("layernorm",), norms)):
        plan = _plan(LLAMA + _selective(*modules))
        assert plan.cost.backward - none.cost.backward == pytest.approx(layers * extra,
                                                                         rel=1e-6), modules
        assert plan.cost.forward == none.cost.forward


def test_op_rule_recomputes_every_second_matmul_and_the_element_wise_kernels():
    """torchtitan's op rule runs linear_proj and linear_fc2 again (not linear_qkv, fc1 or
    the fused attention), every element-wise kernel and the layer's kernel gaps."""
    none = _plan(LLAMA)
    plan = _plan(LLAMA + _selective() + ["--selective-ac-option", "op"])
    c, tokens, layers = none.run.model, 2048, 4
    linears = gemm.named_linears(c, 1)
    flops = 2.0 * tokens * sum(k * n for name, (k, n) in linears.items()
                               if name in ("linear_proj", "linear_fc2"))
    assert _step_flops_per_layer(plan) - _step_flops_per_layer(none) == \
        pytest.approx(layers * flops, rel=1e-9)
    flop_rate, byte_rate = _rates(none)
    seconds = gemm.linears_seconds((linears["linear_proj"], linears["linear_fc2"]), tokens,
                                   flop_rate, none.hardware.sms)[0] + \
        cost._layer_bytes(c, tokens, 1, False, True)["dense"] / byte_rate + \
        gemm.KERNELS_FORWARD * gemm.KERNEL_GAP_S
    assert plan.cost.backward - none.cost.backward == pytest.approx(layers * seconds,
                                                                     rel=1e-6)


def test_moe_and_shared_experts_recompute_their_forward():
    """moe runs the whole MoE MLP again (router, experts, shared experts), shared_experts
    only the shared experts' matmuls; mlp does not touch an MoE layer."""
    none = _plan(MOE)
    tokens, h = 2048, 1024
    shared = 2.0 * tokens * (h * 2 * 768 + 768 * h)
    grown = {m: _step_flops_per_layer(_plan(MOE + _selective(m))) -
             _step_flops_per_layer(none) for m in ("shared_experts", "moe", "mlp")}
    assert grown["shared_experts"] == pytest.approx(4 * shared, rel=1e-9)
    assert grown["mlp"] == 0.0  # every layer is an MoE layer
    routed = 2.0 * tokens * (h * 4 + 2 * (h * 2 * 512 + 512 * h))
    assert grown["moe"] == pytest.approx(4 * (routed + shared), rel=1e-9)


def test_mla_up_proj_recomputes_the_up_projections():
    none = _plan(MLA)
    plan = _plan(MLA + _selective("mla_up_proj"))
    tokens, heads = 2048, 16
    up = 2.0 * tokens * (256 * heads * (64 + 32) + 128 * heads * (64 + 64))
    assert _step_flops_per_layer(plan) - _step_flops_per_layer(none) == \
        pytest.approx(4 * up, rel=1e-9)


# ---- multi-latent attention's shapes ----------------------------------------------------

def test_mla_linears_are_mlas_projections():
    """The GEMMs the step times are MLA's own (their weights are flops.py's MLA
    parameters), not q/k/v at kv_channels; the core's q.k at qk + pos head, p.v at the
    value head SDPA computes (zero-padded to the q/k head when narrower)."""
    c = _plan(MLA).run.model
    shapes = gemm.named_linears(c, 1)
    assert set(shapes) == {"linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                           "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2"}
    attention = sum(k * n for name, (k, n) in shapes.items() if "fc" not in name)
    assert attention == _mla_parameters(c, bias=False)
    assert sum(k * n for k, n in gemm.named_linears(c, 2).values()) * 2 == \
        sum(k * n for k, n in shapes.values())
    core = cost._layer_flops(c, 2048, 1)["core"]
    assert core == 2.0 * 2048 * 2048 * 16 * (96 + 96)
    unfused = replace(c, attention_backend="unfused")
    assert cost._layer_flops(unfused, 2048, 1)["core"] == 2.0 * 2048 * 2048 * 16 * (96 + 64)


# ---- overlaps ---------------------------------------------------------------------------

TP = ["--tensor-model-parallel-size", "8", "--sequence-parallel"]


@pytest.mark.parametrize("link,regime", [(1e6, "hidden"), (1.0, "exposed")])
def test_tp_comm_overlap_hides_all_but_the_first_chunk_up_to_the_gemm(link, regime):
    """Each all-gather / reduce-scatter half (c) beside its linear's GEMM (g; backward: the
    dgrad, half the backward) waits max(c / tp, c - (tp-1)/tp g): on a fast link only the
    first chunk, on a slow one all but the GEMM's share; without the flag all of it."""
    serial = _plan(LLAMA + TP, 8, intra_node_gbps=link)
    overlapped = _plan(LLAMA + TP + ["--tp-comm-overlap"], 8, intra_node_gbps=link)
    c, tokens, tp, layers = serial.run.model, 2048, 8, 4
    one = cost._all_reduce_time(tokens * c.hidden_size * 2, tp, link)
    flop_rate, _ = _rates(serial)
    gemms = {n: gemm.linears_seconds((shape,), tokens, flop_rate, serial.hardware.sms)
             for n, shape in gemm.named_linears(c, tp).items()}
    half = one / 2
    forward = sum(max(half / tp, half - (tp - 1) / tp * gemms[n][0]) for n in gemms)
    backward = sum(max(half / tp, half - (tp - 1) / tp * gemms[n][1] / 2) for n in gemms)
    assert serial.cost.forward - overlapped.cost.forward == \
        pytest.approx(layers * (2 * one - forward), rel=1e-6)
    assert serial.cost.backward - overlapped.cost.backward == \
        pytest.approx(layers * (2 * one - backward), rel=1e-6)
    if regime == "hidden":
        assert forward == pytest.approx(2 * one / tp)
    else:
        assert forward > 2 * one * 0.9


def test_tp_comm_overlap_halves_follow_the_disable_flags():
    both = _plan(LLAMA + TP + ["--tp-comm-overlap"], 8)
    no_rs = _plan(LLAMA + TP + ["--tp-comm-overlap", "--disable-tp-comm-overlap-rs"], 8)
    serial = _plan(LLAMA + TP, 8)
    assert both.cost.forward < no_rs.cost.forward < serial.cost.forward


ZERO1 = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size",
         "1000000"]


def _gather_seconds(plan, parameters):
    """One all-gather of the stage's parameters over dp (bf16) on the dp group's link."""
    p = plan.run.parallel
    rate = cost._group_link(p.dp, p.tp, plan.hardware) * 1e9 * cost.NETWORK_EFFICIENCY
    return parameters * (p.dp - 1) / p.dp * 2 / rate


def test_overlap_param_gather_hides_the_gather_behind_the_forward_but_the_first_bucket():
    """ZeRO-1's all-gather after the step: waited for whole without the flag; with it
    max(first bucket, gather - the first micro-batch's forward)."""
    kw = dict(inter_node_gbps=1.0)  # 16 ranks on two nodes: the gather takes a while
    serial = _plan(LLAMA + ZERO1, 16, **kw)
    overlapped = _plan(LLAMA + ZERO1 + ["--overlap-param-gather"], 16, **kw)
    parameters = serial.stages[0].parameters
    gather, first = _gather_seconds(serial, parameters), 1_000_000 / parameters
    assert gather > serial.cost.forward  # the rule's max is not trivially its first term
    assert serial.cost.dp_exposed - overlapped.cost.dp_exposed == pytest.approx(
        gather - max(first * gather, gather - overlapped.cost.forward), rel=1e-9)
    assert overlapped.cost.step < serial.cost.step


def test_overlap_rule_is_one_for_grads_and_zero3_units():
    """--overlap-grad-reduce: max(first bucket, grads - backward); ZeRO-3 with prefetch
    (its default): per pass max(one unit, gathers - that pass's compute), without prefetch
    every gather waited for."""
    from gigatron.training.plan.data_parallel import dp_cost

    plan = _plan(LLAMA + ["--zero-stage", "3"], 16, inter_node_gbps=1.0)
    run, hw, m = plan.run, plan.hardware, plan.run.train.num_microbatches
    _, byte_rate = _rates(plan)
    parameters = plan.stages[0].parameters
    per_pass = _gather_seconds(plan, parameters)
    grads = per_pass * 4 / 2  # fp32 gradients reduce-scattered: the same ring, 4 bytes

    def exposed(compute, **zero):
        return dp_cost(replace(run, zero=replace(run.zero, **zero)), parameters, hw, m,
                       compute, byte_rate, gather_units=5)["exposed"]

    fwd, bwd = 0.3 * per_pass, 2.0 * per_pass
    assert exposed((fwd, bwd), stage3_prefetch=False, overlap_comm=False) == \
        pytest.approx(grads + 2 * m * per_pass, rel=1e-9)
    assert exposed((fwd, bwd), stage3_prefetch=True, overlap_comm=False) == pytest.approx(
        grads + m * (max(per_pass / 5, per_pass - fwd) + per_pass / 5), rel=1e-9)
    first = min(1.0, run.zero.reduce_bucket_size / parameters)
    assert exposed((0.0, grads / 2), zero_stage=2, overlap_comm=True) == pytest.approx(
        max(first * grads, grads / 2) + per_pass, rel=1e-9)


def test_search_applies_the_overlap_flags_where_the_layout_has_them(capsys):
    """--search with --tp-comm-overlap and --overlap-param-gather: tp 1 / ZeRO 0 layouts are
    not refused for the flags (they apply where tp > 1 / ZeRO >= 1), and each plan reads
    them as a single plan of its layout's flags does."""
    import json

    from test_plan_cli import _plan as _cli

    small = ("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
             "--max-position-embeddings 512 --vocab-size 1000 --global-batch-size 8 --bf16 "
             "--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap "
             # the flags' own layout validates as given (the search then varies it)
             "--tensor-model-parallel-size 2 --sequence-parallel "
             "--use-distributed-optimizer").split()
    code, out, _ = _cli(capsys, "--search", "--json", "--gpu", "h100-sxm", "--num-gpus", "2",
                        *small)
    doc = json.loads(out)
    assert code == 0 and not any("overlap" in r["reason"] for r in doc["refused"])
    layouts = {(p["layout"]["tp"], p["layout"]["zero_stage"]) for p in doc["ranked"]}
    assert {(1, 0), (2, 0), (1, 1), (2, 1)} <= layouts
