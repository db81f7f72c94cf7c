"""--use-checkpoint-args: the model's shape flags from the --load checkpoint's saved args, as
Megatron-LM's load_args_from_checkpoint takes them, for gigatron's checkpoints and for
Megatron-LM's torch and torch_dist ones.

Megatron's rule: a few sizes (layers, hidden, ffn, heads, kv channels, sequence length,
position embeddings) keep a value given on the command line; every other shape setting
(query groups, positions, RoPE, norm, activation, biases, untied output, ...) is taken from
the checkpoint even when given. The vocabulary is taken when neither --vocab-size nor a
tokenizer other than NullTokenizer is given. Without a checkpoint in --load the flags stay
as given (Megatron: "using provided arguments"); --exit-on-missing-checkpoint then stops
the run when it loads.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict, Optional, Set

# kept when the command line gives them (Megatron's _set_arg without force)
UNLESS_GIVEN = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "kv_channels", "seq_length", "max_position_embeddings")
# taken from the checkpoint even when given (Megatron's force=True)
FORCED = ("group_query_attention", "num_query_groups", "position_embedding_type",
          "rotary_base", "rotary_percent", "use_rope_scaling", "rope_scaling_factor",
          "normalization", "norm_epsilon", "apply_layernorm_1p", "qk_layernorm", "swiglu",
          "squared_relu", "no_bias_gelu_fusion", "disable_bias_linear",
          "untie_embeddings_and_output_weights", "add_qkv_bias",
          # gpt-oss's attention and MLP kinds (not in Megatron's list, which predates them)
          "window_size", "window_attn_skip_freq", "softmax_type", "quick_geglu",
          "glu_linear_offset", "activation_func_clamp_value", "enable_gpt_oss")
VOCABULARY = ("vocab_size", "make_vocab_size_divisible_by")


def saved_model_flags(load: str) -> Optional[Dict[str, Any]]:
    """The model flags (dest -> value) of the checkpoint in `load`: gigatron's recorded
    flags, or the flags that build the model of a Megatron-LM checkpoint's saved args; None
    when `load` holds no checkpoint."""
    from gigatron.models.megatron.files import TRACKER, iteration_folder, load_rank_file
    from gigatron.models.megatron.torch_dist import find_torch_dist, read_common
    from gigatron.training.checkpoint import folders as files

    if not os.path.isfile(os.path.join(load, TRACKER)):
        return None
    megatron = find_torch_dist(load)
    if megatron is not None:
        return _flags_of_megatron_args(read_common(megatron)["args"])
    _, folder = files.find_checkpoint(load)
    assert folder is not None  # the tracker exists
    if os.path.isfile(os.path.join(folder, files.METADATA)):
        flags = files.read_metadata(folder).get("flags")
        if not isinstance(flags, dict):
            raise ValueError(f"--use-checkpoint-args: {folder}/{files.METADATA} records no "
                             f"flags: give the model's flags instead")
        return flags
    ranks = sorted(n for n in os.listdir(iteration_folder(load)) if n.startswith("mp_rank_"))
    first = load_rank_file(os.path.join(iteration_folder(load), ranks[0], "model_optim_rng.pt"))
    return _flags_of_megatron_args(first["args"])


def _flags_of_megatron_args(args: argparse.Namespace) -> Dict[str, Any]:
    from gigatron.models.megatron.args import config_from_megatron_args
    from gigatron.training.checkpoint.convert import model_flags, parse_model_flags

    return parse_model_flags(model_flags(config_from_megatron_args(args)))


def apply_checkpoint_args(flags: argparse.Namespace, given: Set[str]) -> Set[str]:
    """Set the model's shape flags in `flags` from the --load checkpoint (Megatron's rule,
    see the module doc); returns the dests it changed."""
    saved = saved_model_flags(flags.load)
    if saved is None:
        return set()
    tokenizer = getattr(flags, "tokenizer_type", None)
    take = [d for d in UNLESS_GIVEN if d not in given] + list(FORCED)
    if "vocab_size" not in given and tokenizer in (None, "NullTokenizer"):
        take += list(VOCABULARY)
    changed = set()
    for dest in take:
        if dest in saved and hasattr(flags, dest) and getattr(flags, dest) != saved[dest]:
            setattr(flags, dest, saved[dest])
            changed.add(dest)
    return changed
