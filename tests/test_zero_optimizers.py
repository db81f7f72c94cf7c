"""ZeRO with DeepSpeed's optimizer semantics: user param groups, optimizers from a spec
(adam in both adam_w_mode, adamw, sgd, adagrad, lamb), and a user's torch optimizer adopted.

Every run trains a small MLP in fp32 for STEPS steps on the same global batch of BATCH
samples, ZeRO stages 0-3 on 2 forked gloo ranks (each its half of the batch) and on 1 rank,
and compares every parameter with a plain single-process torch loop over the global batch:
the largest error must be within RTOL = 1e-5 of the parameter's largest absolute value.
The Lamb reference is a straightforward per-parameter Lamb written here (DeepSpeed
FusedLamb's formulas), independent of gigatron's Lamb.
"""
import math

import pytest
import torch
from torch import nn

from multirank import run_on_ranks

from gigatron.parallel.zero import ZeroConfig, build_zero
from gigatron.parallel.zero.lamb import Lamb
from gigatron.parallel.zero.optimizers import OptimizerSpec, build_optimizer, spec_from_zero_config

STEPS, BATCH, RTOL = 4, 8, 1e-5
BUCKET = 60  # elements: several buckets, parameters cut across buckets and dp shards


class MLP(nn.Module):
    """Hidden layers in a Sequential (stage-3 units) and a head in the root unit."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.layers(x))


def data(steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g))
            for _ in range(steps)]


def loss_fn(model, x, y):
    return (model(x) - y).pow(2).mean()


def user_groups(model):
    """Two groups with their own lr and weight decay (decay on biases too: DeepSpeed's rule);
    head.bias is in no group, so it is not trained."""
    first = list(model.layers[0].parameters())
    rest = list(model.layers[2].parameters()) + [model.head.weight]
    return [{"params": first, "lr": 2e-2, "weight_decay": 0.1},
            {"params": rest, "lr": 5e-3, "weight_decay": 0.05}]


class ReferenceLamb(torch.optim.Optimizer):
    """Lamb as DeepSpeed's FusedLamb computes it, one whole parameter at a time."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 max_coeff=10.0, min_coeff=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      max_coeff=max_coeff, min_coeff=min_coeff))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                s = self.state[p]
                if not s:
                    s.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                s["t"] += 1
                s["m"] = b1 * s["m"] + (1 - b1) * p.grad
                s["v"] = b2 * s["v"] + (1 - b2) * p.grad * p.grad
                m_hat, v_hat = s["m"] / (1 - b1 ** s["t"]), s["v"] / (1 - b2 ** s["t"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm().item(), update.norm().item()
                ratio = 1.0 if w_norm == 0 or u_norm == 0 else \
                    min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
                p -= group["lr"] * ratio * update


# name -> (the spec ZeRO builds from, the torch optimizer the reference loop uses)
CASES = {
    "adam_w_mode": (OptimizerSpec("adam", lr=1e-2, weight_decay=0.02),
                    lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.02)),
    "adam_l2": (OptimizerSpec("adam", lr=1e-2, weight_decay=0.02, adam_w_mode=False),
                lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.02)),
    "adamw": (OptimizerSpec("adamw", lr=1e-2, betas=(0.8, 0.99), weight_decay=0.02),
              lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.02)),
    "sgd_nesterov": (OptimizerSpec("sgd", lr=5e-2, momentum=0.9, nesterov=True),
                     lambda g: torch.optim.SGD(g, lr=5e-2, momentum=0.9, nesterov=True)),
    "adagrad": (OptimizerSpec("adagrad", lr=5e-2, lr_decay=0.01, initial_accumulator_value=0.1,
                              eps=1e-10),
                lambda g: torch.optim.Adagrad(g, lr=5e-2, lr_decay=0.01,
                                              initial_accumulator_value=0.1, eps=1e-10)),
    "lamb": (OptimizerSpec("lamb", lr=1e-2, weight_decay=0.01, min_coeff=0.05, max_coeff=5.0),
             lambda g: ReferenceLamb(g, lr=1e-2, weight_decay=0.01, min_coeff=0.05,
                                     max_coeff=5.0)),
}


