"""Validation of a run's settings, in one place: every problem is found, then all are raised.

Each check adds one line per problem (naming the flag or JSON key and the fix) to a
`Problems` list instead of stopping at the first; `ConfigError` (a ValueError) carries them
all. The ZeRO rules come from `gigatron.parallel.zero.config.zero_problems` and the model's
from `TransformerConfig.problems`, so a rule is written once for flags, JSON and Python users.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from gigatron.training.config import LRScheduleConfig, ParallelConfig
from gigatron.training.config_table import flag_name
from gigatron.training.lr_schedule import validate_schedule

if TYPE_CHECKING:
    import torch
    from gigatron.models.config import TransformerConfig

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
_POSITIVE_MODEL = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                   "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by",
                   "init_method_std", "recompute_num_layers")
REQUIRED_WITHOUT_MODEL = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def dedupe(lines: Iterable[str]) -> List[str]:
    """The lines without repeats, in order."""
    return list(dict.fromkeys(lines))


def join_problems(problems: Sequence[str]) -> str:
    """One problem: its line. Several: a count, then one indented line each."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems)


class ConfigError(ValueError):
    """Every problem of a command line or DeepSpeed config, one line each."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = dedupe(problems)
        super().__init__(join_problems(self.problems))


class Problems:
    """Collects problem lines; `raise_if_any` raises them together as one ConfigError."""

    def __init__(self) -> None:
        self.lines: List[str] = []

    def __bool__(self) -> bool:
        return bool(self.lines)

    def add(self, line: str) -> None:
        self.lines.append(line)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args) or None; a ValueError it raises is recorded (each of its lines)."""
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            self.lines += err.problems
        except ValueError as err:
            self.lines += str(err).splitlines()
        return None

    def positive(self, flags: argparse.Namespace, *dests: str) -> None:
        for dest in dests:
            value = getattr(flags, dest)
            if value is not None and value <= 0:
                self.add(f"{flag_name(dest)} must be > 0, got {value}")

    def raise_if_any(self) -> None:
        if self.lines:
            raise ConfigError(self.lines)


def data_parallel_size(world_size: int, tp: int, pp: int) -> int:
    """dp = world / (tp x pp), as Megatron derives it from the launch size (the topology's
    rule and message)."""
    from gigatron.parallel.topology import Topology

    for dest, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if size < 1:
            raise ValueError(f"{flag_name(dest)} must be >= 1, got {size}")
    return Topology.from_world_size(world_size, tp=tp, pp=pp).dp


def check_parallel(flags: argparse.Namespace, p: Problems) -> None:
    """Parallel flags that contradict each other."""
    if flags.use_distributed_optimizer and flags.zero_stage == 0:
        p.add("--use-distributed-optimizer (ZeRO stage 1) contradicts --zero-stage 0: drop one "
              "of them")
    p.positive(flags, "distributed_timeout_minutes")
    if flags.zero_stage == 3 and flags.pipeline_model_parallel_size > 1:
        p.add("--zero-stage 3 needs --pipeline-model-parallel-size 1 (a pipeline stage would "
              "re-gather every layer per micro-batch): use --zero-stage 2")


def _model_overrides(flags: argparse.Namespace, vocab_size: Optional[int],
                     p: Problems) -> Dict[str, Any]:
    """TransformerConfig fields set by flags (only those given, so zoo values show through)."""
    fields = {f: getattr(flags, d) for d, f in MODEL_FIELDS.items()
              if getattr(flags, d) is not None}
    if flags.swiglu:
        fields["activation"] = "swiglu"
    if flags.disable_bias_linear:
        fields["add_bias_linear"] = False
    if flags.group_query_attention and flags.num_query_groups is None:
        p.add("--group-query-attention needs --num-query-groups N")
    elif not flags.group_query_attention and flags.num_query_groups is not None \
            and flags.model is None:
        p.add("--num-query-groups is used only with --group-query-attention: add it")
    elif flags.num_query_groups is not None:
        fields["num_query_groups"] = flags.num_query_groups
    vocab = vocab_size if vocab_size is not None else flags.vocab_size
    if vocab is not None:
        fields["vocab_size"] = vocab
    fields["sequence_parallel"] = bool(flags.sequence_parallel and
                                       flags.tensor_model_parallel_size > 1)
    fields["params_dtype"] = params_dtype(flags)
    return fields


def params_dtype(flags: argparse.Namespace) -> "torch.dtype":
    """The parameters' dtype of --fp16 / --bf16 (fp32 without either)."""
    import torch

    return torch.bfloat16 if flags.bf16 else torch.float16 if flags.fp16 else torch.float32


def _megatron_defaults(fields: Dict[str, Any]) -> None:
    """Defaults Megatron derives from other flags when no zoo config is given."""
    if fields.get("activation") == "swiglu" and "ffn_hidden_size" not in fields:
        fields["ffn_hidden_size"] = int(4 * fields["hidden_size"] * 2 / 3 / 64) * 64
    fields.setdefault("max_position_embeddings", fields["seq_length"])


