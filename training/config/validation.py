"""Validation of a run's settings, in one place: every problem is found, then all are raised.

Each check reads the typed settings (`table.Settings`) and adds one line per problem (naming
the flag or JSON key and the fix) to a `Problems` list instead of stopping at the first;
`ConfigError` (a ValueError) carries them all. The ZeRO rules come from
`gigatron.parallel.zero.config.zero_problems` and the model's from
`TransformerConfig.problems`, so a rule is written once for flags, JSON and Python users; the
model flags' mapping is `training/config/megatron/model.py`. `arguments.build_run` runs them
all, once.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Optional, Sequence, Tuple

from gigatron.training.config.run_config import ParallelConfig
from gigatron.training.config.table import flag_name

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig
    from gigatron.training.config.settings import DataSettings
    from gigatron.training.config.table import Settings


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

    # `gigatron launch`'s worker prints these lines alone, without the traceback (they say
    # what to fix; the frames would only bury them)
    report_without_traceback = True

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

    def positive(self, s: "Settings", *dests: str) -> None:
        """A line for each of the settings (by argparse dest) given <= 0."""
        for dest in dests:
            value = s.value(dest)
            if value is not None and value <= 0:
                self.add(f"{flag_name(dest)} must be > 0, got {value}")

    def raise_if_any(self) -> None:
        if self.lines:
            raise ConfigError(self.lines)


def data_parallel_size(world_size: int, tp: int, pp: int, cp: int = 1) -> int:
    """dp = world / (tp x cp x pp), as Megatron derives it from the launch size (the
    topology's rule and message)."""
    from gigatron.parallel.topology import Topology

    for dest, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                       ("context_parallel_size", cp)):
        if size < 1:
            raise ValueError(f"{flag_name(dest)} must be >= 1, got {size}")
    return Topology.from_world_size(world_size, tp=tp, pp=pp, cp=cp).dp


def check_parallel(s: "Settings", p: Problems) -> None:
    """Parallel flags that contradict each other."""
    if s.precision.use_distributed_optimizer and s.precision.zero_stage == 0:
        p.add("--use-distributed-optimizer (ZeRO stage 1) contradicts --zero-stage 0: drop one "
              "of them")
    p.positive(s, "distributed_timeout_minutes")
    from gigatron.parallel.zero.config import zero3_pipeline_problem

    pipelined = zero3_pipeline_problem(s.precision.zero_stage or 0, s.parallel.pp,
                                       "--zero-stage", "--pipeline-model-parallel-size")
    if pipelined:
        p.add(pipelined)


def microbatches(s: "Settings", dp: int, p: Problems) -> Optional[Tuple[int, int, int]]:
    """(micro batch, global batch, micro-batches per step); gbs defaults to mbs x dp."""
    n = len(p.lines)
    t = s.train
    p.positive(s, "micro_batch_size", "global_batch_size")
    grad_acc: Optional[int] = t.num_microbatches  # --deepspeed-config only (else None)
    if grad_acc is not None:  # DeepSpeed's rule completes and checks the three
        from gigatron.training.config.deepspeed.batch import deepspeed_batch_triple

        triple = None if len(p.lines) > n else p.run(
            deepspeed_batch_triple, t.global_batch_size, t.micro_batch_size, grad_acc, dp)
        return None if triple is None else (triple[1], triple[0], triple[2])
    mbs = t.micro_batch_size
    if mbs is None:
        p.add("--micro-batch-size is required")
    if len(p.lines) > n or mbs is None:
        return None
    gbs = t.global_batch_size if t.global_batch_size is not None else mbs * dp
    if gbs % (mbs * dp):
        p.add(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs} x "
              f"data-parallel size {dp} = {mbs * dp}: change one of them")
        return None
    return mbs, gbs, gbs // (mbs * dp)


