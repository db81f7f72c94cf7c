"""`gigatron convert deepspeed-to-gigatron`: a DeepSpeed checkpoint out of its ZeRO shards, as
a gigatron checkpoint of a Megatron-DeepSpeed GPT (megatron_gpt.py names) that pretrain_gpt.py
resumes, or, for any model, as one safetensors file of its fp32 weights under the module's
names (DeepSpeed's zero_to_fp32)."""
from __future__ import annotations

import argparse
import os
from typing import Dict, Optional

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import ConversionError, require
from gigatron.training.checkpoint.deepspeed import reader
from gigatron.training.checkpoint.deepspeed.reader import DeepSpeedCheckpoint

SAFETENSORS_FILE = "model.safetensors"


def deepspeed_to_gigatron(load: str, save: str, vocab_size: Optional[int] = None,
                          tag: Optional[str] = None, with_optimizer: bool = True
                          ) -> TransformerConfig:
    """Convert a Megatron-DeepSpeed pretrain_gpt.py checkpoint (ZeRO 0-3 at any dp size,
    tp = pp = 1; `tag` None: the one `latest` names) into a gigatron checkpoint that
    `pretrain_gpt.py --load` resumes: the weights in the run's dtype, and unless
    `with_optimizer` is False the fp32 masters, Adam's moments, step count, lr schedule and
    progress (training/checkpoint/from_megatron.py writes it, as for Megatron-LM's)."""
    from gigatron.models.megatron.args import config_from_megatron_args, vocab_sizes
    from gigatron.models.megatron.legacy import megatron_state_dict
    from gigatron.models.megatron.torch_dist import MegatronOptimizerState, TorchDistCheckpoint
    from gigatron.training.checkpoint.deepspeed.megatron_gpt import (core_state_dict,
                                                                      megatron_args)
    from gigatron.training.checkpoint.from_megatron import save_converted

    checkpoint = read_checkpoint(load, tag, with_optimizer)
    saved = checkpoint.model_states.get("args")
    require(isinstance(saved, argparse.Namespace), f"{checkpoint.folder} records no Megatron "
            f"args (a Megatron-DeepSpeed run saves them): it is not a pretrain_gpt.py "
            f"checkpoint; use --to safetensors for the module's weights")
    assert isinstance(saved, argparse.Namespace)
    args = megatron_args(saved)
    config = config_from_megatron_args(args, vocab_size)
    padded = vocab_sizes(args, vocab_size)[1]

    def to_gigatron(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return megatron_state_dict({(0, 0): [core_state_dict(tensors)]}, 1, 1, config, padded)

    masters = to_gigatron(checkpoint.weights)
    config.params_dtype = next((t.dtype for t in checkpoint.module.values()
                                if t.is_floating_point()), torch.float32)
    optimizer = None
    if with_optimizer:
        optimizer = MegatronOptimizerState(
            {k: to_gigatron(v) for k, v in checkpoint.states.items()}, masters,
            int(checkpoint.scalars.get("step", 0)), "deepspeed")
    states = checkpoint.model_states
    iteration = int(states.get("iteration", states.get("global_steps", 0)) or 0)
    converted = TorchDistCheckpoint(
        checkpoint.folder, args, iteration, config,
        {k: v.to(config.params_dtype) for k, v in masters.items()}, optimizer,
        dict(states.get("lr_scheduler") or {}))
    save_converted(converted, save, f"deepspeed:{checkpoint.folder}")
    return config


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
    folder = load if reader.is_deepspeed_folder(load) else reader.tag_folder(load, tag)
    require(folder is not None and reader.is_deepspeed_folder(folder),
            f"{load} is not a DeepSpeed checkpoint: it holds neither a {reader.LATEST} file "
            f"nor {reader.MODEL_STATES[0]} (give the folder save_checkpoint wrote, or a tag "
            f"folder in it)")
    assert folder is not None
    try:
        return reader.read(folder, with_optimizer=with_optimizer)
    except ValueError as err:
        raise ConversionError(str(err).splitlines()[0]) from None
