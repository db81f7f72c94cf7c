"""Muon (parallel/zero/muon/): the update rule against torch.optim.Muon, the Newton-Schulz
coefficient sets and scales, the layer-wise plan (pure), and ZeRO stages 0-3 on 2 forked
gloo ranks equal to one process (whole matrices owned by one rank, updates sent back)."""
from unittest import mock

import pytest
import torch
from torch import nn

from multirank import run_on_ranks

from gigatron.parallel.zero import ZeroConfig, build_zero
from gigatron.parallel.zero.layout import plan_buckets
from gigatron.parallel.zero.muon import Muon, MuonConfig, newton_schulz, scale_factor
from gigatron.parallel.zero.muon.config import muon_problems
from gigatron.parallel.zero.muon.layerwise import (assign_owners, exchange_plan,
                                                   shard_matrix_pieces)
from gigatron.parallel.zero.muon.matrices import MatrixUnit
from gigatron.parallel.zero.muon.newton_schulz import coefficients

STEPS, BATCH = 4, 8
# torch.optim.Muon's settings in Megatron-LM's flags
TORCH_LIKE = MuonConfig(momentum=0.95, nesterov=True, coefficient_type="simple",
                        scale_mode="shape_scaling")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 24), nn.Tanh())
        self.head = nn.Linear(24, 4)

    def forward(self, x):
        return self.head(self.layers(x))


def data(steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g))
            for _ in range(steps)]


def _loss(model, x, y):
    return (model(x) - y).pow(2).mean()


def _groups(model, weight_decay=0.1):
    """Megatron's split: matrices (decayed) by Muon, biases (no decay) by AdamW."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() == 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0,
             "use_muon": False}]


def _train_plain(optimizer_for, steps=STEPS):
    model = MLP()
    opts = optimizer_for(model)
    for x, y in data(steps):
        model.zero_grad()
        _loss(model, x, y).backward()
        for opt in opts:
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def _torch_muon(model):
    groups = _groups(model)
    return [torch.optim.Muon(groups[0]["params"], lr=0.02, weight_decay=0.1, momentum=0.95,
                             nesterov=True),
            torch.optim.AdamW(groups[1]["params"], lr=0.02, weight_decay=0.0)]


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_one_rank_equals_torch_optim_muon_where_their_settings_coincide(precision):
    """torch runs its iterations in bf16 after normalising in bf16; Megatron (and we)
    normalise in fp32 first: with torch's cast lifted to fp32 the two are the same to
    rounding, in bf16 within bf16's precision."""
    config = MuonConfig(**{**vars(TORCH_LIKE), "fp32_matmul_prec": precision})
    ours = _train_plain(lambda m: [Muon(_groups(m), lr=0.02, config=config)])
    if precision == "highest":
        with mock.patch.object(torch.Tensor, "bfloat16", lambda self: self.float()):
            theirs = _train_plain(_torch_muon)
    else:
        theirs = _train_plain(_torch_muon)
    worst = max(_relative(ours[n], theirs[n]) for n in theirs)
    assert worst < (1e-6 if precision == "highest" else 3e-2), worst


def test_newton_schulz_orthogonalises_and_is_the_same_either_way_round():
    torch.manual_seed(0)
    x = torch.randn(12, 40)
    for kind, steps in [("quintic", 5), ("polar_express", 8), ("aol", 4), ("simple", 7)]:
        o = newton_schulz(x, steps, kind, "highest")
        singular = torch.linalg.svdvals(o)
        assert 0.5 < singular.min() and singular.max() < 1.5, (kind, singular)
        torch.testing.assert_close(newton_schulz(x.T, steps, kind, "highest"), o.T)
    stacked = torch.randn(3, 6, 10)
    torch.testing.assert_close(newton_schulz(stacked, 5, "quintic", "highest"),
                               torch.stack([newton_schulz(m, 5, "quintic", "highest")
                                            for m in stacked]), rtol=1e-5, atol=1e-6)


