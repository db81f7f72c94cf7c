"""gigatron plan's memory: model state equals what ZeRO holds, activations what autograd keeps.

Model state (parameters, gradients, master weights, optimizer state) must equal, byte for
byte, what `measure_memory` reports on every rank after an optimizer step, for tp/pp/dp/ZeRO
layouts of the tiny GPT on forked gloo ranks (padding of buckets to the dp size included).

Activations are measured on the CPU as the bytes of distinct tensor storages that autograd
keeps for backward (every saved tensor goes through `saved_tensors_hooks`, held weakly, so
a storage counts only while some graph node still holds it; parameters excluded), at the
high point of the stage's schedule: after the forwards of the micro-batches its schedule
has in flight (1F1B: p on the first stage), before any backward. The prediction must be
within 10% of that (it is within 1% on these configurations).

Through a real pipeline step (pp 2 on forked gloo ranks, every schedule: 1f1b, interleaved,
zb-h1, zb-h1 under full recomputation, zbv) the same measure is read after every forward, B
and W, with the W stashes the executor's weight-gradient queues keep (a split backward frees
the activations at B, then holds its linears' inputs and output gradients until W): the
plan's activations must be within 10% of the most held at once (within 0.05% measured; the
plan that held whole activations until W was 32% over at zb-h1's last stage and 83% under
with full recomputation).
"""
import contextlib
import gc
import os
import sys

import pytest
import torch

from multirank import run_on_ranks

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.models.pipeline_chunks import build_model_chunks
from gigatron.parallel.comm import ShapeOnlyGroup
from gigatron.parallel.pipeline.partition import partition_layers
from gigatron.parallel.zero.param_groups import param_kind
from gigatron.training.plan.memory import activation_terms, chunk_activations, stage_memory
from gigatron.training.plan.parameters import stage_parameters

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")

TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 100 --make-vocab-size-divisible-by 8 "
        "--micro-batch-size 2 --lr 1e-3 --train-iters 1 --mock-data").split()


def _run(argv, world):
    """The run's config, built from the flags; the tests that fork ranks build it before
    forking, each rank building it (its flag parser first) cost ~0.03 CPU-s."""
    from gigatron.training.config.arguments import build_run_config, parse_flags

    return build_run_config(parse_flags(argv), world)


@pytest.mark.parametrize("kw,pp,v", [
    ({}, 1, None), ({}, 2, None), ({}, 2, 1),
    ({"untie_embeddings_and_output_weights": True, "sequence_parallel": True}, 2, None),
    ({"sequence_parallel": True}, 4, 1),
    ({"activation": "swiglu", "normalization": "RMSNorm", "position_embedding_type": "rope",
      "add_bias_linear": False, "num_query_groups": 2}, 2, 1)])
@pytest.mark.parametrize("tp", [1, 2])
def test_parameter_lists_equal_the_built_models(kw, pp, v, tp):
    """The planner's lists (one cached layer per chunk, repeated) equal whole chunks built
    on meta at that tp size, every tp rank and pipeline rank."""
    c = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=100,
                          make_vocab_size_divisible_by=8, seq_length=16, **kw)
    part = partition_layers(4, pp, num_layers_per_virtual_stage=v)
    for rank in range(pp):
        listed = [[(s.name, s.shape, s.kind) for s in specs]
                  for specs in stage_parameters(c, tp, part, rank)]
        for tp_rank in range(tp):
            chunks = build_model_chunks(c, part, rank, ShapeOnlyGroup(tp, tp_rank),
                                        device=torch.device("meta"))
            built = [[(n, tuple(p.shape), param_kind(p)) for n, p in m.named_parameters()]
                     for m in chunks]
            assert listed == built


