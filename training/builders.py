"""Build a run's pieces from its RunConfig: tokenizer, model chunks, ZeRO, pipeline, data.

Nothing here reimplements a piece: the model is `gigatron.models.gpt.GPTModel` built per
pipeline chunk, the optimizer is `gigatron.parallel.zero` (every stage, also stage 0), the
schedule and executor are `gigatron.parallel.pipeline`'s, the data is `gigatron.datasets`'.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import torch

from gigatron.training.config import RunConfig


def build_tokenizer(flags: Dict[str, Any], model_vocab: Optional[int] = None):
    """The tokenizer the data flags name; for --mock-data without one, a null tokenizer
    whose vocabulary is --vocab-size (or the zoo model's) with eod as its last id."""
    from gigatron.datasets.tokenizer import NullTokenizer, build_tokenizer as build

    if flags.get("tokenizer_type") is not None:
        return build(flags["tokenizer_type"], tokenizer_model=flags.get("tokenizer_model"),
                     vocab_file=flags.get("vocab_file"), merge_file=flags.get("merge_file"),
                     vocab_size=flags.get("vocab_size"))
    vocab = flags.get("vocab_size") or model_vocab
    if vocab is None or vocab < 2:
        return None
    return NullTokenizer(vocab - 1)


def zero_config(run: RunConfig):
    """Map the optimizer and ZeRO flags to the ZeRO wrapper's config."""
    from gigatron.parallel.zero import ZeroConfig

    opt, par = run.optimizer, run.parallel
    kw: Dict[str, Any] = dict(
        zero_stage=par.zero_stage, optimizer="adamw" if opt.optimizer == "adam" else "sgd",
        lr=opt.lr, weight_decay=opt.weight_decay, adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps, sgd_momentum=opt.sgd_momentum,
        clip_grad=opt.clip_grad, loss_scale=opt.loss_scale or 0.0,
        initial_scale_power=int(round(math.log2(opt.initial_loss_scale))),
        loss_scale_window=opt.loss_scale_window, hysteresis=opt.hysteresis,
        min_loss_scale=opt.min_loss_scale, grad_reduce_in_bf16=par.grad_reduce_in_bf16,
        offload_optimizer="cpu" if par.optimizer_cpu_offload else "none")
    if par.ddp_bucket_size is not None:
        kw["reduce_bucket_size"] = par.ddp_bucket_size
    return ZeroConfig(**kw)


def partition(run: RunConfig):
    """Which layers each (pipeline rank, virtual chunk) builds."""
    from gigatron.parallel.pipeline.partition import partition_layers

    p = run.parallel
    return partition_layers(run.model.num_layers, p.pp,
                            first_stage_layers=p.decoder_first_pipeline_num_layers,
                            last_stage_layers=p.decoder_last_pipeline_num_layers,
                            num_layers_per_virtual_stage=p.num_layers_per_virtual_pipeline_stage)


def build_model_chunks(run: RunConfig, groups, device: torch.device) -> List[torch.nn.Module]:
    """This rank's GPTModel chunks (one per virtual pipeline chunk), on `device`."""
    from gigatron.models.gpt import GPTModel

    parts, pp_rank = partition(run), groups.index("pp")
    chunks = []
    for c in range(parts.virtual_chunks):
        chunks.append(GPTModel(run.model, tp_group=groups.tp,
                               pre_process=parts.pre_process(pp_rank, c),
                               post_process=parts.post_process(pp_rank, c),
                               layer_range=parts.layer_range(pp_rank, c),
                               seed=run.train.seed, device=device))
    return chunks


@dataclass
class Pipeline:
    """The executor and the step's schedules for this rank."""

    executor: Any
    train_schedule: list
    eval_schedule: list
    needs_inputs: bool  # this rank runs the first virtual stage: reads input ids
    needs_labels: bool  # this rank runs the last virtual stage: reads labels and loss mask


def build_pipeline(run: RunConfig, groups, chunks, grad_sync, device) -> Pipeline:
    """The pipeline executor (pp = 1 runs the no-pipelining schedule) and its schedules."""
    from gigatron.parallel.pipeline.executor import PipelineExecutor
    from gigatron.parallel.pipeline.p2p import PipelineP2P, p2p_tensor_shape
    from gigatron.parallel.pipeline.schedules import build_schedule

    m, p = run.model, run.parallel
    shape = p2p_tensor_shape(m.seq_length, run.train.micro_batch_size, m.hidden_size, p.tp,
                             p.sequence_parallel)
    p2p = PipelineP2P(shape, m.params_dtype, device, groups.pp, rank=groups.rank)
    pp_rank, v = groups.index("pp"), len(chunks)
    executor = PipelineExecutor(chunks, p2p, pp_rank, groups.ranks("pp"), grad_sync=grad_sync)
    n = run.train.num_microbatches
    return Pipeline(executor, build_schedule(pp_rank, p.pp, n, v),
                    build_schedule(pp_rank, p.pp, n, v, forward_only=True),
                    needs_inputs=pp_rank == 0, needs_labels=pp_rank == p.pp - 1)


def sample_counts(run: RunConfig) -> List[int]:
    """Samples each split must provide: Megatron's train/valid/test arithmetic."""
    t = run.train
    evals = (t.train_iters // t.eval_interval + 1) * t.eval_iters
    return [t.train_iters * t.global_batch_size, evals * t.global_batch_size,
            t.eval_iters * t.global_batch_size]


def build_datasets(run: RunConfig, tokenizer) -> List[Optional[object]]:
    """[train, valid, test] datasets (collective: index caches are built by one rank)."""
    from gigatron.datasets.builder import GPTDataConfig, build_train_valid_test_datasets

    d = run.data
    config = GPTDataConfig(
        seq_length=run.model.seq_length, seed=d.seed, data_path=d.data_path, split=d.split,
        train_data_path=d.train_data_path, valid_data_path=d.valid_data_path,
        test_data_path=d.test_data_path, mock_data=d.mock_data,
        data_cache_path=d.data_cache_path, eod_mask_loss=d.eod_mask_loss,
        eod=None if tokenizer is None else tokenizer.eod,
        vocab_size=None if tokenizer is None else tokenizer.vocab_size)
    return build_train_valid_test_datasets(config, sample_counts(run))


def micro_batches(run: RunConfig, dataset, consumed_samples: int, dp_rank: int,
                  device: torch.device, pipeline: Pipeline) -> Optional[Iterator[dict]]:
    """This rank's micro-batches (executor keys), from `consumed_samples` on; None if the
    split is empty. Ranks of middle pipeline stages get empty dicts (they read nothing)."""
    from gigatron.datasets.samplers import build_pretraining_data_loader

    if dataset is None:
        return None
    if not (pipeline.needs_inputs or pipeline.needs_labels):
        return _empty_batches()
    loader = build_pretraining_data_loader(dataset, consumed_samples,
                                           run.train.micro_batch_size, dp_rank, run.parallel.dp,
                                           num_workers=run.data.num_workers)
    return _to_executor(loader, device, pipeline)


def _empty_batches() -> Iterator[dict]:
    while True:
        yield {}


def _to_executor(loader, device: torch.device, pipeline: Pipeline) -> Iterator[dict]:
    for batch in loader:
        out = {}
        if pipeline.needs_inputs:
            out["input_ids"] = batch["tokens"].to(device)
            out["position_ids"] = batch["position_ids"].to(device)
        if pipeline.needs_labels:
            out["labels"] = batch["labels"].to(device)
            out["loss_mask"] = batch["loss_mask"].to(device)
        yield out