def test_coefficient_sets_steps_and_scales_follow_megatron():
    assert coefficients("simple", 3) == [(3.4445, -4.7750, 2.0315)] * 3
    assert coefficients("quintic", 10)[5] == coefficients("quintic", 5)[0]
    assert coefficients("polar_express", 10)[-1] == (1.8750, -1.2500, 0.3750)
    assert scale_factor(64, 16, "spectral") == 8.0
    assert scale_factor(16, 64, "shape_scaling") == 1.0
    assert scale_factor(64, 16, "shape_scaling") == 2.0
    assert scale_factor(16, 64, "unit_rms_norm") == 0.5
    lines = muon_problems({"num_ns_steps": 4, "fp32_matmul_prec": "low", "tp_mode": "x",
                           "momentum": 1.0}, {"num_ns_steps": "--muon-num-ns-steps"})
    assert len(lines) == 4 and any("--muon-num-ns-steps 4" in line for line in lines)


def test_layer_wise_plan_sends_every_element_of_a_matrix_to_its_owner_once():
    units = [MatrixUnit(0, 0, 4, 6), MatrixUnit(1, 0, 2, 3), MatrixUnit(2, 0, 5, 5),
             MatrixUnit(3, 0, 2, 2), MatrixUnit(3, 4, 2, 2)]  # the last: 2 stacked experts
    numels = [24, 6, 25, 8]
    costs = [u.flops(5) for u in units]
    for ways, bucket in [(2, 10), (3, 7), (4, 100)]:
        buckets = plan_buckets(numels, bucket, ways)
        owners = assign_owners(costs, ways)
        loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(ways)]
        assert max(loads) - min(loads) <= max(costs)
        got = {i: [] for i in range(len(units))}
        for rank in range(ways):
            plan = exchange_plan(buckets, numels, units, owners, ways, rank)
            for r, pieces in enumerate(plan.receive):
                # what rank r sends this owner is what this owner expects from r
                assert pieces == exchange_plan(buckets, numels, units, owners, ways,
                                               r).send[rank]
                for i, start, _, n in pieces:
                    assert owners[i] == rank
                    got[i] += range(start, start + n)
        assert all(sorted(got[i]) == list(range(u.numel)) for i, u in enumerate(units))
        # every piece of every shard lies inside that shard
        for rank in range(ways):
            size = sum(b.shard_numel for b in buckets)
            assert all(0 <= at and at + n <= size for _, _, at, n in
                       shard_matrix_pieces(buckets, numels, units, rank))


def _zero_case(rank, world, stage, config):
    model = MLP()
    zero = build_zero(model, ZeroConfig(zero_stage=stage, reduce_bucket_size=60,
                                        optimizer="muon", lr=0.02, weight_decay=0.1,
                                        muon=config))
    per = BATCH // world
    for x, y in data():
        zero.zero_grad()
        zero.backward(_loss(model, x[rank * per:(rank + 1) * per],
                            y[rank * per:(rank + 1) * per]))
        zero.step()
    with zero.gathered_parameters():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _every_stage(rank, world, config):
    return {stage: _zero_case(rank, world, stage, config) for stage in range(4)}


def test_zero_stages_0_to_3_on_two_ranks_equal_one_process():
    config = MuonConfig(**{**vars(TORCH_LIKE), "fp32_matmul_prec": "highest"})
    want = _train_plain(lambda m: [Muon(_groups(m), lr=0.02, config=config)])
    for rank, by_stage in enumerate(run_on_ranks(_every_stage, 2, config)):
        for stage, params in by_stage.items():
            worst = max(_relative(params[n], want[n]) for n in want)
            assert worst < 1e-6, (rank, stage, worst)


BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 "
        "--mock-data --vocab-size 100 --optimizer muon").split()


def _run(extra=(), world=1):
    from gigatron.training.config.arguments import parse_args

    return parse_args(BASE + list(extra), world)


