"""Pipelined GPT equals the single-device model with gradient accumulation (forked gloo, fp32).

Tolerance: relative 1e-5 (plus an absolute 1e-7 floor for grads that are ~0) on the loss and
on every parameter's gradient; dropout 0 so both sides compute the same function.
"""
import functools
import weakref

import pytest
import torch

from multirank import run_on_ranks

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.models.losses import masked_mean_loss
from gigatron.parallel.pipeline.executor import PipelineExecutor
from gigatron.models.pipeline_chunks import GPTMicroBatchStep, build_model_chunks
from gigatron.parallel.pipeline.p2p import PipelineP2P, p2p_tensor_shape
from gigatron.parallel.pipeline.partition import partition_layers
from gigatron.parallel.pipeline.schedules import build_schedule
from gigatron.parallel import comm
from gigatron.parallel.tensor import allreduce_sequence_parallel_grads, gather_full_parameter

RTOL, ATOL = 1e-5, 1e-7
MICRO_BATCH, SEED, LR = 2, 1234, 0.1
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"


class AllReduceGradSync:
    """The executor's GradSync without overlap, for these tests: records the executor's
    enable_sync calls; finish_sync reduces, in the same order on every rank, the
    sequence-parallel grads over tp, the tied embedding's over the embedding group (summed)
    and every grad over dp (averaged)."""

    def __init__(self, params, dp_group=None, embedding_group=None, tp_group=None):
        self.params = [p for p in params if p.requires_grad]
        self.dp_group, self.embedding_group, self.tp_group = dp_group, embedding_group, tp_group
        self.enabled_calls = []  # (chunk, enabled) per backward

    def enable_sync(self, chunk, enabled):
        self.enabled_calls.append((chunk, enabled))

    def finish_sync(self):
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        allreduce_sequence_parallel_grads(self.params, self.tp_group)
        for p in self.params:
            if getattr(p, "shared_embedding", False) and \
                    comm.group_size(self.embedding_group) > 1:
                comm.all_reduce(p.grad, group=self.embedding_group)
        if comm.group_size(self.dp_group) > 1:
            for p in self.params:
                comm.all_reduce(p.grad, group=self.dp_group)
                p.grad /= comm.group_size(self.dp_group)



def p2p_for(config, micro_batch_size, pp_group=None, tp_size=1):
    """p2p buffers shaped as training builds them (training/builders.build_pipeline)."""
    shape = p2p_tensor_shape(config.seq_length, micro_batch_size, config.hidden_size, tp_size,
                             bool(config.sequence_parallel) and tp_size > 1)
    return PipelineP2P(shape, config.params_dtype, torch.device("cpu"), pp_group)

def tiny_config(sequence_parallel=False):
    return TransformerConfig(num_layers=8, hidden_size=32, num_attention_heads=4,
                             vocab_size=100, make_vocab_size_divisible_by=64, seq_length=16,
                             hidden_dropout=0.0, attention_dropout=0.0,
                             sequence_parallel=sequence_parallel)


def micro_batches(count, first=0):
    """Deterministic micro-batches (same in the parent and every rank)."""
    out = []
    for i in range(first, first + count):
        g = torch.Generator().manual_seed(100 + i)
        tokens = torch.randint(0, 100, (MICRO_BATCH, 17), generator=g)
        mask = (torch.rand(MICRO_BATCH, 16, generator=g) > 0.2).float()
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask})
    return out


@functools.lru_cache(maxsize=None)  # read-only results, shared by the tests
def reference(num_microbatches):
    """Single device: mean of micro-batch losses, grads by accumulation, then one SGD step."""
    model = GPTModel(tiny_config(), seed=SEED)
    losses = []
    for batch in micro_batches(num_microbatches):
        per_token = model(input_ids=batch["input_ids"], labels=batch["labels"])
        loss = masked_mean_loss(per_token, batch)
        (loss / num_microbatches).backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    params = {n: (p - LR * p.grad).detach() for n, p in model.named_parameters()}
    return torch.stack(losses), grads, params