def _measure_state(rank, world, run):
    from gigatron.parallel.topology import ProcessGroups, Topology
    from gigatron.parallel.zero import build_zero
    from gigatron.parallel.zero.accounting import measure_memory
    from gigatron.training.run import builders

    p = run.parallel
    groups = ProcessGroups(Topology(tp=p.tp, dp=p.dp, pp=p.pp), rank)
    chunks = builders.build_model_chunks(run, groups, torch.device("cpu"))
    zero = build_zero(chunks, run.zero, groups)
    zero.zero_grad()
    zero.finish_sync()
    zero.step()  # creates the optimizer state
    measured = measure_memory(zero)
    planned = stage_memory(run.model, builders.partition(run), groups.index("pp"), p.tp, p.dp,
                           run.zero, run.train.micro_batch_size, run.train.num_microbatches,
                           on_gpu=False).state
    return ((measured.params, measured.grads, measured.master_params,
             measured.optimizer_state),
            (planned.params, planned.grads, planned.master_params, planned.optimizer_state))


LAYOUTS = [  # (world, extra flags)
    (4, ["--tensor-model-parallel-size", "2", "--zero-stage", "0"]),
    (4, ["--tensor-model-parallel-size", "2", "--zero-stage", "1", "--bf16"]),
    (4, ["--tensor-model-parallel-size", "2", "--zero-stage", "2", "--sequence-parallel"]),
    (4, ["--tensor-model-parallel-size", "2", "--zero-stage", "3", "--ddp-bucket-size", "700"]),
    (3, ["--zero-stage", "3", "--bf16"]),
    (4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--ddp-bucket-size",
         "500"]),
    (4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "2",
         "--untie-embeddings-and-output-weights", "--optimizer", "sgd", "--sgd-momentum",
         "0.9"]),
    (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8",
         "--use-distributed-optimizer", "--bf16"]),
]


@pytest.mark.parametrize("world,extra", LAYOUTS, ids=[" ".join(e) for _, e in LAYOUTS])
def test_model_state_bytes_equal_measure_memory_on_every_rank(world, extra):
    for rank, (measured, planned) in enumerate(run_on_ranks(_measure_state, world,
                                                            _run(TINY + extra, world))):
        assert planned == measured, f"rank {rank}: planned {planned}, measured {measured}"