def reference(make_optimizer, grouped, steps=STEPS, scheduler=None):
    """Plain torch on one process over the global batch."""
    model = MLP()
    opt = make_optimizer(user_groups(model) if grouped else model.parameters())
    sched = scheduler(opt) if scheduler else None
    for x, y in data(steps):
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
        if sched:
            sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(rank, world, model, zero, steps=STEPS, scheduler=None):
    """ZeRO on this rank's part of each global batch; the full parameters afterwards."""
    per = BATCH // world
    for x, y in data(steps):
        zero.zero_grad()
        zero.backward(loss_fn(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]))
        zero.step()
        if scheduler:
            scheduler.step()
    with zero.gathered_parameters():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_matches(params, ref, what):
    for name, want in ref.items():
        err = (params[name] - want).abs().max().item()
        scale = want.abs().max().item()
        assert err <= RTOL * scale, f"{what} {name}: max error {err:.3g} > {RTOL} x {scale:.3g}"


def _every_case(rank, world):
    out = {}
    for name, (spec, _) in CASES.items():
        for grouped in (False, True):
            for stage in range(4):
                model = MLP()
                groups = user_groups(model) if grouped else model.parameters()
                zero = build_zero(model, ZeroConfig(zero_stage=stage, reduce_bucket_size=BUCKET),
                                  param_groups=groups, optimizer=spec)
                out[(name, grouped, stage)] = train(rank, world, model, zero)
                if grouped:  # head.bias: in no group, so left to autograd (local grad)
                    out[("head_bias_grad", name, stage)] = model.head.bias.grad.clone()
    return out


@pytest.fixture(scope="module")
def references():
    return {(name, grouped): reference(make, grouped)
            for name, (_, make) in CASES.items() for grouped in (False, True)}


@pytest.mark.parametrize("world", [2, 1])
def test_every_optimizer_type_and_user_groups_match_single_process_torch_on_stages_0_to_3(
        world, references):
    results = run_on_ranks(_every_case, world)
    for rank, res in enumerate(results):
        for name in CASES:
            for grouped in (False, True):
                for stage in range(4):
                    assert_matches(res[(name, grouped, stage)], references[(name, grouped)],
                                   f"{name} grouped={grouped} stage {stage} world {world} "
                                   f"rank {rank}")
    init = MLP().head.bias.detach()
    for name in CASES:
        for stage in range(4):
            assert torch.equal(results[0][(name, True, stage)]["head.bias"], init)
            if world == 2:  # never reduced over dp: each rank kept its own batch's gradient
                assert not torch.allclose(results[0][("head_bias_grad", name, stage)],
                                          results[1][("head_bias_grad", name, stage)])


def test_user_groups_decay_every_parameter_of_the_group_and_keep_their_options():
    model = MLP()
    zero = build_zero(model, ZeroConfig(zero_stage=0), param_groups=user_groups(model),
                      optimizer=OptimizerSpec("adamw", lr=1e-3, weight_decay=0.3))
    groups = zero.optimizer.param_groups
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(2e-2, 0.1), (5e-3, 0.05)]
    assert sorted(g.weight_decay for g in zero.flat_groups) == [0.05, 0.1]  # biases included
    assert [len(g["params"]) for g in groups] == [1, 1]  # one master shard per group
    default = build_zero(MLP(), ZeroConfig(zero_stage=0),
                         optimizer=OptimizerSpec("adamw", weight_decay=0.3))
    assert [g["weight_decay"] for g in default.optimizer.param_groups] == [0.3]  # one group