def _run_case(groups, config, num_microbatches, virtual, dp_index):
    pp_rank, pp = groups.index("pp"), groups.size("pp")
    per_stage = config.num_layers // pp
    partition = partition_layers(config.num_layers, pp,
                                 num_layers_per_virtual_stage=per_stage // virtual
                                 if virtual > 1 else None)
    tp_group = groups.tp
    chunks = build_model_chunks(config, partition, pp_rank, tp_group, SEED)
    params = [p for c in chunks for p in c.parameters()]
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    init = {n: gather_full_parameter(p, tp_group) for n, p in named
            if n in (EMBEDDING, OUTPUT)}
    embedding = groups.embedding if groups.ranks("embedding") else None
    sync = AllReduceGradSync(params, groups.dp, embedding, tp_group)
    p2p = p2p_for(config, MICRO_BATCH, groups.pp, groups.size("tp"))
    executor = PipelineExecutor(chunks, p2p, pp_rank, groups.ranks("pp"), grad_sync=sync,
                                micro_batch_step=GPTMicroBatchStep())
    schedule = build_schedule(pp_rank, pp, num_microbatches, partition.virtual_chunks)

    def sgd():
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad

    # At each stage forward, count this rank's earlier outputs still in memory: all were
    # sent already, so none may be alive, although most still await their backward.
    refs, alive = [], [0]

    def count_alive(module, args, output):
        alive[0] = max(alive[0], sum(r() is not None for r in refs))
        refs.append(weakref.ref(output))

    for c, chunk in enumerate(chunks):
        if not partition.post_process(pp_rank, c):
            chunk.register_forward_hook(count_alive)
    batches = micro_batches(num_microbatches, first=dp_index * num_microbatches)
    evaluation = executor.run(build_schedule(pp_rank, pp, num_microbatches,
                                             partition.virtual_chunks, forward_only=True),
                              batches)
    assert all(p.grad is None for p in params), "forward-only must not touch grads"
    losses = executor.run(schedule, batches)
    sync.finish_sync()  # the loop's order: schedule, grad sync, optimizer step
    sgd()
    torch.testing.assert_close(evaluation, losses, rtol=0, atol=0)
    return {"losses": torch.stack(losses) if losses else None, "init": init,
            "grads": {n: gather_full_parameter(p, tp_group, p.grad) for n, p in named},
            "params": {n: gather_full_parameter(p, tp_group) for n, p in named},
            "peak": executor.peak_stored, "outputs_alive": alive[0], "sync_calls": sync.enabled_calls,
            "pp_rank": pp_rank, "dp_index": dp_index}


def _rank_fn(rank, world_size, tp, pp, cases):
    from gigatron.parallel.topology import ProcessGroups, Topology
    topo = Topology.from_world_size(world_size, tp=tp, pp=pp)
    groups = ProcessGroups(topo, rank)
    out = []
    for num_microbatches, virtual, sp in cases:
        out.append(_run_case(groups, tiny_config(sp), num_microbatches, virtual,
                             groups.index("dp")))
    return out


