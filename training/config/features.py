"""Flags that change how a run is carried out, not its numbers: checks before any rank
starts, and the banner's lines saying what each accepted flag maps to here.

Optional packages a flag needs (tensorboard, wandb) are looked up without importing them, so
a missing one is a configuration problem reported with the others, on every rank alike,
before a process group exists. Implementation selectors (--transformer-impl,
--attention-backend, --use-flash-attn, --use-mcore-models, Megatron-DeepSpeed's --deepspeed
...) are accepted and each gets one banner line; a choice that cannot be honoured says so.
"""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Callable, List, Optional

if TYPE_CHECKING:
    from gigatron.training.config.table import Settings
    from gigatron.training.config.validation import Problems

INSTALL = {"tensorboard": "pip install tensorboard (or pip install -e '.[monitor]')",
           "wandb": "pip install wandb"}


def installed(package: str) -> bool:
    """Whether `package` can be imported here (looked up, not imported)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def check_operational(s: "Settings", p: "Problems",
                      has_package: Optional[Callable[[str], bool]] = None,
                      has_cuda: Optional[bool] = None) -> None:
    """Logging sinks whose package is missing, and overlap/backend flags Megatron refuses
    (`has_package`, `has_cuda`: what this machine has; default: look)."""
    from gigatron.training.run.decoupled_lr import check_decoupled_lr
    from gigatron.training.config.megatron.fp8 import fp8_problems
    from gigatron.training.config.megatron.tp_comm import tp_comm_problems
    from gigatron.training.observe.profiling import check_profiling

    has_package = has_package or installed
    p.lines += fp8_problems(s) + tp_comm_problems(s)
    check_decoupled_lr(s.decoupled_lr, p)
    check_profiling(s.profiling, p)
    log, precision, parallel = s.logging, s.precision, s.parallel
    if log.tensorboard_dir and not has_package("tensorboard"):
        p.add(f"--tensorboard-dir needs the tensorboard package, which is not installed: "
              f"{INSTALL['tensorboard']}, or drop --tensorboard-dir")
    if log.wandb_project:
        if not has_package("wandb"):
            p.add(f"--wandb-project needs the wandb package, which is not installed: "
                  f"{INSTALL['wandb']}, or drop --wandb-project")
        if not log.wandb_exp_name:
            p.add("--wandb-project needs --wandb-exp-name NAME (the run's name, as Megatron "
                  "requires)")
    if precision.overlap_param_gather:
        if not (precision.use_distributed_optimizer or (precision.zero_stage or 0) >= 1):
            p.add("--overlap-param-gather needs the distributed optimizer: add "
                  "--use-distributed-optimizer (or --zero-stage 1, 2 or 3)")
        if not precision.overlap_comm:
            p.add("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron): add it")
    sequence_parallel_size = s.implementation.ds_sequence_parallel_size
    if sequence_parallel_size != 1:
        p.add(f"--ds-sequence-parallel-size {sequence_parallel_size}: Megatron-"
              f"DeepSpeed's Ulysses sequence parallelism is not supported: use 1 (Ulysses is "
              f"--context-parallel-size N --cp-comm-type a2a)")
    if parallel.no_pipeline_parallel and parallel.pp > 1:
        p.add("--no-pipeline-parallel contradicts --pipeline-model-parallel-size "
              f"{parallel.pp}: drop one")
    if parallel.distributed_backend == "gloo" and _cuda(has_cuda):
        p.add("--distributed-backend gloo with GPUs is not supported (gloo has no "
              "reduce-scatter of GPU tensors, which ZeRO and tensor parallelism need): drop it "
              "(GPUs use nccl)")


def _cuda(has_cuda: Optional[bool]) -> bool:
    if has_cuda is not None:
        return has_cuda
    import torch

    return torch.cuda.is_available()


def check_local_rank(local_rank: Optional[int], launcher_local_rank: int,
                     launcher: str) -> None:
    """--local-rank (torch.distributed.launch, DeepSpeed's launcher) must agree with the local
    rank the launcher's environment gives; the environment's is the one used."""
    if local_rank is not None and launcher != "none" and local_rank != launcher_local_rank:
        raise ValueError(f"--local-rank {local_rank} disagrees with the launcher's local rank "
                         f"{launcher_local_rank} ({launcher}): drop --local-rank")


def _impl_notes(s: "Settings", has_package: Callable[[str], bool]) -> List[str]:
    notes = []
    impl = s.implementation
    if impl.transformer_impl == "transformer_engine":
        state = "installed but not used" if has_package("transformer_engine") else \
            "not installed"
        notes.append(f"--transformer-impl transformer_engine: Transformer Engine is {state}; "
                     f"gigatron's own layers run (the numbers of Megatron's local layers)")
    elif impl.transformer_impl == "local":
        notes.append("--transformer-impl local: gigatron's own layers")
    if impl.use_mcore_models:
        notes.append("--use-mcore-models: gigatron's model is laid out as Megatron-Core's")
    chosen = s.model.attention_backend
    backend = chosen or ("flash" if impl.use_flash_attn else None)
    if backend is not None:
        from gigatron.training.config.megatron.model import ATTENTION_BACKENDS

        what = "torch scaled_dot_product_attention" if ATTENTION_BACKENDS[backend] == "sdpa" \
            else "the explicit softmax(QK^T)V of gigatron.ops"
        name = "--use-flash-attn" if impl.use_flash_attn and not chosen \
            else f"--attention-backend {backend}"
        notes.append(f"{name}: core attention is {what}")
    if s.model.openai_gelu:
        notes.append("--openai-gelu: no effect, as with Megatron-Core models")
    return notes


def _run_notes(s: "Settings", backend: str) -> List[str]:
    notes = []
    if s.parallel.distributed_backend == "nccl" and backend != "nccl":
        notes.append(f"--distributed-backend nccl: no GPU here, {backend} is used")
    if s.source.deepspeed:
        notes.append("--deepspeed: gigatron's own engine runs (ZeRO stage from --zero-stage "
                     "or --deepspeed_config)")
    if s.source.deepspeed_config:
        from gigatron.training.config.deepspeed.pretrain import deepspeed_config_notes
        from gigatron.training.config.table import flag_values

        notes += deepspeed_config_notes(flag_values(s))
    if s.checkpoint.save_interval and not s.checkpoint.save:
        notes.append("--save-interval without --save: no checkpoint is written (as in "
                     "Megatron, which saves only with --save)")
    if s.implementation.deepspeed_activation_checkpointing:
        notes.append("--deepspeed-activation-checkpointing: gigatron's recomputation runs, "
                     "as --recompute-granularity/--recompute-method say")
    if s.precision.loss_scale and not s.precision.fp16:
        notes.append("--loss-scale without --fp16: no effect (bf16 and fp32 train unscaled, "
                     "as DeepSpeed's bf16 does; Megatron-LM's bf16 would multiply by the "
                     "constant, which changes only rounding)")
    if s.train.rampup_batch_size and s.train.train_samples is None:
        notes.append("--rampup-batch-size with --train-iters (Megatron-LM refuses the pair): "
                     "the batch ramps over the consumed samples, --train-iters iterations run, "
                     "the lr lengths are iterations x --global-batch-size")
    if s.precision.overlap_param_gather:
        notes.append("--overlap-param-gather: ZeRO gathers the updated parameters under the "
                     "next forward (stages 1-2: each bucket's all-gather is launched after the "
                     "step and waited before the bucket's first use; stage 3: each layer just "
                     "in time, prefetched)")
    return notes


def flag_notes(s: "Settings", backend: str,
               has_package: Optional[Callable[[str], bool]] = None) -> List[str]:
    """One banner line per accepted flag that maps to something else here."""
    from gigatron.training.run.decoupled_lr import decoupled_lr_notes
    from gigatron.training.config.megatron.fp8 import fp8_notes
    from gigatron.training.config.megatron.tp_comm import tp_comm_notes
    from gigatron.training.observe.profiling import profiling_notes

    return _impl_notes(s, has_package or installed) + _run_notes(s, backend) + \
        fp8_notes(s.fp8, s.precision.overlap_param_gather) + tp_comm_notes(s) + \
        decoupled_lr_notes(s.decoupled_lr) + \
        profiling_notes(s.profiling, "cuda" if backend == "nccl" else "cpu")