def check_train(s: "Settings", parallel: ParallelConfig, model: Optional["TransformerConfig"],
                num_microbatches: Sequence[int], p: Problems) -> None:
    """Loop settings and the pipeline's needs on layers and on each step's micro-batches (one
    count, or each of a batch ramp-up's); the training length is `megatron/schedule.py`'s."""
    p.positive(s, "eval_interval", "log_interval", "exit_interval", "save_interval",
               "exit_duration_in_mins", "straggler_minmax_count")
    if s.train.eval_iters < 0:
        p.add(f"--eval-iters must be >= 0, got {s.train.eval_iters}")
    if model is None:
        return
    from gigatron.parallel.pipeline.partition import partition_layers
    from gigatron.parallel.pipeline.schedules import check_num_microbatches

    partition = p.run(partition_layers, model.num_layers, parallel.pp,
                      first_stage_layers=parallel.decoder_first_pipeline_num_layers,
                      last_stage_layers=parallel.decoder_last_pipeline_num_layers,
                      num_layers_per_virtual_stage=parallel.num_layers_per_virtual_pipeline_stage,
                      virtual_stages_per_rank=parallel.num_virtual_stages_per_pipeline_rank)
    if partition is not None:
        for count in num_microbatches:
            p.run(check_num_microbatches, count, parallel.pp, partition.virtual_chunks)
        from gigatron.parallel.pipeline.schedules import schedule_problems

        for line in schedule_problems(
                parallel.pipeline_schedule, partition.virtual_chunks,
                tied_embeddings=not model.untie_embeddings_and_output_weights,
                zero_stage=s.precision.zero_stage or 0):
            p.add(line)
    if parallel.delay_wgrad_compute and parallel.pipeline_schedule not in ("zb-h1", "zbv"):
        p.add(f"--delay-wgrad-compute needs a schedule that runs weight gradients apart: use "
              f"--pipeline-schedule zb-h1 or zbv (--pipeline-schedule "
              f"{parallel.pipeline_schedule} computes them in the backward)")
    full = model.recompute_granularity == "full"
    if s.implementation.torch_compile and model.num_moe_experts and full:
        # the re-run of a compiled MoE layer inside the block's checkpoint traces another
        # graph (no losses added) that saves other tensors than its forward did
        p.add("--torch-compile with --recompute-granularity full is not supported for MoE "
              "models (the compiled layer's recompute saves other tensors than its forward): "
              "use --recompute-granularity selective (--recompute-modules moe, or "
              "--selective-ac-option op), or drop --torch-compile")


def check_optimizer(s: "Settings", p: Problems) -> None:
    """Precision and loss-scale settings (the ZeroConfig rules are in zero_problems)."""
    precision, scale = s.precision, s.precision.initial_loss_scale
    if s.optimizer.lr is None:
        p.add("--lr is required")
    if precision.fp16 and precision.bf16:
        p.add("--fp16 and --bf16 are exclusive: pick one")
    if scale <= 0:
        p.add(f"--initial-loss-scale must be > 0, got {scale}")
    elif not math.log2(scale).is_integer():
        p.add(f"--initial-loss-scale {scale} must be a power of 2 "
              f"(dynamic scaling moves in factors of 2 from 2**initial_scale_power)")


def check_data(data: "DataSettings", p: Problems) -> None:
    """Exactly one data source, and its files (the tokenizer's: `arguments.build_tokenizer`)."""
    sources = [name for name, given in (
        ("--data-path", data.data_path), ("--train-data-path", data.train_data_path),
        ("--mock-data", data.mock_data)) if given]
    if not sources:
        p.add("no training data: give --data-path PREFIX (or --train-data-path/"
              "--valid-data-path/--test-data-path, or --mock-data)")
    if len(sources) > 1:
        p.add(f"{' and '.join(sources)} are exclusive: give one data source")
    if data.data_path and len(data.data_path) > 1 and len(data.data_path) % 2:
        p.add("--data-path with several datasets takes weight/prefix pairs: "
              "--data-path 0.3 prefixA 0.7 prefixB")
    if (data.valid_data_path or data.test_data_path) and not data.train_data_path:
        p.add("--valid-data-path/--test-data-path need --train-data-path")
    from gigatron.data.splits import parse_split

    p.run(parse_split, data.split)
    if data.sft:
        _check_sft(data, p)
    elif not data.mock_data:
        for dest in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            _check_prefixes(flag_name(dest), getattr(data, dest), p)