def _check(results, num_microbatches, case_index, ref):
    ref_losses, ref_grads, ref_params = ref
    seen = set()
    for rank_results in results:
        res = rank_results[case_index]
        if res["losses"] is not None:  # last stage: this dp replica's slice of micro-batches
            m = len(res["losses"])
            expected = ref_losses[res["dp_index"] * m:(res["dp_index"] + 1) * m]
            torch.testing.assert_close(res["losses"], expected, rtol=RTOL, atol=0)
        if EMBEDDING in res["init"] and OUTPUT in res["init"]:
            raise AssertionError("tied weights on one stage must be one parameter")
        for name, grad in res["grads"].items():
            ref_name = EMBEDDING if name == OUTPUT else name  # tied: one weight, summed grad
            torch.testing.assert_close(grad, ref_grads[ref_name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"grad of {name}: {m}")
            torch.testing.assert_close(res["params"][name], ref_params[ref_name], rtol=RTOL,
                                       atol=ATOL, msg=lambda m: f"{name} after step: {m}")
            seen.add(ref_name)
    assert seen == set(ref_grads), f"parameters never checked: {set(ref_grads) - seen}"


def _check_schedule_mechanics(results, case_index, pp, num_microbatches, virtual):
    for rank_results in results:
        res = rank_results[case_index]
        if virtual == 1:  # 1F1B: at most pp - rank micro-batches alive at once
            assert res["peak"] <= min(pp - res["pp_rank"], num_microbatches)
        assert res["outputs_alive"] == 0, "sent activations must be released"
        calls = res["sync_calls"]
        assert len(calls) == num_microbatches * virtual
        assert sorted(c for c, enabled in calls if enabled) == list(range(virtual))
        for chunk in range(virtual):  # the enabling call is that chunk's last backward
            assert [e for c, e in calls if c == chunk][-1] is True


def test_single_stage_executor_is_gradient_accumulation():
    ref_losses, ref_grads, _ = reference(3)
    config = tiny_config()
    chunks = build_model_chunks(config, partition_layers(config.num_layers, 1), 0, None, SEED)
    sync = AllReduceGradSync(chunks[0].parameters())
    executor = PipelineExecutor(chunks, p2p_for(config, MICRO_BATCH), 0, [0],
                                grad_sync=sync, micro_batch_step=GPTMicroBatchStep())
    losses = executor.run(build_schedule(0, 1, 3), micro_batches(3))
    torch.testing.assert_close(torch.stack(losses), ref_losses, rtol=RTOL, atol=0)
    for name, p in chunks[0].named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=RTOL, atol=ATOL)
    assert sync.enabled_calls == [(0, False), (0, False), (0, True)]
    with pytest.raises(ValueError, match="micro-batches"):
        executor.run(build_schedule(0, 1, 2), micro_batches(3))


def test_p2p_rejects_stage_outputs_of_the_wrong_shape():
    p2p = p2p_for(tiny_config(), MICRO_BATCH)
    assert p2p.tensor_shape == (16, MICRO_BATCH, 32)
    with pytest.raises(ValueError, match="--seq-length"):
        p2p.communicate([(torch.zeros(16, MICRO_BATCH, 33), 1)], [])
    sent = torch.randn(16, MICRO_BATCH, 32)
    assert p2p.communicate([(sent, p2p.rank)], [p2p.rank])[0] is not None  # to oneself


def test_chunks_must_cover_the_configured_layers():
    with pytest.raises(ValueError, match="--num-layers"):
        build_model_chunks(tiny_config(), partition_layers(4, 2), 0)


def _tied_init_identical(results):
    inits = {}
    for rank_results in results:
        for name, value in rank_results[0]["init"].items():
            inits.setdefault(name, value)
    torch.testing.assert_close(inits[EMBEDDING], inits[OUTPUT], rtol=0, atol=0)


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_matches_single_device_gradient_accumulation(pp):
    # 1F1B with m = pp and 2*pp + 1; interleaved (v = 2) with m = pp and 2*pp (it needs a
    # multiple of pp: m = 2*pp + 1 is rejected, see test_schedules).
    cases = [(pp, 1, False), (2 * pp + 1, 1, False), (pp, 2, False), (2 * pp, 2, False)]
    results = run_on_ranks(_rank_fn, pp, 1, pp, cases, timeout=120)
    _tied_init_identical(results)
    for i, (m, virtual, _) in enumerate(cases):
        _check(results, m, i, reference(m))
        _check_schedule_mechanics(results, i, pp, m, virtual)


def test_tp2_pp2_dp2_one_training_step_matches_single_device():
    # Each dp rank runs m micro-batches of the 2m-batch step; grads averaged over dp.
    # Case 1: 1F1B, no sequence parallelism; case 2: interleaved v=2 with sequence parallel.
    m = 2
    cases = [(m, 1, False), (m, 2, True)]
    results = run_on_ranks(_rank_fn, 8, 2, 2, cases, timeout=120)
    ref = reference(2 * m)
    _tied_init_identical(results)
    for i in range(len(cases)):
        _check(results, 2 * m, i, ref)
