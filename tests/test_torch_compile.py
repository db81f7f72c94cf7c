"""--torch-compile: each transformer layer compiles as one graph under every parallelism.

Graph breaks are read from dynamo's own counters (`counters["graph_break"]`, and
`counters["stats"]["unique_graphs"]`, the frames compiled) after a compiled layer's forward
and backward. A dense layer compiles with no break, as one graph, plain, under tp2 +
sequence parallelism, cp2 (ring attention), full and selective recomputation and FP8
(tensorwise), and inside the pipeline executor (tp2 x pp2 below). An MoE layer breaks at
one place, its dispatch/experts/combine (models/moe/layer.py `_experts`: how many tokens
each expert gets is data), counted exactly: dynamo reports that call once for each frame
it is nested in (TransformerLayer.forward, MoELayer.forward, and under ep
_forward_expert_parallel) and compiles the layer in one more graph per frame (the code
after the call). Deferred weight gradients (zb-h1, zbv) leave each linear eager: their
backward pushes to a Python queue (counted exactly too); so does dropout drawn from the
tensor-parallel RNG tracker (attention dropout), which swaps generator states.

The graph-break cases use dynamo's "eager" backend (what is traced is the same; nothing is
lowered) to stay fast, "aot_eager" where AOT autograd's own recomputation is what runs
(selective and op recomputation, FP8), there with the output and every gradient checked
against eager (1e-6). The losses are checked with the real inductor backend on one rank
(equal eager within 1e-4 relative over 3 steps, fp32) and with "aot_eager" at tp2 x pp2
over 2 (4 ranks on 2 cores: inductor's C++ compiles would take minutes there).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Tuple

import pytest
import torch

from multirank import run_on_ranks

RTOL = 1e-4


def _config(**changes: Any):
    from gigatron.models.zoo import load_config

    return dataclasses.replace(load_config("debug-llama"), **changes)


def _compiled_layer_counts(model, seq: int, backend: str = "eager", block: bool = False,
                           check: bool = False) -> Tuple[int, int]:
    """(graph breaks, graphs compiled) of the model's layers compiled alone, after one
    forward and backward (through the whole block with `block`: its recomputation); with
    `check`, the output and every gradient equal the eager layer's (1e-6)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from gigatron.training.run.compile import compile_model_chunks

    torch.manual_seed(0)
    x = torch.randn(seq, 2, model.config.hidden_size, requires_grad=True)
    rotary = model._rotary(x, None)
    layer = model.decoder if block else model.decoder.layers[str(model.layer_range[0])]

    def forward_backward():
        model.zero_grad(set_to_none=True)
        x.grad = None
        y = layer(x, rotary)
        y.float().square().sum().backward()
        return [y.detach(), x.grad] + [p.grad for p in model.parameters() if p.grad is not None]

    eager = forward_backward() if check else None
    torch._dynamo.reset()
    counters.clear()
    compile_model_chunks([model], backend)
    compiled = forward_backward()
    if eager is not None:
        assert len(compiled) == len(eager) > 2
        for got, want in zip(compiled, eager):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    breaks = sum(counters["graph_break"].values())
    return breaks, counters["stats"]["unique_graphs"]


def _model(config, **kwargs):
    from gigatron.models.gpt import GPTModel

    return GPTModel(config, **kwargs)


SINGLE_RANK: Dict[str, Dict[str, Any]] = {
    "plain": {},
    "full_recompute": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
    "selective_recompute": dict(recompute_granularity="selective",
                                recompute_modules=["core_attn", "mlp", "layernorm"]),
    "op_recompute": dict(recompute_granularity="selective", selective_ac_option="op"),
}


@pytest.mark.parametrize("case", sorted(SINGLE_RANK))
def test_dense_layer_compiles_as_one_graph(case):
    config = _config(num_layers=1, **SINGLE_RANK[case])
    # AOT autograd recomputes a checkpoint inside a compiled layer: its numbers are checked
    traced_recompute = case in ("selective_recompute", "op_recompute")
    breaks, graphs = _compiled_layer_counts(
        _model(config), config.seq_length, "aot_eager" if traced_recompute else "eager",
        block=case in ("full_recompute", "op_recompute"), check=traced_recompute)
    assert (breaks, graphs) == (0, 1)