def _check_sft(data: "DataSettings", p: Problems) -> None:
    """--sft reads conversation files (not .bin/.idx prefixes) with a Hugging Face
    tokenizer's chat template (data/sft/)."""
    if data.mock_data:
        p.add("--sft reads conversations from --data-path FILE.jsonl: drop --mock-data")
    resets = [flag for flag, on in (("--reset-position-ids", data.reset_position_ids),
                                     ("--reset-attention-mask", data.reset_attention_mask)) if on]
    if resets:  # Megatron-LM's SFTDataset asserts them off
        p.add(f"--sft already restarts positions and attention at each conversation: drop "
              f"{' and '.join(resets)}")
    if data.tokenizer_type != "HuggingFaceTokenizer":
        p.add(f"--sft tokenizes with a chat template: give --tokenizer-type "
              f"HuggingFaceTokenizer --tokenizer-model DIR (a Hugging Face tokenizer folder), "
              f"not {data.tokenizer_type or 'the default GPT2BPETokenizer'}")
    for dest in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        values = getattr(data, dest)
        for path in (values[1::2] if values and len(values) > 1 else values or []):
            if not os.path.isfile(path):
                p.add(f"{flag_name(dest)} {path}: no such file (--sft reads JSON-lines "
                      f"conversation files, e.g. data/chat.jsonl)")


def _check_prefixes(flag: str, values: Optional[List[str]], p: Problems) -> None:
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


def check_checkpointing(s: "Settings", p: Problems) -> None:
    """--save/--load companions."""
    ck = s.checkpoint
    if ck.finetune and ck.load is None:
        p.add("--finetune needs --load DIR (the checkpoint to start from)")
    if ck.use_checkpoint_args and ck.load is None:
        p.add("--use-checkpoint-args needs --load DIR (the checkpoint whose args to take)")
    if ck.ckpt_step is not None and ck.load is None:
        p.add(f"--ckpt-step {ck.ckpt_step} needs --load DIR (the checkpoints to pick from)")
    if ck.async_save and ck.ckpt_format != "torch_dist":
        p.add(f"--async-save needs --ckpt-format torch_dist (got {ck.ckpt_format}): drop "
              f"--ckpt-format or --async-save")
    _check_non_persistent(ck, p)
    if ck.override_opt_param_scheduler and ck.use_checkpoint_opt_param_scheduler:
        p.add("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
              "contradict each other: give one")
    for flag, path in (("--save", ck.save), ("--load", ck.load)):
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            p.add(f"{flag} {path} is a file, not a checkpoint directory: give a directory "
                  f"(it is created if missing)" if flag == "--save" else
                  f"{flag} {path} is a file, not a checkpoint directory: give the folder "
                  f"--save wrote")


def _check_non_persistent(ck: Any, p: Problems) -> None:
    """--non-persistent-* companions (training/checkpoint/non_persistent.py)."""
    kind, interval = ck.non_persistent_ckpt_type, ck.non_persistent_save_interval
    if interval is not None and interval <= 0:
        p.add(f"--non-persistent-save-interval must be > 0, got {interval}")
    elif interval and kind is None:
        p.add("--non-persistent-save-interval needs --non-persistent-ckpt-type global, local "
              "or in_memory (where the checkpoints go)")
    elif interval and ck.save is None:
        p.add("--non-persistent-save-interval needs --save DIR (as in Megatron: the "
              "persistent checkpoints' folder, which also names the job's non-persistent ones)")
    if kind == "global" and ck.save and ck.non_persistent_global_ckpt_dir and \
            os.path.abspath(ck.non_persistent_global_ckpt_dir) == os.path.abspath(ck.save):
        p.add(f"--non-persistent-global-ckpt-dir {ck.non_persistent_global_ckpt_dir} is the "
              f"--save folder, whose checkpoints the non-persistent saves would delete: give "
              f"another folder (default --save/non_persistent)")
    if kind == "local" and ck.non_persistent_local_ckpt_dir is None:
        p.add("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR "
              "(node-local storage, e.g. an NVMe mount)")
    if kind == "in_memory" and ck.non_persistent_local_ckpt_dir is None and \
            not os.path.isdir("/dev/shm"):
        p.add("--non-persistent-ckpt-type in_memory: /dev/shm does not exist here; give "
              "--non-persistent-local-ckpt-dir DIR (a tmpfs folder)")


def check_logging(s: "Settings", p: Problems) -> None:
    """Logging settings that need a value in range."""
    p.positive(s, "peak_tflops")
