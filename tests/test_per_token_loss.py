"""--calculate-per-token-loss: one training step (the loop's own `train_step`, through the
run's builders) equals a single-device reference computed by hand on the global batch, with
loss masks that keep a different number of tokens in each micro-batch (as --eod-mask-loss
does), for gradient accumulation (1 rank, 4 micro-batches), dp=2 and pp=2:

- per-token: loss = sum(loss x mask) / sum(mask) over the whole global batch;
- default (Megatron's too): the mean over micro-batches of each one's masked mean.

The two differ here (asserted), and gigatron matches the one its flags ask for. SGD without
momentum, decay or clipping, so the step moves each parameter by lr x its gradient: a wrong
normalisation shows as a wrong step. Tolerance: 1e-5 relative (L2) per parameter and on the
logged loss (fp32; dp and pp sum the same terms in another order, ~1e-7 observed).
"""
import pytest
import torch

from multirank import run_on_ranks

from gigatron.models.gpt import GPTModel
from gigatron.models.losses import loss_tokens, masked_mean_loss
from gigatron.training.config.arguments import parse_args
from gigatron.training.run.per_token_loss import EvalLoss

GLOBAL, MICRO, LR, RTOL = 8, 2, 0.5, 1e-5
BASE = (f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        f"--max-position-embeddings 16 --micro-batch-size {MICRO} --global-batch-size {GLOBAL} "
        f"--train-iters 1 --lr {LR} --optimizer sgd --sgd-momentum 0 --weight-decay 0 "
        f"--clip-grad 0 --mock-data --vocab-size 64 --hidden-dropout 0 --attention-dropout 0 "
        f"--untie-embeddings-and-output-weights --eod-mask-loss").split()
LAYOUTS = {"accumulation": (1, []), "dp2": (2, []),
           "pp2": (2, ["--pipeline-model-parallel-size", "2"])}


def micro_batches():
    """The global batch as 4 micro-batches keeping 20%, 40%, 60%, 80% of their tokens."""
    g = torch.Generator().manual_seed(9)
    out = []
    for k in range(GLOBAL // MICRO):
        tokens = torch.randint(0, 64, (MICRO, 17), generator=g)
        mask = (torch.rand(MICRO, 16, generator=g) < 0.2 * (k + 1)).float()
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
                    "position_ids": torch.arange(16).expand(MICRO, 16)})
    return out


def reference(per_token):
    """By hand on one device: the loss of the whole global batch, one SGD step."""
    run = parse_args(BASE, 1)
    model = GPTModel(run.model, seed=run.train.seed)
    batches = micro_batches()
    per_tok = [model(input_ids=b["input_ids"], labels=b["labels"]) for b in batches]
    if per_token:
        loss = sum((l * b["loss_mask"]).sum() for l, b in zip(per_tok, batches)) / \
            sum(b["loss_mask"].sum() for b in batches)
    else:
        loss = sum((l * b["loss_mask"]).sum() / b["loss_mask"].sum()
                   for l, b in zip(per_tok, batches)) / len(batches)
    loss.backward()
    return loss.item(), {n: (p - LR * p.grad).detach() for n, p in model.named_parameters()}


def _step(rank, world, extra):
    from gigatron.parallel.topology import ProcessGroups, Topology
    from gigatron.training.run import builders
    from gigatron.training.run.loop import Session, train_step
    from gigatron.training.checkpoint.orchestrator import TrainProgress
    from gigatron.training.observe.timers import Timers

    out = {}
    for per_token in (False, True):
        run = parse_args(BASE + extra + (["--calculate-per-token-loss"] if per_token else []),
                         world)
        p = run.parallel
        groups = ProcessGroups(Topology(tp=p.tp, dp=p.dp, pp=p.pp), rank)
        device = torch.device("cpu")
        chunks = builders.build_model_chunks(run, groups, device)
        zero = builders.build_optimizer(run, chunks, groups)
        pipeline = builders.build_pipeline(run, groups, chunks, zero, device)
        session = Session(run, groups, device, chunks, zero, zero, pipeline, [], None,
                          Timers(None), 0.0, None)
        n = run.train.num_microbatches
        dp = groups.index("dp")
        batches = [{k: v for k, v in b.items()
                    if (k in ("input_ids", "position_ids") and pipeline.needs_inputs) or
                    (k in ("labels", "loss_mask") and pipeline.needs_labels)}
                   for b in micro_batches()[dp * n:(dp + 1) * n]]
        outcome = train_step(session, batches, TrainProgress())
        out[per_token] = (None if outcome.loss is None else outcome.loss.item(),
                          {name: t.detach().clone() for c in chunks
                           for name, t in c.named_parameters()})
    return out


