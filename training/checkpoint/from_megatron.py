"""A Megatron-Core torch_dist checkpoint written as a gigatron torch_dist checkpoint that a run
resumes from: the weights, and (unless --no-load-optim) the optimizer's moments, fp32 main
parameters, step count, the lr schedule's position and the loop's progress.

The result is gigatron's own layout-free format (training/checkpoint/torch_dist/), so
`pretrain_gpt.py --load` at any tp / pp / dp / ZeRO stage continues from it as from one of its
own checkpoints:

    model.<name>              the weights (gigatron's vocabulary: Megatron's padding rows cut
                              when --vocab-size names the tokenizer's size)
    optimizer.<state>.<name>  exp_avg / exp_avg_sq (Adam's moments)
    optimizer.master.<name>   the fp32 main parameters of a bf16 / fp16 model (an fp32
                              model's are its weights)
    common                    progress (iteration, consumed samples, the lr schedule's
                              position in samples), Megatron's opt_param_scheduler as
                              gigatron's lr schedule, the optimizer's step count

`pretrain_gpt.py --load MEGATRON_ROOT` does the same on the fly (`resolve_load`): rank 0
writes the copy into MEGATRON_ROOT/gigatron/ and every rank loads it.

Megatron's RNG states are not carried (gigatron draws from other streams): the run seeds
from --seed and says so. The loss scaler of an fp16 run starts afresh.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

from gigatron.training.checkpoint import convert
from gigatron.training.checkpoint.torch_dist import save_load
from gigatron.training.checkpoint.torch_dist.state import COMMON, MASTER, MODEL, optimizer_key

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig
    from gigatron.models.megatron.torch_dist import TorchDistCheckpoint

# Megatron's opt_param_scheduler.state_dict() -> gigatron's LRScheduleConfig
_SCHEDULE = {"max_lr": "max_lr", "min_lr": "min_lr", "lr_decay_style": "decay_style",
             "lr_warmup_steps": "warmup_steps", "lr_decay_steps": "decay_steps",
             "wsd_decay_steps": "wsd_decay_steps", "lr_wsd_decay_style": "wsd_decay_style"}


def lr_schedule(scheduler: Dict[str, Any], args: Any) -> Optional[Dict[str, Any]]:
    """gigatron's lr schedule (LRScheduleConfig's fields) of Megatron's saved scheduler; None
    when the checkpoint holds none."""
    if not scheduler:
        return None
    out = {ours: scheduler[theirs] for theirs, ours in _SCHEDULE.items() if theirs in scheduler}
    out["init_lr"] = float(getattr(args, "lr_warmup_init", 0.0) or 0.0)
    return out


def progress(ckpt: "TorchDistCheckpoint") -> Dict[str, int]:
    """The loop's position (orchestrator.TrainProgress's fields) as Megatron left it."""
    args = ckpt.args
    return {"iteration": ckpt.iteration,
            "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
            "consumed_valid_samples": int(getattr(args, "consumed_valid_samples", 0) or 0),
            "lr_steps": int(ckpt.scheduler.get("num_steps", 0) or 0),
            "skipped_iterations": 0}


def _cut(name: str, tensor: torch.Tensor, config: "TransformerConfig") -> torch.Tensor:
    """A tensor as gigatron's checkpoints hold it (the vocabulary without padding rows)."""
    rows = tensor[:config.vocab_size] if name in convert.VOCAB_NAMES else tensor
    return rows.detach().contiguous()


def checkpoint_state(ckpt: "TorchDistCheckpoint") -> Dict[str, Any]:
    """The DCP state dict of the converted checkpoint (see the module doc)."""
    config = ckpt.config
    state: Dict[str, Any] = {MODEL + k: _cut(k, v, config) for k, v in ckpt.model.items()}
    common: Dict[str, Any] = {"progress": progress(ckpt)}
    schedule = lr_schedule(ckpt.scheduler, ckpt.args)
    if schedule is not None:
        common["lr_schedule"] = schedule
    optimizer = ckpt.optimizer
    if optimizer is not None:
        for kind, tensors in optimizer.per_element.items():
            state.update({optimizer_key(kind) + k: _cut(k, v.float(), config)
                          for k, v in tensors.items()})
        if config.params_dtype != torch.float32:
            state.update({MASTER + k: _cut(k, v, config)
                          for k, v in optimizer.masters.items()})
        common["optimizer"] = {
            "per_element": sorted(optimizer.per_element),
            "scalars": {"step": torch.tensor(float(optimizer.step))},
            "scaler": {}, "scaler_type": "megatron", "skipped_steps": 0}
    state[COMMON] = common
    return state


def save_converted(ckpt: "TorchDistCheckpoint", save: str, source: str) -> str:
    """Write `ckpt` as iteration ckpt.iteration of `save` in gigatron's torch_dist format
    (one process); returns the folder."""
    argv = convert.model_flags(ckpt.config)
    meta = {"iteration": ckpt.iteration, "tp": 1, "pp": 1, "dp": 1, "virtual_chunks": 1,
            "world_size": 1, "zero_stage": None, "has_optimizer": ckpt.optimizer is not None,
            "flags": convert.parse_model_flags(argv), "model_flags": argv,
            "model_config": convert.config_to_json(ckpt.config), "converted_from": source,
            "consumed_train_samples": progress(ckpt)["consumed_train_samples"],
            "params_dtype": str(ckpt.config.params_dtype).replace("torch.", "")}
    return save_load.save(save, ckpt.iteration, checkpoint_state(ckpt),
                          {"tp": 0, "pp": 0, "dp": 0}, meta, single_process=True)


CONVERTED_DIR = "gigatron"  # LOAD/gigatron/: the copy a run's --load of Megatron's root reads


def resolve_load(load: str, vocab_size: Optional[int], with_optimizer: bool,
                 rank: int) -> str:
    """Collective: the checkpoint root a run with --load `load` reads. A Megatron-Core
    torch_dist checkpoint (Megatron-LM's --ckpt-format torch_dist) is converted by rank 0
    into LOAD/gigatron/ (the optimizer state only when the run loads it), which every rank
    then loads; any other folder is returned as it is. A failure is one line on every rank."""
    from gigatron.models.hf_common import ConversionError
    from gigatron.models.megatron.torch_dist import find_torch_dist, read_torch_dist

    if find_torch_dist(load) is None:
        return load
    target = os.path.join(load, CONVERTED_DIR)
    error = None
    if rank == 0:
        try:
            save_converted(read_torch_dist(load, vocab_size, with_optimizer), target,
                           f"megatron:{load}")
        except (ConversionError, OSError, ValueError) as err:
            error = (f"--load {load} is a Megatron torch_dist checkpoint that could not be "
                     f"converted into {target}: {str(err).splitlines()[0]} (convert it "
                     f"elsewhere with `gigatron convert megatron-to-gigatron` and --load that)")
    error = save_load.all_objects(error, None)[0]
    if error is not None:
        raise ValueError(error)
    return target
