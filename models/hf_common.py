"""Helpers shared by the Hugging Face converters (models/hf_gpt2.py, models/hf_llama.py)."""
from __future__ import annotations

from typing import Any, Dict, Iterable

import torch

from gigatron.models.config import TransformerConfig

StateDict = Dict[str, torch.Tensor]


class ConversionError(ValueError):
    """A config field or tensor the converter cannot map; the message names it."""


def require(ok: Any, message: str) -> None:
    """Raise ConversionError(message) unless ok."""
    if not ok:
        raise ConversionError(message)


def reject_true(hf: Dict[str, Any], names: Iterable[str], family: str) -> None:
    """Refuse config flags gigatron's model has no equivalent for."""
    for name in names:
        require(not hf.get(name, False), f"{family} config field {name}=true is not supported")


def layer_prefix(i: int) -> str:
    """Prefix of layer i's parameters in a full (pp=1) GPTModel."""
    return f"decoder.layers.{i}."


def pad_vocab(weight: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Append zero rows up to the padded vocabulary (their logits are never real tokens)."""
    padded = config.padded_vocab_size(1)
    require(weight.shape[0] == config.vocab_size,
            f"vocabulary tensor has {weight.shape[0]} rows, config vocab_size is "
            f"{config.vocab_size}")
    extra = weight.new_zeros(padded - weight.shape[0], weight.shape[1])
    return torch.cat([weight, extra])


def unpad_vocab(weight: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """The real vocabulary's rows of a padded embedding / output weight."""
    return weight[:config.vocab_size]
