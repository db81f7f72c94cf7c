"""`gigatron convert deepspeed-to-gigatron`: a DeepSpeed checkpoint out of its ZeRO shards, as
a gigatron checkpoint of a Megatron-DeepSpeed GPT (megatron_gpt.py names) that pretrain_gpt.py
resumes, or, for any model, as one safetensors file of its fp32 weights under the module's
names (DeepSpeed's zero_to_fp32)."""
from __future__ import annotations

import argparse
import os
from typing import Callable, Dict, List, Optional, TypeVar

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import ConversionError, require
from gigatron.training.checkpoint.deepspeed import reader
from gigatron.training.checkpoint.deepspeed.reader import DeepSpeedCheckpoint

SAFETENSORS_FILE = "model.safetensors"
T = TypeVar("T")


def deepspeed_to_gigatron(load: str, save: str, vocab_size: Optional[int] = None,
                          tag: Optional[str] = None, with_optimizer: bool = True
                          ) -> TransformerConfig:
    """Convert a Megatron-DeepSpeed pretrain_gpt.py checkpoint (ZeRO 0-3 at any dp size, any
    tp, and pp through DeepSpeed's pipeline engine; `tag` None: the one `latest` names) into
    a gigatron checkpoint that `pretrain_gpt.py --load` resumes: the weights in the run's
    dtype, and unless `with_optimizer` is False the fp32 masters, Adam's moments, step count,
    lr schedule and progress (training/checkpoint/from_megatron.py writes it, as for
    Megatron-LM's). The tp shards merge by Megatron-LM's rules (models/megatron/legacy.py)."""
    from gigatron.models.megatron.args import config_from_megatron_args, vocab_sizes
    from gigatron.models.megatron.torch_dist import MegatronOptimizerState, TorchDistCheckpoint
    from gigatron.training.checkpoint.deepspeed.megatron_gpt import megatron_args
    from gigatron.training.checkpoint.from_megatron import save_converted

    folder = tag_folder_of(load, tag)
    saved = _guarded(lambda: reader.read_model_states(folder)).get("args")
    require(isinstance(saved, argparse.Namespace), f"{folder} records no Megatron "
            f"args (a Megatron-DeepSpeed run saves them): it is not a pretrain_gpt.py "
            f"checkpoint; use --to safetensors for the module's weights")
    assert isinstance(saved, argparse.Namespace)
    args = megatron_args(saved)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    ranks = _guarded(lambda: reader.read_tensor_parallel(folder, with_optimizer, tp, pp))
    config = config_from_megatron_args(args, vocab_size)
    padded = vocab_sizes(args, vocab_size)[1]

    def to_gigatron(per_tp_rank: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        return _merged(per_tp_rank, config, padded)

    masters = to_gigatron([rank.weights for rank in ranks])
    checkpoint = ranks[0]
    config.params_dtype = next((t.dtype for t in checkpoint.module.values()
                                if t.is_floating_point()), torch.float32)
    optimizer = None
    if with_optimizer:
        optimizer = MegatronOptimizerState(
            {k: to_gigatron([rank.states[k] for rank in ranks]) for k in checkpoint.states},
            masters, int(checkpoint.scalars.get("step", 0)), "deepspeed")
    states = checkpoint.model_states
    iteration = int(states.get("iteration", states.get("global_steps", 0)) or 0)
    converted = TorchDistCheckpoint(
        checkpoint.folder, args, iteration, config,
        {k: v.to(config.params_dtype) for k, v in masters.items()}, optimizer,
        dict(states.get("lr_scheduler") or {}))
    save_converted(converted, save, f"deepspeed:{checkpoint.folder}")
    return config


def _merged(per_tp_rank: List[Dict[str, torch.Tensor]], config: TransformerConfig,
            padded: int) -> Dict[str, torch.Tensor]:
    """gigatron's single-device tensors of one state (weights, exp_avg, ...) held per tp
    rank under Megatron-DeepSpeed's names (every stage's layers numbered globally)."""
    from gigatron.models.megatron.legacy import megatron_state_dict
    from gigatron.training.checkpoint.deepspeed.megatron_gpt import core_state_dict

    models = {(t, 0): [core_state_dict(tensors)] for t, tensors in enumerate(per_tp_rank)}
    return megatron_state_dict(models, len(per_tp_rank), 1, config, padded)


def deepspeed_to_safetensors(load: str, out_dir: str, tag: Optional[str] = None) -> str:
    """The whole fp32 weights and buffers of any DeepSpeed checkpoint under the module's
    names, as OUT_DIR/model.safetensors (DeepSpeed's zero_to_fp32); returns its path."""
    from safetensors.torch import save_file

    checkpoint = read_checkpoint(load, tag)
    tensors = {**checkpoint.buffers, **checkpoint.weights}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, SAFETENSORS_FILE)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    return path


def read_checkpoint(load: str, tag: Optional[str], with_optimizer: bool = False
                    ) -> DeepSpeedCheckpoint:
    """The weights (and optimizer states) of `load`: the folder save_checkpoint wrote (its
    `latest` or `tag`) or one tag folder in it."""
    folder = tag_folder_of(load, tag)
    return _guarded(lambda: reader.read(folder, with_optimizer=with_optimizer))


def tag_folder_of(load: str, tag: Optional[str]) -> str:
    """The tag folder `load` names: itself, or its `latest`'s (or `tag`) inside it."""
    folder = load if reader.is_deepspeed_folder(load) else reader.tag_folder(load, tag)
    require(folder is not None and reader.is_deepspeed_folder(folder),
            f"{load} is not a DeepSpeed checkpoint: it holds neither a {reader.LATEST} file "
            f"nor {reader.MODEL_STATES[0]} (give the folder save_checkpoint wrote, or a tag "
            f"folder in it)")
    assert folder is not None
    return folder


def _guarded(read: Callable[[], T]) -> T:
    """A reader's ValueError as the converter's one-line ConversionError."""
    try:
        return read()
    except ValueError as err:
        raise ConversionError(str(err).splitlines()[0]) from None