def build_model_config(flags: argparse.Namespace, tp: int, vocab_size: Optional[int],
                       p: Problems) -> Optional["TransformerConfig"]:
    """The TransformerConfig: --model's zoo config (if given) overridden by model flags;
    None (with the problems recorded) when it cannot be built."""
    n = len(p.lines)
    fields = _model_overrides(flags, vocab_size, p)
    p.positive(flags, *_POSITIVE_MODEL)
    if flags.model is not None:
        from gigatron.models.zoo import list_models, load_config

        if flags.model not in list_models():
            p.add(f"--model {flags.model} is not in the zoo: choose one of "
                  f"{', '.join(list_models())}")
            return None
        build: Callable[..., "TransformerConfig"] = load_config
        args: Tuple = (flags.model,)
    else:
        missing = [flag_name(d) for d in REQUIRED_WITHOUT_MODEL if getattr(flags, d) is None]
        if missing:
            p.add(f"{', '.join(missing)} required (or name a zoo model with --model)")
        if "vocab_size" not in fields:
            p.add("the vocabulary size is unknown: give --tokenizer-type and its files, or "
                  "--vocab-size with --mock-data")
        if len(p.lines) == n:
            _megatron_defaults(fields)
        from gigatron.models.config import TransformerConfig

        build, args = TransformerConfig, ()
    if len(p.lines) > n:
        return None
    config = p.run(build, *args, **fields)
    if config is not None:
        p.lines += config.problems(tp)
    return config if len(p.lines) == n else None


def microbatches(flags: argparse.Namespace, dp: int,
                 p: Problems) -> Optional[Tuple[int, int, int]]:
    """(micro batch, global batch, micro-batches per step); gbs defaults to mbs x dp."""
    n = len(p.lines)
    p.positive(flags, "micro_batch_size", "global_batch_size")
    grad_acc = flags.gradient_accumulation_steps  # --deepspeed-config only
    if grad_acc is not None:
        from gigatron.training.deepspeed_config import deepspeed_batch_sizes

        sizes = None if len(p.lines) > n else p.run(
            deepspeed_batch_sizes, flags.global_batch_size, flags.micro_batch_size, grad_acc,
            dp)
        return None if sizes is None else (*sizes, grad_acc)
    if flags.micro_batch_size is None:
        p.add("--micro-batch-size is required")
    if len(p.lines) > n:
        return None
    mbs = flags.micro_batch_size
    gbs = flags.global_batch_size if flags.global_batch_size is not None else mbs * dp
    if gbs % (mbs * dp):
        p.add(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs} x "
              f"data-parallel size {dp} = {mbs * dp}: change one of them")
        return None
    return mbs, gbs, gbs // (mbs * dp)


def check_train(flags: argparse.Namespace, parallel: ParallelConfig,
                model: Optional["TransformerConfig"],
                num_microbatches: Optional[int], p: Problems) -> None:
    """Loop flags and the pipeline's needs on layers and micro-batches."""
    if flags.train_iters is None:
        p.add("--train-iters is required")
    p.positive(flags, "train_iters", "eval_interval", "log_interval", "exit_interval",
               "save_interval")
    if flags.eval_iters < 0:
        p.add(f"--eval-iters must be >= 0, got {flags.eval_iters}")
    if model is None:
        return
    from gigatron.parallel.pipeline.partition import partition_layers
    from gigatron.parallel.pipeline.schedules import check_num_microbatches

    partition = p.run(partition_layers, model.num_layers, parallel.pp,
                      first_stage_layers=parallel.decoder_first_pipeline_num_layers,
                      last_stage_layers=parallel.decoder_last_pipeline_num_layers,
                      num_layers_per_virtual_stage=parallel.num_layers_per_virtual_pipeline_stage)
    if partition is not None and num_microbatches is not None:
        p.run(check_num_microbatches, num_microbatches, parallel.pp, partition.virtual_chunks)


def check_optimizer(flags: argparse.Namespace, p: Problems) -> None:
    """Precision and loss-scale flags (the ZeroConfig rules are in zero_problems)."""
    if flags.lr is None:
        p.add("--lr is required")
    if flags.fp16 and flags.bf16:
        p.add("--fp16 and --bf16 are exclusive: pick one")
    if flags.loss_scale is not None and not flags.fp16:
        p.add("--loss-scale applies to --fp16 only: add --fp16 or drop it")
    if flags.initial_loss_scale <= 0:
        p.add(f"--initial-loss-scale must be > 0, got {flags.initial_loss_scale}")
    elif not math.log2(flags.initial_loss_scale).is_integer():
        p.add(f"--initial-loss-scale {flags.initial_loss_scale} must be a power of 2 "
              f"(dynamic scaling moves in factors of 2 from 2**initial_scale_power)")


