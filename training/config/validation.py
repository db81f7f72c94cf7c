"""Validation of a run's settings, in one place: every problem is found, then all are raised.

Each check adds one line per problem (naming the flag or JSON key and the fix) to a
`Problems` list instead of stopping at the first; `ConfigError` (a ValueError) carries them
all. The ZeRO rules come from `gigatron.parallel.zero.config.zero_problems` and the model's
from `TransformerConfig.problems`, so a rule is written once for flags, JSON and Python users;
the model flags' mapping is `training/config/megatron/model.py`.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Optional, Sequence, Tuple

from gigatron.training.config.run_config import ParallelConfig
from gigatron.training.config.table import flag_name

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig


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
    from gigatron.parallel.zero.config import zero3_pipeline_problem

    pipelined = zero3_pipeline_problem(flags.zero_stage, flags.pipeline_model_parallel_size,
                                       "--zero-stage", "--pipeline-model-parallel-size")
    if pipelined:
        p.add(pipelined)


def microbatches(flags: argparse.Namespace, dp: int,
                 p: Problems) -> Optional[Tuple[int, int, int]]:
    """(micro batch, global batch, micro-batches per step); gbs defaults to mbs x dp."""
    n = len(p.lines)
    p.positive(flags, "micro_batch_size", "global_batch_size")
    grad_acc = flags.gradient_accumulation_steps  # --deepspeed-config only
    if grad_acc is not None:  # DeepSpeed's rule completes and checks the three
        from gigatron.training.config.deepspeed.batch import deepspeed_batch_triple

        triple = None if len(p.lines) > n else p.run(
            deepspeed_batch_triple, flags.global_batch_size, flags.micro_batch_size, grad_acc,
            dp)
        return None if triple is None else (triple[1], triple[0], triple[2])
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
                num_microbatches: Sequence[int], p: Problems) -> None:
    """Loop flags and the pipeline's needs on layers and on each step's micro-batches (one
    count, or each of a batch ramp-up's); the training length is `schedule_flags`'."""
    p.positive(flags, "eval_interval", "log_interval", "exit_interval", "save_interval",
               "exit_duration_in_mins")
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
    if partition is not None:
        for count in num_microbatches:
            p.run(check_num_microbatches, count, parallel.pp, partition.virtual_chunks)


def check_optimizer(flags: argparse.Namespace, p: Problems) -> None:
    """Precision and loss-scale flags (the ZeroConfig rules are in zero_problems)."""
    if flags.lr is None:
        p.add("--lr is required")
    if flags.fp16 and flags.bf16:
        p.add("--fp16 and --bf16 are exclusive: pick one")
    if flags.initial_loss_scale <= 0:
        p.add(f"--initial-loss-scale must be > 0, got {flags.initial_loss_scale}")
    elif not math.log2(flags.initial_loss_scale).is_integer():
        p.add(f"--initial-loss-scale {flags.initial_loss_scale} must be a power of 2 "
              f"(dynamic scaling moves in factors of 2 from 2**initial_scale_power)")


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
    if flags.finetune and flags.load is None:
        p.add("--finetune needs --load DIR (the checkpoint to start from)")
    if flags.async_save and flags.ckpt_format != "torch_dist":
        p.add(f"--async-save needs --ckpt-format torch_dist (got {flags.ckpt_format}): drop "
              f"--ckpt-format or --async-save")
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