def test_lamb_matches_deepspeed_formulas_on_hand_computed_steps():
    eps = 1e-8
    w = torch.tensor([3.0, 4.0], requires_grad=True)  # ||w|| = 5
    big = torch.tensor([300.0, 400.0], requires_grad=True)
    zero_w = torch.zeros(2, requires_grad=True)
    opt = Lamb([w, big, zero_w], lr=0.1, eps=eps)
    for p in (w, big, zero_w):
        p.grad = torch.tensor([1.0, -1.0])
    opt.step()
    # step 1 with bias correction: m_hat = g, v_hat = g^2, u = g / (|g| + eps)
    u = torch.tensor([1.0, -1.0]) / (1 + eps)
    ratio = 5.0 / u.norm().item()
    torch.testing.assert_close(w.detach(), torch.tensor([3.0, 4.0]) - 0.1 * ratio * u)
    torch.testing.assert_close(big.detach(), torch.tensor([300.0, 400.0]) - 0.1 * 10.0 * u)
    torch.testing.assert_close(zero_w.detach(), -0.1 * 1.0 * u)  # ||w|| = 0: ratio 1
    # eps inside the square root, no bias correction, weight decay in the update
    p = torch.tensor([1.0, 2.0], requires_grad=True)
    opt = Lamb([p], lr=0.5, betas=(0.5, 0.75), eps=0.01, eps_inside_sqrt=True,
               bias_correction=False, weight_decay=0.2)
    p.grad = torch.tensor([2.0, 0.0])
    opt.step()
    m, v = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])
    upd = m / (v + 0.01).sqrt() + 0.2 * torch.tensor([1.0, 2.0])
    r = min(max(math.sqrt(5.0) / upd.norm().item(), 0.01), 10.0)
    torch.testing.assert_close(p.detach(), torch.tensor([1.0, 2.0]) - 0.5 * r * upd)


def test_lamb_alone_matches_the_reference_lamb():
    ref = reference(CASES["lamb"][1], grouped=True, steps=6)
    model = MLP()
    opt = Lamb(user_groups(model), lr=1e-2, weight_decay=0.01, min_coeff=0.05, max_coeff=5.0)
    for x, y in data(6):
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    assert_matches(dict(model.named_parameters()), ref, "Lamb alone")