def test_megatron_lm_flags_and_defaults_reach_the_optimizer():
    muon = _run().zero.muon
    assert _run().zero.optimizer == "muon"
    assert (muon.momentum, muon.nesterov, muon.num_ns_steps, muon.coefficient_type,
            muon.scale_mode, muon.extra_scale_factor, muon.split_qkv, muon.fp32_matmul_prec,
            muon.tp_mode, muon.scalar_optimizer) == (
        0.9, False, 5, "quintic", "spectral", 1.0, True, "medium", "duplicated", "adam")
    assert muon.qkv_split_shapes == (8, 8, 8)  # 4 heads of 8 channels, one per query group
    gqa = _run("--group-query-attention --num-query-groups 2".split()).zero.muon
    assert gqa.qkv_split_shapes == (16, 8, 8)
    given = _run("--muon-momentum 0.95 --muon-nesterov --muon-num-ns-steps 8 "
                 "--muon-coefficient-type polar_express --muon-scale-mode shape_scaling "
                 "--muon-extra-scale-factor 0.2 --muon-no-split-qkv --muon-fp32-matmul-prec "
                 "high --muon-tp-mode blockwise --use-distributed-optimizer".split())
    m = given.zero.muon
    assert (m.momentum, m.nesterov, m.num_ns_steps, m.coefficient_type, m.scale_mode,
            m.extra_scale_factor, m.split_qkv, m.fp32_matmul_prec, m.tp_mode) == (
        0.95, True, 8, "polar_express", "shape_scaling", 0.2, False, "high", "blockwise")
    assert given.zero.zero_stage == 1  # the layer-wise distributed Muon
    assert _run(["--optimizer", "adam"]).zero.muon is None


@pytest.mark.parametrize("extra, message", [
    ("--muon-num-ns-steps 4", "--muon-coefficient-type quintic with --muon-num-ns-steps 4"),
    ("--muon-fp32-matmul-prec low", "--muon-fp32-matmul-prec 'low' is not a torch"),
    ("--muon-scalar-optimizer lion", "--muon-scalar-optimizer 'lion' is not built"),
    ("--muon-momentum 1", "--muon-momentum must be in [0, 1)"),
    ("--optimizer-cpu-offload --use-distributed-optimizer",
     "--optimizer-cpu-offload is not built with --optimizer muon"),
])
def test_bad_muon_flags_are_one_line_each_naming_the_flag(extra, message):
    with pytest.raises(ValueError) as err:
        _run(extra.split())
    assert message in str(err.value)


