"""Build a run's pieces from its RunConfig: model chunks, ZeRO, pipeline, data.

Nothing here reimplements a piece: the model is `gigatron.models.gpt.GPTModel` built per
pipeline chunk (`gigatron.models.pipeline_chunks`), the optimizer is `gigatron.parallel.zero`
(every stage, also stage 0), the schedule and executor are `gigatron.parallel.pipeline`'s,
the data is `gigatron.data`'. The tokenizer comes with the RunConfig (`arguments.build_run`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional

import torch

from gigatron.parallel.activity import waited_for
from gigatron.parallel.pipeline.executor import PipelineExecutor
from gigatron.parallel.pipeline.interfaces import GradSync
from gigatron.parallel.pipeline.schedules import Instruction
from gigatron.training.config.run_config import RunConfig
from gigatron.training.observe.timers import TimedP2P, Timers

if TYPE_CHECKING:
    from gigatron.data.gpt_dataset import SampleDataset
    from gigatron.parallel.tensor.fp8 import FP8Recipe
    from gigatron.parallel.zero import ZeroOptimizer
    from gigatron.data.tokenizer import Tokenizer
    from gigatron.parallel.pipeline.partition import PipelinePartition
    from gigatron.parallel.topology import ProcessGroups


def partition(run: RunConfig) -> "PipelinePartition":
    """Which layers each (pipeline rank, virtual chunk) builds, where the schedule places
    them (zbv: a V)."""
    from gigatron.parallel.pipeline.partition import partition_layers
    from gigatron.parallel.pipeline.schedules import placement_of

    p = run.parallel
    return partition_layers(run.model.num_layers, p.pp,
                            first_stage_layers=p.decoder_first_pipeline_num_layers,
                            last_stage_layers=p.decoder_last_pipeline_num_layers,
                            num_layers_per_virtual_stage=p.num_layers_per_virtual_pipeline_stage,
                            virtual_stages_per_rank=p.num_virtual_stages_per_pipeline_rank,
                            placement=placement_of(p.pipeline_schedule))


def build_process_groups(run: RunConfig, rank: int, timeout: timedelta) -> "ProcessGroups":
    """This rank's process groups: tp, dp, pp (with --context-parallel-size also cp, dp-cp,
    tp-cp), and with --num-experts the expert groups (ep, etp, edp:
    parallel/expert/topology.py) from --expert-model-parallel-size and
    --expert-tensor-parallel-size."""
    from gigatron.parallel.expert.topology import ExpertTopology
    from gigatron.parallel.topology import ProcessGroups, Topology

    p = run.parallel
    topology = Topology(tp=p.tp, dp=p.dp, pp=p.pp, cp=p.context_parallel_size)
    expert = None
    if run.model.num_moe_experts is not None:
        expert = ExpertTopology(topology, ep=p.ep, etp=p.etp)
    hierarchical = (p.hierarchical_context_parallel_sizes if p.cp_comm_type == "a2a+p2p"
                    else None)
    return ProcessGroups(topology, rank, timeout=timeout, expert=expert,
                         hierarchical_cp=hierarchical)


def dispatcher_factory(run: RunConfig, groups: "ProcessGroups") -> Optional[Callable]:
    """The MoE layers' token dispatcher over the expert groups; None (every expert on each
    rank, the experts replicated over tp) when ep is 1 and the experts' tp is the dense
    one, as before expert parallelism."""
    from gigatron.parallel.expert.dispatchers import expert_dispatcher_factory

    expert = groups.expert
    if expert is None or (expert.ep == 1 and expert.etp == run.parallel.tp):
        return None
    return expert_dispatcher_factory(run.model.moe_token_dispatcher_type, groups["ep"],
                                     groups["etp"])


def build_model_chunks(run: RunConfig, groups: "ProcessGroups",
                       device: torch.device) -> List[torch.nn.Module]:
    """This rank's GPTModel chunks (one per virtual pipeline chunk), on `device`; with
    --fp8-format their transformer layers' linears run in FP8, with --tp-comm-overlap their
    sequence-parallel collectives run chunked under the GEMMs."""
    from gigatron.models.pipeline_chunks import build_model_chunks as build
    from gigatron.training.config.megatron.fp8 import fp8_recipe
    from gigatron.training.config.megatron.tp_comm import tp_comm_overlap

    chunks = build(run.model, partition(run), groups.index("pp"), tp_group=groups.tp,
                   seed=run.train.seed, device=device,
                   dispatcher_factory=dispatcher_factory(run, groups),
                   cp_group=groups.cp_group, cp_comm_type=run.parallel.cp_comm_type)
    recipe = fp8_recipe(run.settings.fp8)
    if recipe is not None:
        apply_fp8(chunks, recipe, fp8_amax_group(groups, recipe.scaling))
    overlap = tp_comm_overlap(run.settings.tp_comm)
    if overlap is not None:
        from gigatron.parallel.tensor.async_tp import enable_tp_comm_overlap

        for chunk in chunks:
            enable_tp_comm_overlap(transformer_linears(chunk), overlap)
    mark_embedding_and_output(chunks)
    return chunks


def mark_embedding_and_output(chunks: List[torch.nn.Module]) -> None:
    """Tag the word-embedding weight (first stage) and the output-layer weight (last stage,
    when it holds one: tied on one stage it is the embedding's) as Megatron-Core does, for
    --decoupled-lr."""
    from gigatron.parallel.zero.param_groups import DECOUPLED_ATTR

    for chunk in chunks:
        gpt: Any = chunk  # a GPTModel
        if gpt.pre_process:
            setattr(gpt.embedding.word_embeddings.weight, DECOUPLED_ATTR, True)
        if gpt.post_process and gpt.output_layer.weight is not None:
            setattr(gpt.output_layer.weight, DECOUPLED_ATTR, True)


def build_optimizer(run: RunConfig, chunks: List[torch.nn.Module],
                    groups: "ProcessGroups") -> "ZeroOptimizer":
    """The ZeRO optimizer of the run: Megatron's parameter groups; with --decoupled-lr the
    embedding and output weights in groups of their own (their lr: `decoupled_lr`); with
    --fp8-param-gather the FP8 linears' weights gathered in FP8."""
    from gigatron.parallel.zero import build_zero
    from gigatron.parallel.zero.fp8_gather import FP8ParamGather
    from gigatron.parallel.zero.param_groups import megatron_param_groups

    config, states = run.zero, None
    if run.settings.fp8.fp8_param_gather:
        states = fp8_param_states(chunks)
        if getattr(config, "overlap_param_gather", False):  # the FP8 gather: after the step
            config = replace(config, overlap_param_gather=False)
    if run.settings.decoupled_lr.decoupled_lr is None:
        zero = build_zero(chunks, config, groups)
    else:
        zero = build_zero(chunks, config, groups, param_groups=megatron_param_groups(
            chunks, config.weight_decay, decoupled=True))
    if states is not None:
        zero.fp8_param_gather = FP8ParamGather(zero.flat_groups, states)
    return zero


def fp8_param_states(chunks: List[torch.nn.Module]) -> Dict[int, Any]:
    """--fp8-param-gather, before ZeRO is built (after `apply_fp8`): id(weight) -> FP8 state
    of each FP8 linear's weight, the weights tagged so that ZeRO gives them flat buffers of
    their own (parallel/zero/fp8_gather.py gathers those in FP8)."""
    from gigatron.parallel.zero.param_groups import FP8_PARAM_ATTR

    states = {}
    for chunk in chunks:
        for layer in transformer_linears(chunk):
            if getattr(layer, "fp8", None) is not None:
                setattr(layer.weight, FP8_PARAM_ATTR, True)
                states[id(layer.weight)] = layer.fp8
    return states


def transformer_linears(chunk: torch.nn.Module) -> List[torch.nn.Module]:
    """The tensor-parallel linears of a GPT chunk's transformer layers: the GEMMs
    Megatron-Core runs in FP8 (not the embedding, not the output layer)."""
    from gigatron.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    decoder: torch.nn.Module = getattr(chunk, "decoder")
    return [m for m in decoder.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def apply_fp8(chunks: List[torch.nn.Module], recipe: "FP8Recipe", amax_group: Any) -> None:
    """FP8 on each chunk's transformer layers, one FP8 region per chunk (as
    Megatron-Core's fp8_autocast around the transformer block)."""
    from gigatron.parallel.tensor.fp8 import enable_fp8

    for chunk in chunks:
        enable_fp8(getattr(chunk, "decoder"), transformer_linears(chunk), recipe, amax_group)


def fp8_amax_group(groups: "ProcessGroups", scaling: str = "delayed") -> Any:
    """This rank's FP8 amax-reduction group. Delayed scaling: its pipeline stage's tensor-,
    context- and data-parallel ranks (Megatron's default amax reduction group). Tensorwise:
    its tensor- and context-parallel ranks, which hold pieces of the same tensors (a
    micro-batch's tokens, a weight), so each is quantised as one rank quantises it whole.
    Blockwise: none. Collective: every rank creates every such group, in the same order."""
    import torch.distributed as dist

    if scaling == "blockwise":
        return None
    mine = None
    for ranks in groups.topology.groups("tp-cp-dp" if scaling == "delayed" else "tp-cp"):
        group = dist.new_group(ranks, timeout=groups.timeout)
        if groups.rank in ranks:
            mine = group
    return mine


@dataclass
class Pipeline:
    """The executor and the step's schedules for this rank."""

    executor: PipelineExecutor
    train_schedule: List[Instruction]
    eval_schedule: List[Instruction]
    needs_inputs: bool  # this rank runs the first virtual stage: reads input ids
    needs_labels: bool  # this rank runs the last virtual stage: reads labels and loss mask
    mtp: bool = False  # multi-token prediction: the last stage reads input ids too
    pp_rank: int = 0
    pp_size: int = 1
    virtual_chunks: int = 1
    schedules: Dict[int, List[Instruction]] = field(default_factory=dict)  # by micro-batches
    schedule: str = "1f1b"  # --pipeline-schedule

    def train_schedule_for(self, num_microbatches: int) -> List[Instruction]:
        """The train schedule of a step with `num_microbatches` (a batch ramp-up changes the
        count; each count's schedule is built once)."""
        from gigatron.parallel.pipeline.schedules import build_schedule

        if num_microbatches not in self.schedules:
            self.schedules[num_microbatches] = build_schedule(
                self.pp_rank, self.pp_size, num_microbatches, self.virtual_chunks,
                schedule=self.schedule)
        return self.schedules[num_microbatches]


def build_pipeline(run: RunConfig, groups: "ProcessGroups", chunks: List[torch.nn.Module],
                   grad_sync: Optional[GradSync], device: torch.device,
                   timers: Optional[Timers] = None) -> Pipeline:
    """The pipeline executor (pp = 1 runs the no-pipelining schedule) and its schedules
    (--pipeline-schedule; evaluation runs forwards only, in the same placement); with
    `timers`, its p2p transfers are timed as 'comm'."""
    from gigatron.models.pipeline_chunks import GPTMicroBatchStep
    from gigatron.parallel.pipeline.p2p import PipelineP2P, p2p_tensor_shape
    from gigatron.parallel.pipeline.schedules import (build_schedule, is_first_stage,
                                                      is_last_stage, placement_of)
    from gigatron.training.run.per_token_loss import per_token_loss

    m, p, mbs = run.model, run.parallel, run.train.micro_batch_size
    assert mbs is not None  # resolved by arguments.build_run
    shape = p2p_tensor_shape(m.seq_length // p.context_parallel_size, mbs, m.hidden_size,
                             p.tp, p.sequence_parallel)
    p2p = PipelineP2P(shape, m.params_dtype, device, groups.pp, rank=groups.rank)
    pp_rank, v = groups.index("pp"), len(chunks)
    name, placement = p.pipeline_schedule, placement_of(p.pipeline_schedule)
    executor = PipelineExecutor(chunks, p2p if timers is None else TimedP2P(p2p, timers),
                                pp_rank, groups.ranks("pp"), grad_sync=grad_sync,
                                micro_batch_step=GPTMicroBatchStep(
                                    per_token_loss(run), bool(m.mtp_num_layers),
                                    m.mtp_loss_scaling_factor),
                                placement=placement)
    n = run.train.num_microbatches
    train_schedule = build_schedule(pp_rank, p.pp, n, v, schedule=name)
    return Pipeline(executor, train_schedule,
                    build_schedule(pp_rank, p.pp, n, v, forward_only=True, schedule=name),
                    needs_inputs=any(is_first_stage(pp_rank, c, p.pp, placement)
                                     for c in range(v)),
                    needs_labels=any(is_last_stage(pp_rank, c, p.pp, v, placement)
                                     for c in range(v)),
                    mtp=bool(m.mtp_num_layers), pp_rank=pp_rank, pp_size=p.pp,
                    virtual_chunks=v,
                    schedules={n: train_schedule}, schedule=name)


def sample_counts(run: RunConfig) -> List[int]:
    """Samples each split must provide: Megatron's train/valid/test arithmetic (training by
    samples: --train-samples, or what the batch ramp's iterations consume if more)."""
    from gigatron.training.run.batch_rampup import run_rampup

    t = run.train
    assert t.train_iters is not None and t.global_batch_size is not None  # resolved
    train = t.train_iters * t.global_batch_size
    if t.train_samples is not None:
        train = max(t.train_samples, run_rampup(t, run.parallel.dp).consumed_after(
            t.train_iters))
    evals = (t.train_iters // t.eval_interval + 1) * t.eval_iters
    return [train, evals * t.global_batch_size, t.eval_iters * t.global_batch_size]


def build_datasets(run: RunConfig,
                   tokenizer: Optional["Tokenizer"]) -> List[Optional["SampleDataset"]]:
    """[train, valid, test] datasets (collective: index caches are built by one rank)."""
    from gigatron.data.builder import build_train_valid_test_datasets

    config = run.data
    if tokenizer is not None:
        config = replace(config, eod=tokenizer.eod, vocab_size=tokenizer.vocab_size)
    return build_train_valid_test_datasets(config, sample_counts(run))


def micro_batches(run: RunConfig, dataset: Optional["SampleDataset"], consumed_samples: int,
                  dp_rank: int, device: torch.device,
                  pipeline: Pipeline, cp_rank: int = 0) -> Optional[Iterator[dict]]:
    """This rank's micro-batches (executor keys), from `consumed_samples` on; None if the
    split is empty. Ranks of middle pipeline stages get empty dicts (they read nothing).
    Under context parallelism the cp ranks of a data-parallel rank read the same samples
    and keep their context-parallel rank `cp_rank`'s chunks of each."""
    from gigatron.data.samplers import build_pretraining_data_loader

    if dataset is None:
        return None
    # packed documents (--sft's conversations too): every stage attends within them, at their
    # restarted positions
    documents = run.data.reset_attention_mask or run.data.reset_position_ids or run.data.sft
    if not (pipeline.needs_inputs or pipeline.needs_labels or documents):
        return _empty_batches()
    mbs = run.train.micro_batch_size
    assert mbs is not None  # resolved by arguments.build_run
    loader = build_pretraining_data_loader(dataset, consumed_samples, mbs, dp_rank,
                                           run.parallel.dp,
                                           num_workers=run.train.num_workers,
                                           seed=run.train.seed)
    return _to_executor(loader, device, pipeline, run.parallel.context_parallel_size, cp_rank,
                        documents, run.parallel.cp_comm_type, run)


def _empty_batches() -> Iterator[dict]:
    while True:
        yield {}


def _to_executor(loader, device: torch.device, pipeline: Pipeline, cp: int = 1,
                 cp_rank: int = 0, documents: bool = False,
                 comm_type: str = "p2p", run_key: object = None) -> Iterator[dict]:
    for batch in waited_for(loader):
        out = {}
        if pipeline.needs_inputs or (pipeline.needs_labels and pipeline.mtp):
            out["input_ids"] = batch["tokens"].to(device)
        if pipeline.needs_inputs or documents:
            out["position_ids"] = batch["position_ids"].to(device)
        if "cu_seqlens" in batch:  # stays on the host (data/documents.py)
            out["cu_seqlens"] = batch["cu_seqlens"]
        if pipeline.needs_labels:
            out["labels"] = batch["labels"].to(device)
            out["loss_mask"] = batch["loss_mask"].to(device)
        if cp > 1 and "cu_seqlens" in out and not any(r is run_key for r in _SAID_SPLIT):
            _SAID_SPLIT.append(run_key)
            _say_split(out["cu_seqlens"], cp, cp_rank, comm_type)
        yield out if cp == 1 else context_parallel_shard(out, cp, cp_rank, comm_type)


# the runs that said it (each evaluation starts its data over): the run objects themselves,
# kept, not their id()s, which a later run in the same process may be given again
_SAID_SPLIT: List[object] = []


def _say_split(cu_seqlens: torch.Tensor, cp: int, cp_rank: int, comm_type: str) -> None:
    """Print once which context-parallel split the run's packed documents use."""
    from gigatron.parallel.context.split import document_split_applies

    rows = cu_seqlens.reshape(-1, cu_seqlens.shape[-1]).tolist()
    if cp_rank == 0 and (not torch.distributed.is_initialized()
                         or torch.distributed.get_rank() == 0):
        split = [document_split_applies(r, cp, comm_type) for r in rows]
        which = ("per document (every document a multiple of 2 x cp: each split as "
                 "Megatron-Core splits packed sequences)" if all(split)
                 else "of the whole sequence (a document length is no multiple of 2 x cp)"
                 if not any(split) else
                 "per document for samples whose documents are all multiples of 2 x cp, "
                 "of the whole sequence for the others")
        print(f"context parallel split of packed documents: {which}; decided per sample by "
              f"parallel/context/split.py's document_split_applies", flush=True)


def context_parallel_shard(batch: Dict[str, torch.Tensor], cp: int, cp_rank: int,
                           comm_type: str = "p2p") -> Dict[str, torch.Tensor]:
    """`cp_rank`'s chunks of a micro-batch's [b, s] tensors (position ids stay the global
    ones), with the whole sequence's loss-token count / cp (models/losses.py); packed
    documents' `cu_seqlens` stay whole (global positions, read by attention). A sample whose
    documents all divide by 2 x cp is split per document, the rest load-balanced over the
    whole sequence (split.py's `document_split_applies`, which attention asks too)."""
    from gigatron.parallel.context.split import (document_rank_positions,
                                                 document_split_applies, rank_positions,
                                                 split_for_rank)

    index = None
    if "cu_seqlens" in batch:
        rows = batch["cu_seqlens"].reshape(-1, batch["cu_seqlens"].shape[-1]).tolist()
        if any(document_split_applies(r, cp, comm_type) for r in rows):
            index = torch.stack([document_rank_positions(r, cp, cp_rank)
                                 if document_split_applies(r, cp, comm_type)
                                 else rank_positions(r[-1], cp, cp_rank) for r in rows])

    def piece(value: torch.Tensor) -> torch.Tensor:
        if index is None:
            return split_for_rank(value, cp, cp_rank, seq_dim=1)
        return torch.gather(value, 1, index.to(value.device))

    out = {key: value if key == "cu_seqlens" else piece(value) for key, value in batch.items()}
    if "loss_mask" in batch:
        total = batch["loss_mask"].sum().clamp(min=1).to(torch.float32)
        out["loss_tokens_share"] = total / cp
    return out
