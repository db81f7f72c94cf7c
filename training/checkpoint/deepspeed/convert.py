"""`gigatron convert deepspeed-to-gigatron`: a DeepSpeed checkpoint's weights out of its ZeRO
shards, as a gigatron checkpoint of a Megatron-DeepSpeed GPT (megatron_gpt.py names) or, for
any model, as one safetensors file under the module's names (DeepSpeed's zero_to_fp32)."""
from __future__ import annotations

import argparse
import os
from typing import Optional

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import ConversionError, require
from gigatron.training.checkpoint.deepspeed import reader
from gigatron.training.checkpoint.deepspeed.reader import DeepSpeedCheckpoint

SAFETENSORS_FILE = "model.safetensors"


def deepspeed_to_gigatron(load: str, save: str, vocab_size: Optional[int] = None,
                          tag: Optional[str] = None) -> TransformerConfig:
    """Convert the weights of a Megatron-DeepSpeed pretrain_gpt.py checkpoint (ZeRO 0-3 at
    any dp size, tp = pp = 1; `tag` None: the one `latest` names) into a gigatron
    checkpoint: the fp32 masters where saved, cast to the run's dtype."""
    from gigatron.models.megatron.args import config_from_megatron_args, vocab_sizes
    from gigatron.models.megatron.legacy import megatron_state_dict
    from gigatron.training.checkpoint.convert import save_model
    from gigatron.training.checkpoint.deepspeed.megatron_gpt import (core_state_dict,
                                                                      megatron_args)

    checkpoint = read_checkpoint(load, tag)
    args = checkpoint.model_states.get("args")
    require(isinstance(args, argparse.Namespace), f"{checkpoint.folder} records no Megatron "
            f"args (a Megatron-DeepSpeed run saves them): it is not a pretrain_gpt.py "
            f"checkpoint; use --to safetensors for the module's weights")
    assert isinstance(args, argparse.Namespace)
    args = megatron_args(args)
    config = config_from_megatron_args(args, vocab_size)
    core = core_state_dict(checkpoint.weights)
    state = megatron_state_dict({(0, 0): [core]}, 1, 1, config, vocab_sizes(args, vocab_size)[1])
    dtype = next((t.dtype for t in checkpoint.module.values() if t.is_floating_point()),
                 torch.float32)
    config.params_dtype = dtype
    save_model(save, config, {k: v.to(dtype) for k, v in state.items()},
               f"deepspeed:{checkpoint.folder}")
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


def read_checkpoint(load: str, tag: Optional[str]) -> DeepSpeedCheckpoint:
    """The weights of `load`: the folder save_checkpoint wrote (its `latest` or `tag`) or
    one tag folder in it."""
    folder = load if reader.is_deepspeed_folder(load) else reader.tag_folder(load, tag)
    require(folder is not None and reader.is_deepspeed_folder(folder),
            f"{load} is not a DeepSpeed checkpoint: it holds neither a {reader.LATEST} file "
            f"nor {reader.MODEL_STATES[0]} (give the folder save_checkpoint wrote, or a tag "
            f"folder in it)")
    assert folder is not None
    try:
        return reader.read(folder, with_optimizer=False)
    except ValueError as err:
        raise ConversionError(str(err).splitlines()[0]) from None