@contextlib.contextmanager
def gc_frozen():
    """The measure's gc.collect() (held_activation_bytes' own) walks only the objects made
    inside: those alive before are frozen meanwhile (gc.freeze; forked ranks freeze what they
    inherit themselves: multirank). A full collection of the test process's heap (torch and
    ~200 gigatron modules) cost 0.2-0.4 CPU-s each time; the bytes held are the same
    (compared on every configuration here and in test_plan_mla_mtp.py)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _held_activation_bytes(model, forward):
    """Bytes of distinct storages autograd keeps after `forward()` (see module doc): the
    measure bench/bench_context_parallel.py uses."""
    sys.path.insert(0, BENCH_DIR)
    try:
        from bench_context_parallel import held_activation_bytes
    finally:
        sys.path.remove(BENCH_DIR)
    with gc_frozen():
        return held_activation_bytes(model, forward)[0]


CONFIGS = [
    {}, {"attention_backend": "unfused"}, {"hidden_dropout": 0.0, "attention_dropout": 0.0},
    {"params_dtype": torch.bfloat16}, {"params_dtype": torch.bfloat16,
                                       "attention_backend": "unfused"},
    {"recompute_granularity": "selective"},
    {"recompute_granularity": "full", "recompute_method": "uniform",
     "recompute_num_layers": 2},
    {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    {"activation": "swiglu", "normalization": "RMSNorm", "position_embedding_type": "rope",
     "add_bias_linear": False, "num_query_groups": 2},
]


@pytest.mark.parametrize("kw", CONFIGS, ids=[str(sorted(k.items())) for k in CONFIGS])
def test_activation_prediction_within_10_percent_of_what_autograd_keeps(kw):
    s, b, h, vocab, layers = 64, 2, 64, 256, 3
    c = TransformerConfig(num_layers=layers, hidden_size=h, num_attention_heads=4,
                          vocab_size=vocab, make_vocab_size_divisible_by=8, seq_length=s,
                          max_position_embeddings=s, **kw)
    model = GPTModel(c).train()
    ids = torch.randint(0, vocab, (b, s))
    measured = _held_activation_bytes(model, lambda: model(input_ids=ids, labels=ids))
    predicted, _ = chunk_activations(c, activation_terms(c, 1, on_gpu=False), layers,
                                     True, True, s * b)
    assert abs(predicted / measured - 1) < 0.10, (predicted, measured)


def test_first_stage_of_1f1b_holds_pp_microbatches_within_10_percent():
    argv = TINY + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                   "--hidden-size", "64", "--seq-length", "64",
                   "--max-position-embeddings", "64"]
    run = _run(argv, 2)
    part = partition_layers(4, 2)
    (chunk,) = build_model_chunks(run.model, part, 0)
    chunk.train()
    planned = stage_memory(run.model, part, 0, 1, 1, run.zero, 2, 4, on_gpu=False)
    assert planned.in_flight == [2]  # p micro-batches before the first backward
    ids = [torch.randint(0, 100, (2, 64)) for _ in range(2)]
    measured = _held_activation_bytes(chunk, lambda: [chunk(input_ids=x) for x in ids])
    assert abs(planned.activations / measured - 1) < 0.10, (planned.activations, measured)


PIPELINE_TINY = TINY + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                        "--hidden-size", "64", "--seq-length", "64",
                        "--max-position-embeddings", "64"]
SCHEDULES = {  # at pp 2, 4 micro-batches; zb-h1 also with full recomputation (stash >> held)
    "1f1b": [],
    "interleaved": ["--num-layers-per-virtual-pipeline-stage", "1"],
    "zb-h1": ["--pipeline-schedule", "zb-h1"],
    "zb-h1-recompute-full": ["--pipeline-schedule", "zb-h1", "--recompute-granularity", "full",
                             "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "zbv": ["--pipeline-schedule", "zbv", "--num-layers-per-virtual-pipeline-stage", "1",
            "--untie-embeddings-and-output-weights"],
}


def _schedule_peak(rank, world, run):
    """(the plan's activations of this stage, the most bytes the executor's step held at
    once: saved tensors and W stashes, read after every forward, B and W)."""
    sys.path.insert(0, BENCH_DIR)
    try:
        from bench_context_parallel import HeldActivations
    finally:
        sys.path.remove(BENCH_DIR)
    from gigatron.parallel.topology import ProcessGroups, Topology
    from gigatron.training.run import builders

    p, t = run.parallel, run.train
    groups = ProcessGroups(Topology(pp=p.pp), rank)
    chunks = builders.build_model_chunks(run, groups, torch.device("cpu"))
    for chunk in chunks:
        chunk.train()
    pipeline = builders.build_pipeline(run, groups, chunks, None, torch.device("cpu"))
    executor, tracker, peak = pipeline.executor, HeldActivations(torch.nn.ModuleList(chunks)), [0]

    def sampled(step):
        def run_and_sample(*args):
            step(*args)
            stash = [x for q in executor._queues.values() for x in q.held_tensors()]
            peak[0] = max(peak[0], tracker.bytes(stash))
        return run_and_sample

    for name in ("_forward", "_backward", "_weight_grad"):  # the executor's compute steps
        setattr(executor, name, sampled(getattr(executor, name)))
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 100, (2, 65), generator=gen) for _ in range(4)]
    batches = [{"input_ids": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(2, 64)}
               for x in tokens]
    with tracker.recording():
        executor.run(pipeline.train_schedule, batches)
    planned = stage_memory(run.model, builders.partition(run), rank, 1, 1, run.zero,
                           t.micro_batch_size, t.num_microbatches, on_gpu=False,
                           schedule=p.pipeline_schedule)
    return planned.activations, peak[0]


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_activation_peak_within_10_percent_of_what_the_executor_holds(name):
    """Every stage, every schedule: the plan's activations at the schedule's high point
    against the most bytes the executor's real step keeps at once (split backwards: the
    activations until B, then the W stash until W)."""
    run = _run(PIPELINE_TINY + SCHEDULES[name], 2)
    for rank, (planned, measured) in enumerate(run_on_ranks(_schedule_peak, 2, run)):
        assert abs(planned / measured - 1) < 0.10, (rank, planned, measured)
