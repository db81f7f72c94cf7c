"""A checkpoint whose parameter shapes differ from this run's model: one error naming the
parameters, both shapes, the flags that decide them and those whose values differ between
the checkpoint's saved flags and this run's.
"""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

_VOCAB = ("vocab_size", "tokenizer_type", "tokenizer_model", "vocab_file",
          "make_vocab_size_divisible_by", "hidden_size")
# (pattern of the parameter name, flags that decide its shape); first match wins
_SHAPE_FLAGS: Sequence[Tuple[str, Tuple[str, ...]]] = (
    (r"word_embeddings\.weight$", _VOCAB),
    (r"output_layer\.weight$", _VOCAB),
    (r"position_embeddings\.weight$", ("max_position_embeddings", "seq_length", "hidden_size")),
    (r"linear_qkv\.", ("hidden_size", "num_attention_heads", "num_query_groups",
                       "group_query_attention", "kv_channels")),
    (r"linear_proj\.", ("hidden_size", "num_attention_heads", "kv_channels")),
    (r"linear_fc1\.", ("ffn_hidden_size", "swiglu", "hidden_size")),
    (r"linear_fc2\.", ("hidden_size", "ffn_hidden_size")),
    (r"[qk]_layernorm\.", ("kv_channels", "num_attention_heads", "hidden_size")),
    (r"(layernorm|norm)\.", ("hidden_size",)),
)
# flags that decide whether a parameter exists at all
_PRESENCE_FLAGS: Sequence[Tuple[str, Tuple[str, ...]]] = (
    (r"[qk]_layernorm\.weight$", ("qk_layernorm",)),
    (r"softmax_offset$", ("softmax_type",)),
    (r"^decoder\.layers\.\d+\.", ("num_layers", "decoder_first_pipeline_num_layers",
                                  "decoder_last_pipeline_num_layers",
                                  "num_layers_per_virtual_pipeline_stage",
                                  "num_virtual_stages_per_pipeline_rank")),
    (r"layernorm\.bias$", ("normalization",)),
    (r"\.bias$", ("disable_bias_linear",)),
    (r"^output_layer\.", ("untie_embeddings_and_output_weights",)),
    (r"position_embeddings\.", ("position_embedding_type",)),
)
_SHOWN = 4  # parameters listed in the message; the rest are counted


def _flags_for(name: str, table: Sequence[Tuple[str, Tuple[str, ...]]]) -> Tuple[str, ...]:
    for pattern, flags in table:
        if re.search(pattern, name):
            return flags
    return ()


def _flag(dest: str) -> str:
    from gigatron.training.config.table import flag_name
    try:
        return flag_name(dest)
    except (KeyError, ValueError):
        return "--" + dest.replace("_", "-")


Shape = Tuple[int, ...]


def _mismatches(saved: Mapping[str, Shape], current: Mapping[str, Shape]
                ) -> List[Tuple[str, str, Tuple[str, ...]]]:
    """(parameter, what differs, deciding flags) for every difference, in name order."""
    out = []
    for name in sorted(set(saved) | set(current)):
        if name not in saved:
            out.append((name, "is missing from the checkpoint", _flags_for(name, _PRESENCE_FLAGS)))
        elif name not in current:
            out.append((name, "is in the checkpoint but not in this run's model",
                        _flags_for(name, _PRESENCE_FLAGS)))
        elif tuple(saved[name]) != tuple(current[name]):
            out.append((name, f"has shape {tuple(saved[name])} in the checkpoint but "
                              f"{tuple(current[name])} in this run",
                        _flags_for(name, _SHAPE_FLAGS)))
    return out


def _comparable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))  # as metadata.json stores it


def _shown(value: Any) -> str:
    return "unset (its default)" if value is None else str(value)


def _flag_differences(dests: List[str], saved_flags: Optional[Dict[str, Any]],
                      run_flags: Dict[str, Any]) -> str:
    if not saved_flags:
        return "the checkpoint records no flags to compare with"
    differ = [f"{_flag(d)} is {_shown(_comparable(saved_flags.get(d)))} in the checkpoint, "
              f"{_shown(_comparable(run_flags.get(d)))} in this run" for d in dests
              if _comparable(saved_flags.get(d)) != _comparable(run_flags.get(d))]
    if saved_flags.get("model") != run_flags.get("model"):  # a zoo model sets the rest
        differ.append(f"--model is {_shown(saved_flags.get('model'))} in the checkpoint, "
                      f"{_shown(run_flags.get('model'))} in this run")
    if not differ:
        return ("those flags have the same values in the checkpoint and this run (a different "
                "tokenizer file or model definition?)")
    return "; ".join(differ)


def check_model_shapes(saved: Sequence[Mapping[str, torch.Tensor]],
                       chunks: Sequence[torch.nn.Module],
                       saved_flags: Optional[Dict[str, Any]], run_flags: Dict[str, Any],
                       folder: str) -> None:
    """Raise one ValueError if a per-rank checkpoint's parameters do not fit this rank's
    chunks."""
    problems = []
    for weights, chunk in zip(saved, chunks):
        problems += _mismatches({k: tuple(v.shape) for k, v in weights.items()},
                                {k: tuple(v.shape) for k, v in chunk.state_dict().items()})
    _raise(problems, saved_flags, run_flags, folder)


def check_global_shapes(saved: Mapping[str, Shape], current: Mapping[str, Shape],
                        saved_flags: Optional[Dict[str, Any]], run_flags: Dict[str, Any],
                        folder: str) -> None:
    """Raise one ValueError if a layout-free checkpoint's global tensors (name -> shape)
    are not those of this run's single-device model."""
    _raise(_mismatches(saved, current), saved_flags, run_flags, folder)


def _raise(problems: List[Tuple[str, str, Tuple[str, ...]]],
           saved_flags: Optional[Dict[str, Any]], run_flags: Dict[str, Any],
           folder: str) -> None:
    if not problems:
        return
    shown = [f"{name} {what}" for name, what, _ in problems[:_SHOWN]]
    more = len(problems) - len(shown)
    dests = list(dict.fromkeys(d for _, _, flags in problems for d in flags))
    raise ValueError(
        f"checkpoint {folder} does not fit this run's model: " + "; ".join(shown)
        + (f"; and {more} more parameter{'s' if more > 1 else ''}" if more else "")
        + f". {'These are' if len(problems) > 1 else 'This is'} decided by "
        + (", ".join(_flag(d) for d in dests) or "the model definition") + ": "
        + _flag_differences(dests, saved_flags, run_flags)
        + ". Relaunch with the checkpoint's values, or drop --load to start from scratch")