@pytest.fixture(scope="module")
def references():
    return {per_token: reference(per_token) for per_token in (False, True)}


def test_per_token_and_per_micro_batch_references_differ(references):
    (mean_loss, mean_params), (token_loss, token_params) = references[False], references[True]
    assert abs(mean_loss - token_loss) > 100 * RTOL * token_loss
    moved = max(((mean_params[n] - token_params[n]).norm() / token_params[n].norm()).item()
                for n in token_params)
    assert moved > 100 * RTOL


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_step_equals_the_hand_computed_reference(layout, references):
    world, extra = LAYOUTS[layout]
    results = run_on_ranks(_step, world, extra)
    token_loss = references[True][0]
    for per_token in (False, True):
        _, want = references[per_token]
        logged = [r[per_token][0] for r in results if r[per_token][0] is not None]
        # the loop's log line averages the last-stage ranks' shares; Megatron logs the
        # token-weighted loss whether or not the gradient is normalised per token
        assert sum(logged) / len(logged) == pytest.approx(token_loss, rel=RTOL)
        seen = set()
        for r in results:
            for name, got in r[per_token][1].items():
                err = ((got - want[name]).norm() / want[name].norm()).item()
                assert err <= RTOL, f"{layout} per_token={per_token} {name}: {err:.3g}"
                seen.add(name)
        assert seen == set(want)


def test_evaluation_is_the_ratio_over_all_its_iterations():
    """Megatron's evaluate: (sum of losses) / (sum of tokens) over every iteration, with or
    without per-token loss (then the micro-batch means are weighed by their tokens)."""
    batches = micro_batches()
    sums = [torch.tensor(3.0), torch.tensor(5.0), torch.tensor(1.0), torch.tensor(7.0)]
    tokens = [int(b["loss_mask"].sum()) for b in batches]
    terms = EvalLoss(True, None)
    terms.add(sums[:2], batches[:2])
    terms.add(sums[2:], batches[2:])
    total, steps = terms.result()
    assert steps == 1 and total.item() == pytest.approx(16.0 / sum(tokens))
    assert loss_tokens(batches).item() == sum(tokens)
    means = EvalLoss(False, None)
    means.add(sums[:2], batches[:2])
    means.add(sums[2:], batches[2:])
    total, steps = means.result()  # micro-batch means, weighed by their tokens
    weighed = sum(m.item() * n for m, n in zip(sums, tokens))
    assert steps == 1 and total.item() == pytest.approx(weighed / sum(tokens))
    assert masked_mean_loss(torch.ones(2, 16), batches[0]).item() == 1.0


def _evaluate_on_two_stages(rank, world):
    """Rank 1 (the last stage) holds 3 iterations' losses, rank 0 none: the validation loss
    every rank reports (rank 0 prints it in pretrain_gpt) must be the same ratio."""
    import types

    from gigatron.training.run.loop import mean_loss_over_ranks

    last = rank == world - 1
    session = types.SimpleNamespace(pipeline=types.SimpleNamespace(needs_labels=last),
                                    device=torch.device("cpu"))
    batches = micro_batches()
    dp_groups = [torch.distributed.new_group([r]) for r in range(world)]  # dp = 1 per stage
    terms = EvalLoss(False, dp_groups[rank])
    for it in range(3):  # 3 iterations of 2 micro-batches each
        chunk = batches[it % 2 * 2:it % 2 * 2 + 2]
        terms.add([torch.tensor(2.0 + it), torch.tensor(4.0)] if last else [], chunk)
    return mean_loss_over_ranks(session, *terms.result())


def test_every_rank_reports_the_same_validation_loss_whichever_stage_it_is():
    """(A first-stage rank once divided by its iteration count: 3x too small a loss.)"""
    batches = micro_batches()
    n = [int(b["loss_mask"].sum()) for b in batches]
    weighed = sum((2.0 + it) * n[it % 2 * 2] + 4.0 * n[it % 2 * 2 + 1] for it in range(3))
    tokens = sum(n[it % 2 * 2] + n[it % 2 * 2 + 1] for it in range(3))
    results = run_on_ranks(_evaluate_on_two_stages, 2)
    assert results[0] == results[1] == pytest.approx(weighed / tokens)