def build_lr_schedule(flags: argparse.Namespace, global_batch_size: int,
                      p: Optional[Problems] = None) -> Optional[LRScheduleConfig]:
    """Megatron's schedule in samples: iterations x global batch (None if it cannot be
    built; without `p`, problems raise)."""
    own = p is None
    p = Problems() if p is None else p
    n = len(p.lines)
    if flags.lr_warmup_fraction is not None and flags.lr_warmup_iters:
        p.add("--lr-warmup-fraction and --lr-warmup-iters are exclusive: pick one")
    p.positive(flags, "lr_decay_iters", "lr_wsd_decay_iters")
    if flags.lr_warmup_fraction is not None and not 0.0 <= flags.lr_warmup_fraction < 1.0:
        p.add(f"--lr-warmup-fraction must be in [0, 1), got {flags.lr_warmup_fraction}")
    if flags.lr_warmup_iters < 0:
        p.add(f"--lr-warmup-iters must be >= 0, got {flags.lr_warmup_iters}")
    decay_iters = flags.lr_decay_iters if flags.lr_decay_iters is not None else flags.train_iters
    if len(p.lines) > n or flags.lr is None or decay_iters is None or decay_iters <= 0:
        if own:
            p.raise_if_any()
        return None
    decay_steps = decay_iters * global_batch_size
    if flags.lr_warmup_fraction is not None:
        warmup_steps = int(flags.lr_warmup_fraction * decay_steps)
    else:
        warmup_steps = flags.lr_warmup_iters * global_batch_size
    wsd = flags.lr_wsd_decay_iters * global_batch_size if flags.lr_wsd_decay_iters else None
    cfg = LRScheduleConfig(max_lr=flags.lr, min_lr=flags.min_lr,
                           decay_style=flags.lr_decay_style, warmup_steps=warmup_steps,
                           decay_steps=decay_steps, init_lr=flags.lr_warmup_init,
                           wsd_decay_steps=wsd, wsd_decay_style=flags.lr_wsd_decay_style)
    p.run(validate_schedule, cfg)
    if own:
        p.raise_if_any()
    return cfg if len(p.lines) == n else None


def check_data(flags: argparse.Namespace, p: Optional[Problems] = None) -> None:
    """Exactly one data source, and the tokenizer's files for its type (without `p`, the
    problems raise as one ConfigError)."""
    own = p is None
    p = Problems() if p is None else p
    sources = [name for name, given in (
        ("--data-path", flags.data_path), ("--train-data-path", flags.train_data_path),
        ("--mock-data", flags.mock_data)) if given]
    if not sources:
        p.add("no training data: give --data-path PREFIX (or --train-data-path/"
              "--valid-data-path/--test-data-path, or --mock-data)")
    if len(sources) > 1:
        p.add(f"{' and '.join(sources)} are exclusive: give one data source")
    if flags.data_path and len(flags.data_path) > 1 and len(flags.data_path) % 2:
        p.add("--data-path with several datasets takes weight/prefix pairs: "
              "--data-path 0.3 prefixA 0.7 prefixB")
    if (flags.valid_data_path or flags.test_data_path) and not flags.train_data_path:
        p.add("--valid-data-path/--test-data-path need --train-data-path")
    from gigatron.data.splits import parse_split

    p.run(parse_split, flags.split)
    if not flags.mock_data:
        _check_tokenizer_and_files(flags, p)
    if own:
        p.raise_if_any()


def _check_tokenizer_and_files(flags: argparse.Namespace, p: Problems) -> None:
    from gigatron.data.tokenizer import missing_tokenizer_flags

    tokenizer_type, missing = missing_tokenizer_flags(vars(flags))
    if missing:
        default = "" if flags.tokenizer_type else " (Megatron's default when --tokenizer-type " \
            "is not given)"
        p.add(f"--tokenizer-type {tokenizer_type}{default} needs "
              f"{', '.join(flag_name(d) for d in missing)}")
    for dest in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        _check_prefixes(flag_name(dest), getattr(flags, dest), p)


def _check_prefixes(flag: str, values, p: Problems) -> None:
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
                p.add(f"{flag} {prefix}: {prefix + ext} does not exist{hint}")
                break


def check_checkpointing(flags: argparse.Namespace, p: Problems) -> None:
    """--save/--load companions."""
    if flags.save_interval is not None and flags.save is None:
        p.add("--save-interval needs --save DIR")
    if flags.finetune and flags.load is None:
        p.add("--finetune needs --load DIR (the checkpoint to start from)")
    if flags.override_opt_param_scheduler and flags.use_checkpoint_opt_param_scheduler:
        p.add("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
              "contradict each other: give one")
    for flag, path in (("--save", flags.save), ("--load", flags.load)):
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            p.add(f"{flag} {path} is a file, not a checkpoint directory: give a directory "
                  f"(it is created if missing)" if flag == "--save" else
                  f"{flag} {path} is a file, not a checkpoint directory: give the folder "
                  f"--save wrote")


def check_logging(flags: argparse.Namespace, p: Problems) -> None:
    """Logging flags that need a value in range."""
    p.positive(flags, "peak_tflops")
