"""Checks of the flags taken together; each failure is one line naming the flags and the fix.

Called by `arguments.build_run_config` before any process group, model or data exists.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Any, Dict, Optional, Tuple

from gigatron.training.config import LRScheduleConfig, ParallelConfig
from gigatron.training.lr_schedule import validate_schedule

# flag dest -> TransformerConfig field, for flags that map one to one
MODEL_FIELDS = {
    "num_layers": "num_layers", "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size", "num_attention_heads": "num_attention_heads",
    "seq_length": "seq_length", "max_position_embeddings": "max_position_embeddings",
    "make_vocab_size_divisible_by": "make_vocab_size_divisible_by",
    "position_embedding_type": "position_embedding_type", "rotary_base": "rotary_base",
    "normalization": "normalization", "norm_epsilon": "layernorm_epsilon",
    "hidden_dropout": "hidden_dropout", "attention_dropout": "attention_dropout",
    "init_method_std": "init_method_std", "attention_backend": "attention_backend",
    "recompute_granularity": "recompute_granularity", "recompute_method": "recompute_method",
    "recompute_num_layers": "recompute_num_layers",
    "untie_embeddings_and_output_weights": "untie_embeddings_and_output_weights",
}
REQUIRED_WITHOUT_MODEL = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _positive(flags: argparse.Namespace, *dests: str) -> None:
    for dest in dests:
        value = getattr(flags, dest)
        if value is not None and value <= 0:
            raise ValueError(f"{_flag(dest)} must be > 0, got {value}")


def data_parallel_size(world_size: int, tp: int, pp: int) -> int:
    """dp = world / (tp x pp), as Megatron derives it from the launch size (the topology's
    rule and message)."""
    from gigatron.parallel.topology import Topology

    for dest, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if size < 1:
            raise ValueError(f"{_flag(dest)} must be >= 1, got {size}")
    return Topology.from_world_size(world_size, tp=tp, pp=pp).dp


def check_parallel(flags: argparse.Namespace, tp: int, pp: int) -> None:
    """Parallel flags that contradict each other."""
    if flags.use_distributed_optimizer and flags.zero_stage == 0:
        raise ValueError("--use-distributed-optimizer (ZeRO stage 1) contradicts --zero-stage 0:"
                         " drop one of them")
    _positive(flags, "ddp_bucket_size", "distributed_timeout_minutes")
    if flags.zero_stage == 3 and pp > 1:
        raise ValueError("--zero-stage 3 needs --pipeline-model-parallel-size 1 (a pipeline stage "
                         "would re-gather every layer per micro-batch): use --zero-stage 2")
    if flags.optimizer_cpu_offload and (flags.zero_stage or
                                        (1 if flags.use_distributed_optimizer else 0)) < 1:
        raise ValueError("--optimizer-cpu-offload needs a sharded optimizer: add --zero-stage 1 "
                         "(or 2, 3) or --use-distributed-optimizer")


def _model_overrides(flags: argparse.Namespace, vocab_size: Optional[int]) -> Dict[str, Any]:
    """TransformerConfig fields set by flags (only those given, so zoo values show through)."""
    fields = {f: getattr(flags, d) for d, f in MODEL_FIELDS.items()
              if getattr(flags, d) is not None}
    if flags.swiglu:
        fields["activation"] = "swiglu"
    if flags.disable_bias_linear:
        fields["add_bias_linear"] = False
    if flags.group_query_attention:
        if flags.num_query_groups is None:
            raise ValueError("--group-query-attention needs --num-query-groups N")
        fields["num_query_groups"] = flags.num_query_groups
    elif flags.num_query_groups is not None and flags.model is None:
        raise ValueError("--num-query-groups is used only with --group-query-attention: add it")
    elif flags.num_query_groups is not None:
        fields["num_query_groups"] = flags.num_query_groups
    vocab = vocab_size if vocab_size is not None else flags.vocab_size
    if vocab is not None:
        fields["vocab_size"] = vocab
    fields["sequence_parallel"] = bool(flags.sequence_parallel and
                                       flags.tensor_model_parallel_size > 1)
    fields["params_dtype"] = _params_dtype(flags)
    return fields


def _params_dtype(flags: argparse.Namespace):
    import torch

    return torch.bfloat16 if flags.bf16 else torch.float16 if flags.fp16 else torch.float32


def _megatron_defaults(fields: Dict[str, Any]) -> None:
    """Defaults Megatron derives from other flags when no zoo config is given."""
    if fields.get("activation") == "swiglu" and "ffn_hidden_size" not in fields:
        fields["ffn_hidden_size"] = int(4 * fields["hidden_size"] * 2 / 3 / 64) * 64
    fields.setdefault("max_position_embeddings", fields["seq_length"])


def build_model_config(flags: argparse.Namespace, tp: int, vocab_size: Optional[int]):
    """The TransformerConfig: --model's zoo config (if given) overridden by model flags."""
    fields = _model_overrides(flags, vocab_size)
    _positive(flags, *[d for d in MODEL_FIELDS if d not in (
        "hidden_dropout", "attention_dropout", "rotary_base", "norm_epsilon",
        "position_embedding_type", "normalization", "attention_backend",
        "recompute_granularity", "recompute_method", "untie_embeddings_and_output_weights")])
    if flags.model is not None:
        from gigatron.models.zoo import list_models, load_config

        if flags.model not in list_models():
            raise ValueError(f"--model {flags.model} is not in the zoo: choose one of "
                             f"{', '.join(list_models())}")
        config = load_config(flags.model, **fields)
    else:
        missing = [_flag(d) for d in REQUIRED_WITHOUT_MODEL if getattr(flags, d) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} required (or name a zoo model with --model)")
        if "vocab_size" not in fields:
            raise ValueError("the vocabulary size is unknown: give --tokenizer-type and its "
                             "files, or --vocab-size with --mock-data")
        _megatron_defaults(fields)
        from gigatron.models.config import TransformerConfig

        config = TransformerConfig(**fields)
    config.validate(tp)
    return config