def test_fp8_tensorwise_layer_compiles_as_one_graph():
    from gigatron.parallel.tensor.fp8 import FP8Recipe
    from gigatron.training.run.builders import apply_fp8

    config = _config(num_layers=1)
    model = _model(config)
    apply_fp8([model], FP8Recipe("hybrid", scaling="tensorwise"), None)
    assert _compiled_layer_counts(model, config.seq_length, "aot_eager", check=True) == (0, 1)


def test_deferred_weight_gradients_leave_each_linear_uncompiled():
    """zb-h1 / zbv's deferred weight gradients (parallel/tensor/wgrad.py) push to a Python
    queue in backward, which no graph holds: each of the 4 linears runs eager, a break seen
    from each frame it is nested in (14), 16 graphs; the gradients are still deferred."""
    from gigatron.parallel.tensor import wgrad

    config = _config(num_layers=1)
    queue = wgrad.WeightGradQueue()
    with wgrad.deferring(queue):
        counts = _compiled_layer_counts(_model(config), config.seq_length)
    assert counts == (14, 16) and len(queue) == 4


def test_tracked_dropout_breaks_where_it_swaps_the_generator():
    """Dropout on split activations (attention probabilities; the sequence slice under sp)
    draws from the tensor-parallel tracker's stream, which swaps the default generator's
    state in and out (parallel/tensor/random.py fork): dynamo does not trace generator
    states, so a layer with attention dropout breaks there (8 breaks, 6 graphs)."""
    config = _config(num_layers=1, attention_dropout=0.1, hidden_dropout=0.1)
    assert _compiled_layer_counts(_model(config), config.seq_length) == (8, 6)


def test_moe_layer_recomputed_by_module_adds_its_losses_once():
    """--recompute-modules moe in a compiled layer: the MoE checkpoint runs eager (its losses
    and counts are Python state), its output and gradients are eager's, and the re-run adds
    no second balancing loss and counts no token twice (2 breaks, 2 graphs)."""
    config = _config(num_layers=1, num_moe_experts=4, moe_router_topk=2,
                     moe_aux_loss_coeff=0.01, recompute_granularity="selective",
                     recompute_modules=["moe"])
    model = _model(config)
    moe = model.decoder.layers["0"].mlp
    assert _compiled_layer_counts(model, config.seq_length, "aot_eager", check=True) == (2, 2)
    model.layer_losses.take()
    moe.stats_tokens_per_expert.zero_()
    x = torch.randn(config.seq_length, 2, config.hidden_size, requires_grad=True)
    model.decoder.layers["0"](x, model._rotary(x, None)).sum().backward()
    assert list(model.layer_losses.take()) == ["load_balancing_loss"]
    assert model.layer_losses.take() == {}  # nothing added by the backward's re-run
    assert moe.stats_tokens_per_expert.sum().item() == config.seq_length * 2 * 2  # top 2


def test_moe_full_recompute_is_refused_with_torch_compile():
    from gigatron.training.config.arguments import parse_args
    from gigatron.training.config.validation import ConfigError

    flags = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
             "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 2 "
             "--lr 1e-3 --train-iters 1 --mock-data --vocab-size 128 --num-experts 4 "
             "--torch-compile --recompute-granularity full --recompute-method uniform "
             "--recompute-num-layers 1").split()
    with pytest.raises(ConfigError) as err:
        parse_args(flags, 1)
    assert [line for line in err.value.problems if "--torch-compile" in line] == [
        "--torch-compile with --recompute-granularity full is not supported for MoE models "
        "(the compiled layer's recompute saves other tensors than its forward): use "
        "--recompute-granularity selective (--recompute-modules moe, or --selective-ac-option "
        "op), or drop --torch-compile"]


