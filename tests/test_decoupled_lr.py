"""--decoupled-lr / --decoupled-min-lr: the word embedding and the output layer train with
their own lr, on the same schedule shape (Megatron-Core's OptimizerParamScheduler.get_lr with
the group's max_lr/min_lr), every ZeRO stage honouring it."""
import math

import pytest
import torch

from multirank import run_on_ranks

from gigatron.models.gpt import GPTModel
from gigatron.parallel.zero.param_groups import DECOUPLED_ATTR, megatron_param_groups
from gigatron.training.config.arguments import parse_args
from gigatron.training.run.builders import build_optimizer, mark_embedding_and_output
from gigatron.training.run.decoupled_lr import set_decoupled_lr
from gigatron.training.lr.megatron import learning_rate

LR, MIN_LR, DLR, DMIN = 1e-3, 1e-4, 5e-3, 4.5e-4
ITERS, GBS, WARMUP = 8, 4, 2
ARGV = (f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        f"--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size {GBS} "
        f"--train-iters {ITERS} --lr {LR} --min-lr {MIN_LR} --decoupled-lr {DLR} "
        f"--decoupled-min-lr {DMIN} --lr-decay-style cosine --lr-warmup-iters {WARMUP} "
        f"--lr-warmup-init 1e-5 --mock-data --vocab-size 64 --disable-bias-linear "
        f"--hidden-dropout 0 --attention-dropout 0 --clip-grad 0").split()


def megatron_lr(step, max_lr, min_lr, warmup=WARMUP * GBS, decay=ITERS * GBS, init=1e-5):
    """Megatron-Core's OptimizerParamScheduler.get_lr (cosine), written out."""
    if warmup > 0 and step <= warmup:
        return init + (max_lr - init) * step / warmup
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def set_lrs(zero, run, iteration):
    """What the training loop does before iteration `iteration` (1-based)."""
    step = (iteration - 1) * GBS
    zero.set_lr(learning_rate(step, run.lr_schedule))
    set_decoupled_lr(zero.optimizer, step, run.lr_schedule, run.settings.decoupled_lr)


def _model(run, **kw):
    model = GPTModel(run.model, seed=11, **kw)
    mark_embedding_and_output([model])
    return model


@pytest.mark.parametrize("untie", [True, False])
def test_embedding_and_output_groups_follow_megatrons_formula_step_by_step(untie):
    run = parse_args(ARGV + (["--untie-embeddings-and-output-weights"] if untie else []), 1)
    model = _model(run)
    zero = build_optimizer(run, [model], None)
    decoupled = {id(p) for g in zero.user_groups if g.options["is_decoupled_lr"]
                 for p in g.params}
    want = {id(model.embedding.word_embeddings.weight)}
    if untie:
        want.add(id(model.output_layer.weight))
    assert decoupled == want  # tied: the one shared weight; never the position embedding
    seen = set()
    for it in range(1, ITERS + 3):  # past the decay too: min lrs
        set_lrs(zero, run, it)
        step = (it - 1) * GBS
        for group in zero.optimizer.param_groups:
            special = group["is_decoupled_lr"]
            expected = megatron_lr(step, DLR, DMIN) if special else megatron_lr(step, LR, MIN_LR)
            assert group["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15), (it, special)
            seen.add(special)
    assert seen == {True, False}


def test_decoupled_min_lr_defaults_to_min_lr_and_nothing_changes_without_decoupled_lr():
    argv = [a for a in ARGV if a not in ("--decoupled-min-lr", str(DMIN))]
    run = parse_args(argv, 1)
    zero = build_optimizer(run, [_model(run)], None)
    set_lrs(zero, run, ITERS + 2)
    assert {g["lr"] for g in zero.optimizer.param_groups if g["is_decoupled_lr"]} == {MIN_LR}
    plain = parse_args([a for a in argv if a not in ("--decoupled-lr", str(DLR))], 1)
    zero = build_optimizer(plain, [_model(plain)], None)
    assert zero.user_groups is None  # Megatron's own grouping, untouched
    set_lrs(zero, plain, 3)
    assert {g["lr"] for g in zero.optimizer.param_groups} == {learning_rate(8, plain.lr_schedule)}


def test_pipeline_stages_tag_the_weight_they_hold():
    run = parse_args(ARGV, 1)  # tied embeddings
    first, last = _model(run, post_process=False), _model(run, pre_process=False)
    assert getattr(first.embedding.word_embeddings.weight, DECOUPLED_ATTR)
    assert getattr(last.output_layer.weight, DECOUPLED_ATTR)  # the embedding's copy
    groups = megatron_param_groups([first], 0.1, decoupled=True)
    assert [(g["is_decoupled_lr"], g["weight_decay"], len(g["params"])) for g in groups] == \
        [(False, 0.0, 8), (False, 0.1, 9), (True, 0.1, 1)]  # norms; linears + positions


def _batches(seed=5):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 64, (ITERS, GBS, 17), generator=g)
    return t[..., :-1], t[..., 1:]


def reference(run, decoupled=(DLR, DMIN)):
    """Single-device torch AdamW on the full batch, the embedding and output weights with
    the `decoupled` (max, min) lrs, every other parameter with (--lr, --min-lr)."""
    model = _model(run)
    wd = run.zero.weight_decay
    opt = torch.optim.AdamW([
        {"params": [p], "weight_decay": wd if p.dim() >= 2 else 0.0,
         "special": bool(getattr(p, DECOUPLED_ATTR, False))} for p in model.parameters()])
    tokens, labels = _batches()
    for it in range(ITERS):
        for group in opt.param_groups:
            group["lr"] = megatron_lr(it * GBS, *(decoupled if group["special"]
                                                  else (LR, MIN_LR)))
        opt.zero_grad()
        model(input_ids=tokens[it], labels=labels[it]).mean().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _dp2(rank, world):
    from gigatron.parallel.topology import ProcessGroups, Topology
    groups = ProcessGroups(Topology(dp=2), rank)
    tokens, labels = _batches()
    half = slice(rank * 2, rank * 2 + 2)
    out = {}
    for stage in range(4):
        run = parse_args(ARGV + ["--untie-embeddings-and-output-weights", "--zero-stage",
                                 str(stage)], 2)
        model = _model(run)
        zero = build_optimizer(run, [model], groups)
        for it in range(ITERS):
            set_lrs(zero, run, it + 1)
            zero.zero_grad()
            zero.backward(model(input_ids=tokens[it][half], labels=labels[it][half]).mean())
            assert zero.step().success
        with zero.gathered_parameters():
            out[stage] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def test_zero_stages_0_to_3_on_dp2_honour_the_decoupled_lr():
    """Tolerance 1e-5 relative (L2) per parameter, as tests/test_zero_gpt.py: dp sums the
    grads in another order, which Adam turns into ~1e-6 moves of near-zero-grad elements.
    The embedding and output weights' lr is 5x --lr here, so a stage that used --lr for them
    would miss by far more (checked: the reference with one lr differs by > 1e-2)."""
    run = parse_args(ARGV + ["--untie-embeddings-and-output-weights"], 1)
    ref = reference(run)
    for rank_out in run_on_ranks(_dp2, 2):
        for stage, params in rank_out.items():
            for name, want in ref.items():
                err = ((params[name] - want).norm() / want.norm()).item()
                assert err <= 1e-5, f"stage {stage} {name}: {err:.3g}"
    plain = reference(run, decoupled=(LR, MIN_LR))
    name = "embedding.word_embeddings.weight"
    assert ((plain[name] - ref[name]).norm() / ref[name].norm()).item() > 1e-2