def microbatches(flags: argparse.Namespace, dp: int) -> Tuple[int, int, int]:
    """(micro batch, global batch, micro-batches per step); gbs defaults to mbs x dp."""
    grad_acc = getattr(flags, "gradient_accumulation_steps", None)  # --deepspeed-config only
    if grad_acc is not None:
        from gigatron.training.deepspeed_config import deepspeed_batch_sizes

        _positive(flags, "micro_batch_size", "global_batch_size")
        mbs, gbs = deepspeed_batch_sizes(flags.global_batch_size, flags.micro_batch_size,
                                         grad_acc, dp)
        return mbs, gbs, grad_acc
    if flags.micro_batch_size is None:
        raise ValueError("--micro-batch-size is required")
    _positive(flags, "micro_batch_size", "global_batch_size")
    mbs = flags.micro_batch_size
    gbs = flags.global_batch_size if flags.global_batch_size is not None else mbs * dp
    if gbs % (mbs * dp):
        raise ValueError(
            f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs} x "
            f"data-parallel size {dp} = {mbs * dp}: change one of them")
    return mbs, gbs, gbs // (mbs * dp)


def check_train(flags: argparse.Namespace, parallel: ParallelConfig, model,
                num_microbatches: int) -> None:
    """Loop flags and the pipeline's needs on layers and micro-batches."""
    if flags.train_iters is None:
        raise ValueError("--train-iters is required")
    _positive(flags, "train_iters", "eval_interval", "log_interval", "exit_interval",
              "save_interval")
    if flags.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0, got {flags.eval_iters}")
    from gigatron.parallel.pipeline.partition import partition_layers
    from gigatron.parallel.pipeline.schedules import check_num_microbatches

    partition = partition_layers(
        model.num_layers, parallel.pp,
        first_stage_layers=parallel.decoder_first_pipeline_num_layers,
        last_stage_layers=parallel.decoder_last_pipeline_num_layers,
        num_layers_per_virtual_stage=parallel.num_layers_per_virtual_pipeline_stage)
    check_num_microbatches(num_microbatches, parallel.pp, partition.virtual_chunks)


def check_optimizer(flags: argparse.Namespace, parallel: ParallelConfig) -> None:
    """Precision, loss-scale and optimizer flags."""
    if flags.lr is None:
        raise ValueError("--lr is required")
    if flags.fp16 and flags.bf16:
        raise ValueError("--fp16 and --bf16 are exclusive: pick one")
    if flags.loss_scale is not None and not flags.fp16:
        raise ValueError("--loss-scale applies to --fp16 only: add --fp16 or drop it")
    _positive(flags, "loss_scale", "initial_loss_scale", "loss_scale_window", "hysteresis")
    power = math.log2(flags.initial_loss_scale)
    if power != int(power):
        raise ValueError(f"--initial-loss-scale {flags.initial_loss_scale} must be a power of 2 "
                         f"(dynamic scaling moves in factors of 2 from 2**initial_scale_power)")
    if flags.clip_grad < 0:
        raise ValueError(f"--clip-grad must be >= 0 (0 disables clipping), got {flags.clip_grad}")
    if flags.weight_decay < 0:
        raise ValueError(f"--weight-decay must be >= 0, got {flags.weight_decay}")
    for dest in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(flags, dest) < 1.0:
            raise ValueError(f"{_flag(dest)} must be in [0, 1), got {getattr(flags, dest)}")


