"""The DeepSpeed keys `gigatron.initialize` knows beyond the config table's, and what each does.

The config table (`training/config/table.py`) holds the keys pretrain_gpt.py shares with the engine
(batch sizes, fp16/bf16, ZeRO stage and buckets, clipping, logging); this module lists the rest,
with DeepSpeed's defaults as deepspeedai/DeepSpeed reads them (read at edaa7221, version
0.19.6, and its config-json docs):

- ENGINE_KEYS: read by the engine reader (`training/config/deepspeed/engine.py`) into EngineConfig;
- SPEED_ONLY: they only tune speed, memory or diagnostics in DeepSpeed and have no counterpart
  here: accepted with one info line each;
- DEFAULT_ONLY: accepted at DeepSpeed's default; another value would change results and is not
  implemented, so it is an error; OFF_ONLY: sections accepted while not enabled; REFUSED:
  sections that only mean something with a DeepSpeed feature not implemented here.

`check_keys` walks a config once and reports all of it; an unknown key is an error naming the
nearest valid spelling (DeepSpeed itself ignores unknown top-level keys). Its walk,
`walk_keys`, is also pretrain_gpt.py's (over the config table's keys, `pretrain.py`).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Mapping, Set, Tuple

from gigatron.training.config.spelling import did_you_mean
from gigatron.training.config.table import table

_JOB = "DeepSpeedJobName"
ENGINE_KEYS: Dict[str, Any] = {  # key -> DeepSpeed's default
    "prescale_gradients": False, "gradient_predivide_factor": 1.0,
    "communication_data_type": None, "zero_allow_untested_optimizer": False,
    "dataloader_drop_last": False,
    "auto_cast_inputs": False,  # gigatron's extension: move/cast batches to the engine
    "fp16.auto_cast": False,
    "zero_optimization.offload_param.device": "none",
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "optimizer.type": None, "optimizer.params": None,
    "scheduler.type": None, "scheduler.params": None,
    "activation_checkpointing.partition_activations": False,
    "activation_checkpointing.contiguous_memory_optimization": False,
    "activation_checkpointing.cpu_checkpointing": False,
    "activation_checkpointing.number_checkpoints": None,
    "activation_checkpointing.synchronize_checkpoint_boundary": False,
    "activation_checkpointing.profile": False,
    "tensorboard.enabled": False, "tensorboard.output_path": "", "tensorboard.job_name": _JOB,
    "csv_monitor.enabled": False, "csv_monitor.output_path": "", "csv_monitor.job_name": _JOB,
    "wandb.enabled": False, "wandb.group": None, "wandb.team": None, "wandb.project": "deepspeed",
    "checkpoint.tag_validation": "Warn", "checkpoint.load_universal": False,
    "checkpoint.use_node_local_storage": False,
    "data_types.grad_accum_dtype": None,
}

_Z, _OO, _OP = "zero_optimization.", "zero_optimization.offload_optimizer.", \
    "zero_optimization.offload_param."
_BUFFERS = "ZeRO keeps its own flat buffers"
_STAGE3 = "ZeRO-3 here gathers each layer's parameters when it runs and frees them after"
SPEED_ONLY: Dict[str, str] = {  # key -> why it has no effect here
    **{_Z + k: _BUFFERS for k in (
        "contiguous_gradients", "reduce_scatter", "allgather_partitions", "allgather_bucket_size",
        "use_multi_rank_bucket_allreduce", "sub_group_size", "round_robin_gradients",
        "memory_efficient_linear", "legacy_stage1", "zero_hpz_partition_size", "mics_shard_size",
        "mics_hierarchical_params_gather", "cpu_offload_use_pin_memory")},
    **{_Z + k: _STAGE3 for k in (
        "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
        "stage3_max_live_parameters", "stage3_max_reuse_distance",
        "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
        "stage3_allgather_sequential", "leaf_module", "override_module_apply",
        "ignore_unused_parameters")},
    **{_Z + k: "checkpoints always hold the full parameters" for k in (
        "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
        "elastic_checkpoint", "pipeline_loading_checkpoint")},
    **{_Z + k: "a DeepSpeed debugging aid" for k in (
        "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory")},
    **{_OO + k: "offloaded optimizer state lives in (pinned, on CUDA) host memory" for k in (
        "pin_memory", "buffer_count", "pipeline_read", "pipeline_write", "fast_init", "ratio",
        "super_offload", "cpuadam_cores_perc", "nvme_path")},
    **{_OP + k: "parameters are not offloaded here" for k in (
        "pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "nvme_path")},
    "bf16.immediate_grad_update": "gradients accumulate in fp32 flat buffers",
    "bf16.check_grad_overflow": "bf16 steps are not skipped on a non-finite gradient here",
    "zero_force_ds_cpu_optimizer": "the offloaded step runs torch's optimizer on the host",
    "optimizer.legacy_fusion": "optimizers run over flat buffers",
    "flops_profiler": "TFLOP/s are not profiled per module; use torch.profiler",
    "comms_logger": "collectives are counted in gigatron.parallel.comm.stats",
    "timers": "no throughput timers",
    "dump_state": "no state dump", "memory_breakdown": "no memory breakdown",
    "disable_allgather": "parameter shards are all-gathered", "aio": "no NVMe offload",
    "compile": "call torch.compile on the model yourself", "graph_harvesting": "no CUDA graphs",
    "autotuning": "there is no autotuner launcher", "nebula": "checkpoints are written by torch",
    "datastates": "checkpoints are written by torch", "log_level": "no DeepSpeed logger",
    "vocabulary_size": "only DeepSpeed's tensor-core alignment warning",
    "seq_parallel_communication_data_type": "no Ulysses sequence parallelism",
    "checkpoint.parallel_write": "checkpoints are written by torch.distributed.checkpoint",
    "checkpoint.writer": "checkpoints are written by torch.distributed.checkpoint",
}
DEFAULT_ONLY: Dict[str, Tuple[Any, str]] = {  # key -> (DeepSpeed's default, why no other)
    "sparse_gradients": (False, "sparse embedding gradients are not implemented"),
    "gradient_allreduce_op": ("mean", "gradients are averaged over data-parallel ranks"),
    "sequence_parallel_size": (1, "Ulysses sequence parallelism is not implemented"),
    "use_data_before_expert_parallelism": (False, "expert parallelism is not implemented"),
    "fp16.fp16_master_weights_and_grads": (False, "master weights and gradients stay fp32"),
    "bf16.bf16_master_weights_and_grads": (False, "master weights and gradients stay fp32"),
    "bf16.bf16_optimizer_states": (False, "optimizer state stays fp32"),
    _Z + "load_from_fp32_weights": (True, "a load restores the fp32 master weights"),
    **{_Z + k: (False, "ZeRO++ quantized communication is not implemented") for k in (
        "zero_quantized_weights", "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients")},
    _Z + "zeropp_loco_param": (None, "ZeRO++ LoCo is not implemented"),
    _Z + "zenflow": (None, "ZenFlow's delayed updates are not implemented"),
    "data_types.param_dtype": (None, "parameters take the fp16/bf16 section's dtype"),
    "data_types.buffer_dtype": (None, "buffers take the fp16/bf16 section's dtype"),
}
OFF_ONLY: Dict[str, str] = {  # section -> what to do instead (refused when enabled)
    "amp": 'NVIDIA Apex AMP is not supported: use "fp16" or "bf16"',
    "torch_autocast": 'use "bf16" or "fp16" (with "auto_cast": true)',
    "elasticity": "elastic batch sizes are not implemented: give the batch sizes",
    "progressive_layer_drop": "progressive layer drop is not implemented",
    "curriculum_learning": "curriculum learning is not implemented",
    "data_efficiency": "DeepSpeed's data efficiency library is not implemented",
    "eigenvalue": "eigenvalue computation is not implemented",
    "quantize_training": "quantization-aware training is not implemented",
    "hybrid_engine": "the RLHF hybrid engine is not implemented",
    "comet": "Comet ML is not supported: use tensorboard, csv_monitor or wandb",
}
REFUSED: Dict[str, str] = {  # section -> why
    "sparse_attention": "DeepSpeed's sparse attention kernels are not available: drop the "
                        "section (the model keeps dense attention)",
    "pipeline": "pipeline settings are gigatron.pipe.PipelineModule arguments (num_stages, "
                "partition_method, activation_checkpoint_interval, virtual_stages, schedule="
                "'1f1b'|'zb-h1'|'zbv'): drop the section and pass a PipelineModule to "
                "gigatron.initialize",
    "compression_training": "DeepSpeed's compression library is not implemented",
    "weight_quantization": "weight quantization is not implemented",
    "tensor_parallel": "automatic tensor parallelism is not implemented",
    "expert_parallel": "expert parallelism is not implemented",
}
# the sections readers check themselves (per optimizer or scheduler type; offload.py)
SELF_CHECKED = ("optimizer.params", "scheduler.params", "zero_optimization.offload_optimizer")


def _table_keys() -> Set[str]:
    """The config table's DeepSpeed keys without list indices; optimizer params are checked
    per type by the optimizer reader."""
    keys = {str(r.spec.ds).split("[")[0] for r in table() if r.spec.ds}
    return {k for k in keys if not k.startswith("optimizer.")
            and k != "zero_optimization.offload_optimizer"}


def known_keys() -> Set[str]:
    """Every dotted key the engine accepts (a section's children make it a section)."""
    return (_table_keys() | set(ENGINE_KEYS) | set(SPEED_ONLY) | set(DEFAULT_ONLY)
            | set(OFF_ONLY) | set(REFUSED))


def normalize_legacy(ds: Mapping) -> Tuple[Dict[str, Any], List[str]]:
    """A copy with DeepSpeed's legacy spellings in today's (bfloat16 -> bf16, a boolean
    zero_optimization -> its stage, cpu_offload / cpu_offload_param -> offload_*); problems."""
    out: Dict[str, Any] = copy.deepcopy(dict(ds))
    problems: List[str] = []
    if "bfloat16" in out:
        if "bf16" in out and out["bf16"] != out["bfloat16"]:
            problems.append('bf16 and bfloat16 (its legacy spelling) are both given: keep "bf16"')
        out.setdefault("bf16", out["bfloat16"])
        del out["bfloat16"]
    zero = out.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's first format: true = stage 1
        out["zero_optimization"] = {"stage": int(zero)}
    elif isinstance(zero, dict):
        for legacy, new in (("cpu_offload", "offload_optimizer"),
                            ("cpu_offload_param", "offload_param")):
            if legacy not in zero:
                continue
            on = zero.pop(legacy)
            if not isinstance(on, bool):
                problems.append(f"zero_optimization.{legacy} must be true or false, got {on!r}")
            elif on and new in zero:
                problems.append(f"zero_optimization.{legacy} (legacy) and {new} are both given: "
                                f'keep {new} {{"device": "cpu"}}')
            elif on:
                zero[new] = {"device": "cpu"}
    return out, problems


def _enabled(value: Any) -> bool:
    return isinstance(value, dict) and value.get("enabled") is True


def _unknown(path: str, prefix: str, siblings: Set[str]) -> str:
    key = path[len(prefix):]
    if not prefix:
        return (f"{key} is not a DeepSpeed config key: fix or drop it (DeepSpeed would ignore "
                f"it silently){did_you_mean(key, siblings)}")
    close = did_you_mean(key, siblings)
    listed = f"; known keys: {', '.join(sorted(siblings))}" if len(siblings) <= 12 or not close \
        else ""
    return f"{path} is not a key of {prefix[:-1]}{listed}{close}"


def _classify(path: str, value: Any, info: List[str], problems: List[str]) -> bool:
    """Handle a key with a fixed disposition; False when it is an ordinary key."""
    if path in REFUSED:
        problems.append(f"{path} is not supported: {REFUSED[path]}")
    elif path in OFF_ONLY:
        if _enabled(value):
            problems.append(f"{path}.enabled true is not supported: {OFF_ONLY[path]}")
    elif path in SPEED_ONLY:
        if not (isinstance(value, dict) and value.get("enabled") is False):
            info.append(f"{path}: accepted, no effect here ({SPEED_ONLY[path]})")
    elif path in DEFAULT_ONLY:
        default, why = DEFAULT_ONLY[path]
        if value != default:
            shown = "null" if default is None else str(default).lower() if isinstance(
                default, bool) else repr(default)
            problems.append(f"{path} {value!r} is not supported ({why}): drop it or set it to "
                            f"{shown}")
    elif path not in SELF_CHECKED:
        return False
    return True


def check_keys(ds: Mapping, info: List[str], problems: List[str]) -> None:
    """Every key of `ds` (legacy spellings already normalized): an info line for a speed-only
    key, a problem for a refused, non-default or unknown key, one line each."""
    walk_keys(ds, known_keys(), lambda path, value: _classify(path, value, info, problems),
              _unknown, problems)


def walk_keys(section: Mapping, known: Set[str], classify: Callable[[str, Any], bool],
              unknown: Callable[[str, str, Set[str]], str], problems: List[str],
              prefix: str = "") -> None:
    """The one walk over a DeepSpeed config's keys, for both readers (this module's and
    pretrain_gpt.py's): `classify(path, value)` handles a key with a fixed disposition (True:
    done); a key `known` (dotted keys) lacks is `unknown(path, prefix, its section's keys)`'s
    problem line; a known section must be a JSON object, and is walked in turn."""
    depth = prefix.count(".")
    siblings = {k.split(".")[depth] for k in known if k.startswith(prefix)}
    for key, value in section.items():
        path = prefix + key
        if classify(path, value):
            continue
        if key not in siblings:
            problems.append(unknown(path, prefix, siblings))
        elif any(k.startswith(path + ".") for k in known):
            if isinstance(value, dict):
                walk_keys(value, known, classify, unknown, problems, path + ".")
            else:
                example = '{"enabled": true}' if path + ".enabled" in known else \
                    '{"type": ..., "params": {...}}' if path + ".type" in known else "{...}"
                problems.append(f"{path} must be a JSON object like {example}, got {value!r}")