def _parallel_layer_counts(rank: int, world: int) -> Dict[str, Tuple[int, int]]:
    import torch.distributed as dist

    from gigatron.parallel.expert.dispatchers import expert_dispatcher_factory

    group = dist.group.WORLD
    dense, sp = _config(num_layers=1), _config(num_layers=1, sequence_parallel=True)
    moe = _config(num_layers=1, num_moe_experts=4, moe_router_topk=2)
    return {
        "tp2_sp": _compiled_layer_counts(_model(sp, tp_group=group), sp.seq_length // 2),
        "cp2_ring": _compiled_layer_counts(_model(dense, cp_group=group, cp_comm_type="p2p"),
                                           dense.seq_length // 2),
        "ep2_moe": _compiled_layer_counts(
            _model(moe, dispatcher_factory=expert_dispatcher_factory("alltoall", group)),
            moe.seq_length)}


def test_parallel_layers_compile_as_one_graph_but_moe_dispatch():
    """tp2 + sp and cp2: one graph, no break; ep2 MoE: its one uncompiled region, seen from
    its 3 nested frames (3 breaks, 4 graphs)."""
    for counts in run_on_ranks(_parallel_layer_counts, 2, timeout=300):
        assert counts == {"tp2_sp": (0, 1), "cp2_ring": (0, 1), "ep2_moe": (3, 4)}


def _train_losses(model, after_step=lambda: None, steps: int = 3):
    """Losses of `steps` SGD steps on one fixed batch (fp32); `after_step()` after each."""
    config = model.config
    ids = torch.randint(0, config.vocab_size, (2, config.seq_length + 1),
                        generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        after_step()
    return losses


def test_inductor_compiled_model_trains_the_eager_losses():
    """The real backend (C++ kernels by g++ here): the losses of 3 steps equal eager's within
    1e-4, and the compile time is said once, after the first step."""
    from gigatron.training.run.compile import CompileTimeNote, compile_model_chunks

    config = _config(num_layers=1)
    eager = _train_losses(_model(config))
    model = _model(config)
    note, lines = CompileTimeNote(True), []
    assert compile_model_chunks([model], "inductor") == 1
    # kernels compiled in this process: a pool of compile workers (each importing torch)
    # costs more than it saves for a layer's few kernels on 2 cores; scalar C++ (no SIMD ISA
    # probe, simpler kernels): ~18 s of CPU from a cold inductor cache, where SIMD took ~35
    with torch._inductor.config.patch({"compile_threads": 1, "cpp.vec_isa_ok": False}):
        compiled = _train_losses(model, lambda: lines.append(note.after_step()))
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=RTOL, atol=0)
    assert lines[0] is not None and lines[0].startswith("torch.compile: compiled") \
        and lines[1:] == [None, None], lines


GPT = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
       "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 "
       "--mock-data --vocab-size 128 --eval-iters 0 --no-progress --num-workers 0 "
       "--make-vocab-size-divisible-by 8 --init-method-std 0.1 --hidden-dropout 0 "
       "--attention-dropout 0 --disable-bias-linear --position-embedding-type rope "
       "--log-interval 1 --train-iters 2 --lr-warmup-iters 0").split()


def _pretrain(rank: int, world: int, argv, metrics: str) -> Tuple[int, int]:
    """pretrain.main(argv) with the layers traced by aot_eager; (graph breaks, graphs)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from gigatron.training.run import compile as compile_run, pretrain

    compile_run.BACKEND = "aot_eager"
    torch._dynamo.reset()  # forked from a test process that may have compiled before
    counters.clear()
    assert pretrain.main(argv + ["--metrics-file", metrics]) == 0
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def _losses(path):
    with open(path) as f:
        return [r["lm loss"] for r in map(json.loads, f) if r["type"] == "train"]


def test_tp2_pp2_compiled_pretraining_matches_one_rank_eager(tmp_path, capfd):
    """pretrain_gpt.py --torch-compile at tp2 x pp2 (the pipeline executor running compiled
    layers and loss): the one-rank eager run's losses within 1e-4, no graph break on any
    rank, the compile time said once."""
    eager, compiled = str(tmp_path / "eager.jsonl"), str(tmp_path / "compiled.jsonl")
    run_on_ranks(_pretrain, 1, GPT, eager, timeout=300)
    counts = run_on_ranks(_pretrain, 4, GPT + "--torch-compile --tensor-model-parallel-size 2 "
                          "--sequence-parallel --pipeline-model-parallel-size 2".split(),
                          compiled, timeout=300)
    torch.testing.assert_close(torch.tensor(_losses(compiled)), torch.tensor(_losses(eager)),
                               rtol=RTOL, atol=0)
    assert len(_losses(eager)) == 2  # the second: after a step through the compiled layers
    # first stage: its layer; last stage: its layer and the loss
    assert counts == [(0, 1), (0, 1), (0, 2), (0, 2)], counts
    assert capfd.readouterr().out.count("torch.compile: compiled") == 1