def build_lr_schedule(flags: argparse.Namespace, global_batch_size: int) -> LRScheduleConfig:
    """Megatron's schedule in samples: iterations x global batch."""
    if flags.lr_warmup_fraction is not None and flags.lr_warmup_iters:
        raise ValueError("--lr-warmup-fraction and --lr-warmup-iters are exclusive: pick one")
    _positive(flags, "lr_decay_iters", "lr_wsd_decay_iters")
    decay_iters = flags.lr_decay_iters if flags.lr_decay_iters is not None else flags.train_iters
    decay_steps = decay_iters * global_batch_size
    if flags.lr_warmup_fraction is not None:
        if not 0.0 <= flags.lr_warmup_fraction < 1.0:
            raise ValueError(f"--lr-warmup-fraction must be in [0, 1), got "
                             f"{flags.lr_warmup_fraction}")
        warmup_steps = int(flags.lr_warmup_fraction * decay_steps)
    else:
        if flags.lr_warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {flags.lr_warmup_iters}")
        warmup_steps = flags.lr_warmup_iters * global_batch_size
    wsd = flags.lr_wsd_decay_iters * global_batch_size if flags.lr_wsd_decay_iters else None
    cfg = LRScheduleConfig(max_lr=flags.lr, min_lr=flags.min_lr,
                           decay_style=flags.lr_decay_style, warmup_steps=warmup_steps,
                           decay_steps=decay_steps, init_lr=flags.lr_warmup_init,
                           wsd_decay_steps=wsd, wsd_decay_style=flags.lr_wsd_decay_style)
    validate_schedule(cfg)
    return cfg


def check_data(flags: argparse.Namespace) -> None:
    """Exactly one data source, and the tokenizer's files for its type."""
    sources = [name for name, given in (
        ("--data-path", flags.data_path), ("--train-data-path", flags.train_data_path),
        ("--mock-data", flags.mock_data)) if given]
    if not sources:
        raise ValueError("no training data: give --data-path PREFIX (or --train-data-path/"
                         "--valid-data-path/--test-data-path, or --mock-data)")
    if len(sources) > 1:
        raise ValueError(f"{' and '.join(sources)} are exclusive: give one data source")
    if flags.data_path and len(flags.data_path) > 1 and len(flags.data_path) % 2:
        raise ValueError("--data-path with several datasets takes weight/prefix pairs: "
                         "--data-path 0.3 prefixA 0.7 prefixB")
    if (flags.valid_data_path or flags.test_data_path) and not flags.train_data_path:
        raise ValueError("--valid-data-path/--test-data-path need --train-data-path")
    _check_split(flags.split)
    if flags.mock_data:
        return
    needs = {"SentencePieceTokenizer": ("tokenizer_model",),
             "HuggingFaceTokenizer": ("tokenizer_model",),
             "GPT2BPETokenizer": ("vocab_file", "merge_file"),
             "NullTokenizer": ("vocab_size",)}
    if flags.tokenizer_type is None:
        raise ValueError("--tokenizer-type is required with real data (e.g. "
                         "SentencePieceTokenizer with --tokenizer-model)")
    missing = [_flag(d) for d in needs[flags.tokenizer_type] if getattr(flags, d) is None]
    if missing:
        raise ValueError(f"--tokenizer-type {flags.tokenizer_type} needs {', '.join(missing)}")
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        _check_prefixes(_flag(flag), getattr(flags, flag))


def _check_prefixes(flag: str, values) -> None:
    """Each dataset prefix names an existing .bin/.idx pair (weights come before prefixes)."""
    if not values:
        return
    prefixes = values[1::2] if len(values) > 1 else values
    for prefix in prefixes:
        for ext in (".idx", ".bin"):
            if not os.path.isfile(prefix + ext):
                hint = " (give the prefix without .bin/.idx)" if \
                    prefix.endswith((".bin", ".idx")) else \
                    " (the prefix tools/preprocess_data.py wrote, e.g. data/corpus_text_document)"
                raise ValueError(f"{flag} {prefix}: {prefix + ext} does not exist{hint}")


def _check_split(split: str) -> None:
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--split {split!r} must be numbers like 969,30,1") from None
    if not 1 <= len(parts) <= 3 or any(x < 0 for x in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r} must be up to three non-negative weights "
                         f"(train,valid,test) with a positive sum, like 969,30,1")


def check_checkpointing(flags: argparse.Namespace) -> None:
    """--save/--load companions."""
    if flags.save_interval is not None and flags.save is None:
        raise ValueError("--save-interval needs --save DIR")
    if flags.finetune and flags.load is None:
        raise ValueError("--finetune needs --load DIR (the checkpoint to start from)")


def check_logging(flags: argparse.Namespace) -> None:
    """Logging flags that need a value in range."""
    _positive(flags, "peak_tflops")