def _adopted(rank, world):
    out = {}
    for stage in (0, 1, 3):
        model = MLP()
        opt = torch.optim.AdamW(user_groups(model), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        zero = build_zero(model, ZeroConfig(zero_stage=stage, reduce_bucket_size=BUCKET),
                          optimizer=opt)
        masters = sorted(id(g.master) for g in zero.flat_groups)
        out[stage] = {"same_object": zero.optimizer is opt,
                      "params_are_masters": sorted(id(p) for g in opt.param_groups
                                                   for p in g["params"]) == masters,
                      "params": train(rank, world, model, zero, scheduler=sched),
                      "lrs": [g["lr"] for g in opt.param_groups]}
    model = MLP()
    ada = torch.optim.Adagrad(model.parameters(), lr=5e-2, initial_accumulator_value=0.1)
    out["adagrad"] = train(rank, world, model, build_zero(
        model, ZeroConfig(zero_stage=2, reduce_bucket_size=BUCKET), optimizer=ada))
    model = MLP()
    factory = lambda groups: torch.optim.SGD(groups, lr=5e-2, momentum=0.9)  # noqa: E731
    out["factory"] = train(rank, world, model, build_zero(
        model, ZeroConfig(zero_stage=1, reduce_bucket_size=BUCKET), optimizer=factory))
    return out


def test_adopted_torch_optimizer_keeps_its_identity_and_its_scheduler_drives_the_shards():
    steplr = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa
    ref = reference(lambda g: torch.optim.AdamW(g, lr=1e-2), grouped=True, scheduler=steplr)
    results = run_on_ranks(_adopted, 2)
    for rank, res in enumerate(results):
        for stage in (0, 1, 3):
            r = res[stage]
            assert r["same_object"] and r["params_are_masters"]
            assert r["lrs"] == [2e-2 * 0.5 ** STEPS, 5e-3 * 0.5 ** STEPS]
            assert_matches(r["params"], ref, f"adopted AdamW + StepLR stage {stage} rank {rank}")
        assert_matches(res["adagrad"], reference(
            lambda g: torch.optim.Adagrad(g, lr=5e-2, initial_accumulator_value=0.1), False),
            "adopted Adagrad")
        assert_matches(res["factory"], reference(
            lambda g: torch.optim.SGD(g, lr=5e-2, momentum=0.9), False), "factory SGD")


def _lamb_collectives(rank, world):
    """all_reduce calls inside step(): the grad norm's, plus Lamb's one for its norms."""
    from gigatron.parallel import comm
    calls = {}
    for stage in (0, 1, 3):
        for name in ("adamw", "lamb"):
            model = MLP()
            zero = build_zero(model, ZeroConfig(zero_stage=stage, reduce_bucket_size=BUCKET),
                              param_groups=user_groups(model), optimizer=CASES[name][0])
            zero.backward(loss_fn(model, *data(1)[0]))
            zero.finish_sync()
            comm.stats.reset()
            zero.step()
            calls[(stage, name)] = comm.stats.calls.get("all_reduce", 0)
    return calls


def test_lamb_sums_its_norms_in_one_all_reduce_per_step_only_when_parameters_are_sharded():
    calls = run_on_ranks(_lamb_collectives, 2)[0]
    assert calls[(0, "lamb")] == calls[(0, "adamw")] == 1  # stage 0: whole params everywhere
    for stage in (1, 3):
        assert calls[(stage, "lamb")] == calls[(stage, "adamw")] + 1


def _refresh(rank, world):
    out = {}
    for stage in (0, 1, 2):
        model = MLP()
        zero = build_zero(model, ZeroConfig(zero_stage=stage, reduce_bucket_size=BUCKET),
                          optimizer=OptimizerSpec("sgd", lr=0.0))
        model.load_state_dict(MLP(seed=5).state_dict())  # weights only, in place
        zero.refresh_master_from_params()
        out[stage] = train(rank, world, model, zero, steps=1)
    return out


def test_weights_loaded_into_the_module_survive_the_next_step_after_refresh_master():
    want = dict(MLP(seed=5).named_parameters())
    for res in run_on_ranks(_refresh, 2):
        for stage in (0, 1, 2):
            assert_matches(res[stage], {n: p.detach() for n, p in want.items()},
                           f"refreshed stage {stage}")


def test_set_lr_sets_every_group_times_its_lr_mult_and_nothing_else():
    model = MLP()
    groups = user_groups(model)
    groups[1]["lr_mult"] = 0.5
    zero = build_zero(model, ZeroConfig(zero_stage=1), param_groups=groups,
                      optimizer=OptimizerSpec("adamw"))
    zero.set_lr(1.0)
    assert [(g["lr"], g["weight_decay"]) for g in zero.optimizer.param_groups] == \
        [(1.0, 0.1), (0.5, 0.05)]
    megatron = build_zero(MLP(), ZeroConfig(zero_stage=1, lr=1e-3))
    megatron.set_lr(3e-4)
    assert {g["lr"] for g in megatron.optimizer.param_groups} == {3e-4}


def test_frozen_parameters_in_a_group_are_skipped_and_stay_unchanged():
    model = MLP()
    model.layers[0].bias.requires_grad_(False)
    before = model.layers[0].bias.detach().clone()
    zero = build_zero(model, ZeroConfig(zero_stage=1), param_groups=user_groups(model),
                      optimizer=OptimizerSpec("sgd", lr=0.1))
    assert all(p is not model.layers[0].bias for g in zero.flat_groups for p in g.params)
    train(0, 1, model, zero, steps=2)
    assert torch.equal(model.layers[0].bias, before)


def test_specs_build_what_deepspeed_builds_including_the_readers_extra_params():
    one = [{"params": [torch.zeros(2)]}]
    lamb = build_optimizer(OptimizerSpec("lamb", extra={"bias_correction": False,
                                                        "eps_inside_sqrt": True}), one)
    assert isinstance(lamb, Lamb) and lamb.defaults["eps_inside_sqrt"]
    adam = build_optimizer(OptimizerSpec("adam", adam_w_mode=False, weight_decay=0.1,
                                         extra={"amsgrad": True, "bias_correction": True,
                                                "fp32_optimizer_states": False}), one)
    assert type(adam) is torch.optim.Adam and adam.defaults["amsgrad"]
    assert adam.defaults["weight_decay"] == 0.1
    assert type(build_optimizer(OptimizerSpec("adamw", adam_w_mode=False), one)) is \
        torch.optim.AdamW  # "AdamW" is decoupled whatever adam_w_mode says (DeepSpeed)
    assert type(build_optimizer(OptimizerSpec("Adam"), one)) is torch.optim.AdamW
    sgd = build_optimizer(OptimizerSpec("sgd", momentum=0.9, dampening=0.1,
                                        extra={"maximize": True}), one)
    assert (sgd.defaults["dampening"], sgd.defaults["maximize"]) == (0.1, True)
    legacy = spec_from_zero_config(ZeroConfig(optimizer="adam"))
    assert legacy.type == "adam" and not legacy.adam_w_mode  # torch.optim.Adam, as before


@pytest.mark.parametrize("make, error, words", [
    (lambda: _build(OptimizerSpec("lamb", extra={"max_grad_norm": 1.0})), ValueError,
     "gradient_clipping"),
    (lambda: _build(OptimizerSpec("rmsprop")), ValueError, "'rmsprop' is not supported"),
    (lambda: _build(OptimizerSpec("adam", lr=-1.0, eps=-1.0)), ValueError,
     "lr must be >= 0, got -1.0\noptimizer.params.eps must be >= 0"),
    (lambda: _build(OptimizerSpec("adamw", betas=(0.9, 1.0))), ValueError, "betas must be"),
    (lambda: _build(OptimizerSpec("sgd", nesterov=True)), ValueError,
     "nesterov needs momentum > 0"),
    (lambda: _build(OptimizerSpec("lamb", min_coeff=2.0, max_coeff=1.0)), ValueError,
     "0 < min_coeff <= max_coeff"),
    (lambda: _build(OptimizerSpec("sgd", extra={"bogus": 1})), ValueError, "bogus"),
    (lambda: _build(OptimizerSpec("lamb", extra={"amsgrad": True})), ValueError, "AMSGrad"),
    (lambda: _build("adam"), TypeError, "must be an OptimizerSpec, a torch.optim.Optimizer"),
    (lambda: _build(lambda groups: "x"), TypeError, "returned str"),
    (lambda: _build(lambda groups: torch.optim.SGD([torch.zeros(1)], lr=1)), ValueError,
     "exactly the param groups"),
    (lambda: _build(OptimizerSpec("sgd"), [{"lr": 1.0}]), ValueError, "no 'params' key"),
    (lambda: _build(OptimizerSpec("sgd"), []), ValueError, "holds no parameter"),
    (lambda: _build(OptimizerSpec("sgd"), "own"), ValueError, "in param group 0 and again"),
    (lambda: _build(OptimizerSpec("sgd"), [nn.Parameter(torch.zeros(2))]), ValueError,
     "not a parameter of the model ZeRO wraps"),
    (lambda: _build(OptimizerSpec("sgd"), "mix"), TypeError, "not a mix"),
    (lambda: _build("sgd over all", "head"), ValueError, "hold different parameters"),
])
def test_clear_errors_for_unknown_types_and_bad_values(make, error, words):
    with pytest.raises(error) as info:
        make()
    assert words in str(info.value)


def _build(optimizer, param_groups=None):
    model = MLP()
    if param_groups == "own":
        param_groups = [{"params": [model.head.weight]}, {"params": [model.head.weight]}]
    elif param_groups == "mix":
        param_groups = [model.head.weight, {"params": [model.head.bias]}]
    elif param_groups == "head":
        param_groups = [model.head.weight]
    if optimizer == "sgd over all":  # a user's optimizer over more than param_groups
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return build_zero(model, ZeroConfig(zero_stage=1), param_groups=param_groups,
                      optimizer=optimizer)