def _tp_modes(rank, world):
    from gigatron.parallel.tensor.init import shard
    from gigatron.parallel.zero.muon.matrices import MatrixUpdate, TensorSplit

    torch.manual_seed(0)
    whole = torch.randn(8, 12)
    out = {}
    for dim, stride in [(0, 1), (1, 1), (0, 2)]:
        unit = MatrixUnit(0, 0, *shard(whole, dim, rank, world, stride).shape,
                          split=TensorSplit(dim, stride))
        mine = shard(whole, dim, rank, world, stride)
        for mode in ("duplicated", "blockwise", "distributed"):
            update = MatrixUpdate(MuonConfig(tp_mode=mode, fp32_matmul_prec="highest"),
                                  tp_group=None)
            out[dim, stride, mode] = update(unit, mine)
        # a stacked expert's [in, out] matrix split over expert-tp (dim 1: its outputs)
        expert = MatrixUnit(0, 0, 12, 8 // world, True, split=TensorSplit(1, 1, expert=True))
        for mode in ("duplicated", "distributed"):
            update = MatrixUpdate(MuonConfig(tp_mode=mode, fp32_matmul_prec="highest"),
                                  expert_tp_group=None)
            out["expert", mode] = update(expert, shard(whole.T, 1, rank, world))
    return out


def test_tp_duplicated_and_distributed_keep_the_whole_matrix_update_blockwise_each_shards():
    from gigatron.parallel.tensor.init import shard
    from gigatron.parallel.zero.muon.matrices import MatrixUpdate

    torch.manual_seed(0)
    whole = torch.randn(8, 12)
    one = MatrixUpdate(MuonConfig(fp32_matmul_prec="highest"))
    for rank, out in enumerate(run_on_ranks(_tp_modes, 2)):
        for dim, stride in [(0, 1), (1, 1), (0, 2)]:
            want = shard(one(MatrixUnit(0, 0, 8, 12), whole), dim, rank, 2, stride)
            torch.testing.assert_close(out[dim, stride, "duplicated"], want)
            torch.testing.assert_close(out[dim, stride, "distributed"], want, rtol=1e-4,
                                       atol=1e-5)
            mine = shard(whole, dim, rank, 2, stride)
            own = one(MatrixUnit(0, 0, *mine.shape), mine)  # its own norm and scale
            torch.testing.assert_close(out[dim, stride, "blockwise"], own)
            assert not torch.allclose(own, want, rtol=1e-2, atol=1e-3)
        # the expert's update reads its [out, in] = the transpose of what it stores
        expert = shard(one(MatrixUnit(0, 0, 12, 8, True), whole.T), 1, rank, 2)
        torch.testing.assert_close(out["expert", "duplicated"], expert)
        torch.testing.assert_close(out["expert", "distributed"], expert, rtol=1e-4, atol=1e-5)


def _plan_case(extra, world):
    from gigatron.training.observe.devices import hardware
    from gigatron.training.plan.muon import muon_cost

    run = _run(["--swiglu", "--group-query-attention", "--num-query-groups", "2"] + extra,
               world)
    return run, muon_cost(run, hardware("h100-sxm"))


def test_plan_counts_the_newton_schulz_flops_and_state_the_optimizer_has():
    """The plan's FLOPs are the optimizer's matrices' (q, k, v apart), shared over dp by the
    layer-wise scheme; its optimizer state is the momentum of the matrices (4 bytes) and
    AdamW's moments of the rest (8), as the real optimizer holds after a step."""
    from gigatron.models.gpt import GPTModel
    from gigatron.parallel.zero.muon.newton_schulz import newton_schulz_flops
    from gigatron.training.plan.planner import plan_stages
    from gigatron.training.observe.devices import hardware
    from gigatron.training.run.builders import mark_embedding_and_output

    run, one = _plan_case([], 1)
    model = GPTModel(run.model, seed=1)
    mark_embedding_and_output([model])
    zero = build_zero(model, run.zero)
    flops = 0
    for layout in zero.optimizer.layouts.values():
        for u in layout.units:
            shapes = [(u.rows // sum(u.qkv) * r, u.cols) for r in u.qkv] if u.qkv else \
                [(u.rows, u.cols)]
            flops += sum(newton_schulz_flops(r, c, 5) for r, c in shapes)
    assert flops > 0 and one.flops == flops and one.exchange_bytes == 0
    _, two = _plan_case(["--use-distributed-optimizer"], 2)
    assert two.flops == flops / 2 and two.exchange_bytes > 0
    model(torch.randint(0, 100, (2, 16)), labels=torch.randint(0, 100, (2, 16))).mean().backward()
    zero.step()
    held = sum(t.numel() * t.element_size() for s in zero.optimizer.state.values()
               for t in s.values() if isinstance(t, torch.Tensor) and t.dim())
    planned = plan_stages(run, hardware("h100-sxm"))[0].state.optimizer_state
    assert planned == held, (planned, held)



def test_matrices_are_megatrons_two_d_weights_and_each_experts_own():
    """Megatron-Core's rule: 2-D weights but the word embedding and the output layer; norms
    and biases (stacked expert biases [E, n] too: Megatron-Core holds one 1-D bias per expert)
    are AdamW's; a stacked expert weight is one [in, out] matrix per expert."""
    from gigatron.parallel.zero.muon.matrices import is_muon_matrix, matrix_units
    from gigatron.training.run.builders import mark_embedding_and_output

    run = _run("--num-experts 2 --moe-ffn-hidden-size 16 --position-embedding-type "
               "learned_absolute --untie-embeddings-and-output-weights".split())
    from gigatron.models.gpt import GPTModel

    model = GPTModel(run.model, seed=1)
    mark_embedding_and_output([model])
    muon = {n for n, p in model.named_parameters() if is_muon_matrix(p)}
    names = {n for n, _ in model.named_parameters()}
    assert "embedding.word_embeddings.weight" not in muon and "output_layer.weight" in names
    assert "output_layer.weight" not in muon
    assert "embedding.position_embeddings.weight" in muon  # 2-D and untagged, as Megatron
    assert any(n.endswith("router.weight") for n in muon)
    assert any(n.endswith("experts.weight1") for n in muon)
    assert not any("bias" in n or "norm" in n for n in muon)
    assert any(n.endswith("experts.bias1") for n in names)
    w1 = dict(model.named_parameters())["decoder.layers.0.mlp.experts.weight1"]
    units = matrix_units(0, w1, "", MuonConfig())
    assert [(u.offset, u.rows, u.cols, u.input_major) for u in units] == [
        (e * 32 * 16, 32, 16, True) for e in range(2)]
