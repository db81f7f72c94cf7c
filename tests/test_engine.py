"""gigatron.initialize trains a user's model exactly as a plain PyTorch loop does.

For ZeRO 0-3 x fp32/bf16 x gradient accumulation 1 and 4, on 1, 2 and 4 forked CPU ranks,
a small MLP (and a small transformer) trained by the engine gives the per-step losses and
final parameters of a single-process torch loop over the same global batch.
The optimizer is SGD with momentum (its update is proportional to the gradient, so a
wrongly scaled or averaged gradient shows) for the MLP, AdamW for the transformer in fp32.
bf16 uses SGD for both: its reference is the same loop in mixed precision (bf16 parameters
and gradients, fp32 master weights stepped by the optimizer), and Adam's normalised update
would turn the bf16 rounding of near-zero gradients into full-size differences.
Tolerances: fp32 1e-5 (only the order of float additions differs); bf16 1e-2 relative on
losses and 2e-3 absolute on parameters after 3 steps (micro-batch vs whole-batch rounding).

The 2- and 4-rank runs of all 32 configurations happen in one forked world per size (a
module fixture): a world per test and size cost 25 CPU-s of ranks, the two shared ones 17.
The 1-rank runs stay in each test, in this process.
"""
import functools
import itertools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from multirank import RankError, RanksTimedOut, run_on_ranks

STEPS = 3
MICRO = 2
LR = 1e-2


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 4))


class TinyTransformer(nn.Module):
    """Embedding, two pre-norm encoder layers, a head: a small transformer classifier."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        # no biases in the layers: the attention's key bias has a zero gradient (softmax
        # ignores a shift shared by a row), so Adam would amplify float noise into updates
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(
            16, 2, 32, dropout=0.0, batch_first=True, norm_first=True, bias=False)
            for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.view(x.shape[0], 2, 4).repeat(1, 1, 2))
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))


MODELS = {"mlp": mlp, "transformer": TinyTransformer}


def data(global_batch: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, global_batch, 8, generator=g)
    y = torch.randint(0, 4, (STEPS, global_batch), generator=g)
    return x, y


def optimizer_of(model_name: str, precision: str) -> str:
    return "AdamW" if model_name == "transformer" and precision == "fp32" else "SGD"


def torch_optimizer(name: str, params):
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    return torch.optim.SGD(params, lr=LR * 10, momentum=0.9, weight_decay=0.01)


def ds_config(stage: int, precision: str, gas: int, world: int, optimizer: str) -> dict:
    params = ({"lr": LR, "weight_decay": 0.01} if optimizer == "AdamW" else
              {"lr": LR * 10, "momentum": 0.9, "weight_decay": 0.01})
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
              "train_batch_size": MICRO * gas * world, "steps_per_print": 1000,
              "optimizer": {"type": optimizer, "params": params},
              "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 64}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


@functools.lru_cache(maxsize=None)  # one per (model, global batch, precision): all stages
def reference(model_name: str, global_batch: int, precision: str):
    """The plain PyTorch loop: one forward over the global batch per step (in bf16: bf16
    parameters and gradients, the optimizer stepping fp32 master copies)."""
    model = MODELS[model_name]()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    masters = [p.detach().clone() for p in model.parameters()]
    model.to(dtype)
    opt = torch_optimizer(optimizer_of(model_name, precision), masters)
    x, y = data(global_batch)
    losses = []
    for step in range(STEPS):
        model.zero_grad()
        loss = F.cross_entropy(model(x[step].to(dtype)).float(), y[step])
        loss.backward()
        for master, p in zip(masters, model.parameters()):
            master.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        with torch.no_grad():
            for master, p in zip(masters, model.parameters()):
                p.copy_(master)
        losses.append(loss.item())
    return losses, {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def train_with_engine(rank, world, model_name, stage, precision, gas):
    import gigatron

    config = ds_config(stage, precision, gas, world, optimizer_of(model_name, precision))
    engine, _, _, _ = gigatron.initialize(model=MODELS[model_name](), config=config)
    x, y = data(MICRO * gas * world)
    mine = slice(rank * MICRO * gas, (rank + 1) * MICRO * gas)
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        xs, ys = x[step][mine].split(MICRO), y[step][mine].split(MICRO)
        for xb, yb in zip(xs, ys):
            loss = F.cross_entropy(engine(xb.to(engine.dtype)).float(), yb)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        torch.distributed.all_reduce(total) if world > 1 else None
        losses.append(total.item() / (world * gas))
    assert engine.global_steps == STEPS and engine.micro_steps == STEPS * gas
    return losses, {k: v.float() for k, v in engine.module_state_dict().items()}


MODEL_NAMES, PRECISIONS, GAS, STAGES = list(MODELS), ["fp32", "bf16"], [1, 4], [0, 1, 2, 3]
CONFIGS = list(itertools.product(MODEL_NAMES, STAGES, PRECISIONS, GAS))


def train_every_config(rank, world):
    return {config: train_with_engine(rank, world, *config) for config in CONFIGS}


@pytest.fixture(scope="module")
def shared_worlds():
    """{world size: each rank's {config: results}}, or the error that ended that world; then
    each test runs its own world of that size, to fail alone and with its own traceback."""
    worlds = {}
    for world in (2, 4):
        try:
            worlds[world] = run_on_ranks(train_every_config, world, timeout=600)
        except (RankError, RanksTimedOut) as err:
            worlds[world] = err
    return worlds


def _run(model_name, stage, precision, gas, world):
    if world == 1:
        os.environ.pop("RANK", None)
        return [train_with_engine(0, 1, model_name, stage, precision, gas)]
    return run_on_ranks(train_with_engine, world, model_name, stage, precision, gas,
                        timeout=120)


def _compare(results, model_name, precision, gas, world):
    ref_losses, ref_params = reference(model_name, MICRO * gas * world, precision)
    rtol, atol = (1e-5, 1e-5) if precision == "fp32" else (1e-2, 2e-3)
    for rank, (losses, params) in enumerate(results):
        assert losses == pytest.approx(ref_losses, rel=rtol, abs=atol), (rank, losses,
                                                                         ref_losses)
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("gas", GAS)
@pytest.mark.parametrize("stage", STAGES)
def test_user_model_trains_like_a_plain_torch_loop_on_1_2_and_4_ranks(shared_worlds, stage, gas,
                                                                      precision, model_name):
    config = (model_name, stage, precision, gas)
    for world in (1, 2, 4):
        shared = shared_worlds.get(world)
        if isinstance(shared, list):
            results = [ranks[config] for ranks in shared]
        else:
            results = _run(*config, world)
        _compare(results, model_name, precision, gas, world)
