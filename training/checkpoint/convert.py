"""Converters into and out of gigatron checkpoints: Hugging Face folders both ways, Megatron-LM
checkpoints (torch and torch_dist) in.

A converted model is written as a gigatron checkpoint through
`dist_checkpoint.save_global_model` (layout-free: `pretrain_gpt.py --load` with any tp / pp /
dp reads it) and read back through `load_global_model`; those hold the vocabulary without
padding, the converters' state dicts are a single-device GPTModel's (padded rows of zeros),
so the rows are cut on the way in and padded on the way out. Its metadata records the model as
gigatron flags (`flags`, what --load compares a run's model against; `model_flags` shows the
command line that rebuilds it) and the exact TransformerConfig (`model_config`, for the
fields no flag sets, such as Llama 3.1's low/high frequency factors). An exported Hugging Face
folder gets the run's tokenizer (named by its saved flags) as tokenizer.json, and its bos/eos
ids in config.json, so that transformers' `pipeline("text-generation", folder)` runs.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import ConversionError, StateDict, pad_vocab, require

CONVERTED_ITERATION = 0  # a converted model starts training at iteration 0 (Megatron's release)
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# fields that change what the model computes (the rest: memory, speed, initialisation)
VOCAB_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")
SPECIAL_IDS_KEY = "special_token_ids"  # metadata: a converted model's bos/eos/pad ids
_RUNTIME_ONLY = ("attention_backend", "sequence_parallel", "recompute_granularity",
                 "recompute_method", "recompute_num_layers", "apply_scaled_init")


def _num(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _activation_flags(config: TransformerConfig) -> List[str]:
    """Megatron's activation flags: the bias-GeLU fusion (tanh) is the default with biases."""
    if config.activation in ("swiglu", "squared_relu", "quick_geglu"):
        return ["--" + config.activation.replace("_", "-")]
    if config.activation == "gelu" and config.add_bias_linear:
        return ["--no-bias-gelu-fusion"]
    return []


def model_flags(config: TransformerConfig) -> List[str]:
    """pretrain_gpt.py flags that build `config` (what a run loading the converted checkpoint
    passes); `unexpressed_fields` names what they cannot say."""
    argv = ["--num-layers", config.num_layers, "--hidden-size", config.hidden_size,
            "--num-attention-heads", config.num_attention_heads,
            "--ffn-hidden-size", config.ffn_hidden_size, "--kv-channels", config.kv_channels,
            "--seq-length", config.seq_length,
            "--max-position-embeddings", config.max_position_embeddings,
            "--vocab-size", config.vocab_size,
            "--make-vocab-size-divisible-by", config.make_vocab_size_divisible_by,
            "--position-embedding-type", config.position_embedding_type,
            "--normalization", config.normalization, "--norm-epsilon", config.layernorm_epsilon,
            "--hidden-dropout", config.hidden_dropout,
            "--attention-dropout", config.attention_dropout,
            "--init-method-std", config.init_method_std]
    if config.num_query_groups != config.num_attention_heads:
        argv += ["--group-query-attention", "--num-query-groups", config.num_query_groups]
    if config.position_embedding_type == "rope":
        argv += ["--rotary-base", config.rotary_base, "--rotary-percent", config.rotary_percent]
        if config.rotary_seq_len_interpolation_factor is not None:
            argv += ["--rotary-seq-len-interpolation-factor",
                     config.rotary_seq_len_interpolation_factor]
        if config.rope_scaling:
            argv += ["--use-rope-scaling", "--rope-scaling-factor", config.rope_scaling_factor,
                     "--rope-scaling-low-freq-factor", config.rope_scaling_low_freq_factor,
                     "--rope-scaling-high-freq-factor", config.rope_scaling_high_freq_factor,
                     "--rope-scaling-original-max-position-embeddings",
                     config.rope_scaling_original_max_position_embeddings]
    argv += _activation_flags(config)
    if not config.add_bias_linear:
        argv.append("--disable-bias-linear")
    if config.untie_embeddings_and_output_weights:
        argv.append("--untie-embeddings-and-output-weights")
    if getattr(config, "layernorm_zero_centered_gamma", False):
        argv.append("--apply-layernorm-1p")
    if config.qk_layernorm:
        argv.append("--qk-layernorm")
    if config.attention_softmax_in_fp32:  # the library's default; the flag's is off
        argv.append("--attention-softmax-in-fp32")
    if config.params_dtype != torch.float32:
        argv.append("--" + _DTYPE_NAMES[config.params_dtype])
    return [_num(a) for a in argv + _moe_flags(config) + _mla_flags(config)
            + _gpt_oss_flags(config)]


def _gpt_oss_flags(config: TransformerConfig) -> List[Any]:
    """The window, sink and gated-activation flags off their defaults, and --enable-gpt-oss
    for gpt-oss's YaRN (the only YaRN of attention without MLA that the flags build)."""
    from gigatron.training.config.megatron.gpt_oss import GPT_OSS_YARN

    argv: List[Any] = []
    if config.window_size is not None:
        argv += ["--window-size", f"{config.window_size[0]},{config.window_size[1]}"]
    freq = config.window_attn_skip_freq
    if freq is not None:
        argv += ["--window-attn-skip-freq",
                 "[" + ",".join(map(str, freq)) + "]" if isinstance(freq, list) else freq]
    if config.softmax_type != "vanilla":
        argv += ["--softmax-type", config.softmax_type]
    if config.glu_linear_offset:
        argv += ["--glu-linear-offset", config.glu_linear_offset]
    if config.activation_func_clamp_value is not None:
        argv += ["--activation-func-clamp-value", config.activation_func_clamp_value]
    if config.add_qkv_bias:
        argv.append("--add-qkv-bias")
    if not config.multi_latent_attention and all(
            getattr(config, name) == value for name, value in GPT_OSS_YARN.items()):
        argv.append("--enable-gpt-oss")
    return argv


def _mla_flags(config: TransformerConfig) -> List[Any]:
    """--multi-latent-attention and its size and YaRN flags (a model with MLA only)."""
    from gigatron.training.config.megatron.mla import MLA_FIELDS
    from gigatron.training.config.table import flag_name, row_of

    if not config.multi_latent_attention:
        return []
    argv: List[Any] = []
    for setting, name in MLA_FIELDS.items():
        value = getattr(config, name)
        if isinstance(value, bool):  # store_true flags, or the --no- form of a True default
            argv.append(flag_name(setting) if value else row_of(setting).spec.negative)
        elif value is not None:
            argv += [flag_name(setting), value]
    return argv


def _moe_flags(config: TransformerConfig) -> List[Any]:
    """--num-experts and the --moe-* flags of the MoE fields off Megatron's defaults."""
    from gigatron.training.config.megatron.moe import MOE_FIELDS
    from gigatron.training.config.table import flag_name

    if config.num_moe_experts is None:
        return []
    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    argv: List[Any] = []
    for setting, name in MOE_FIELDS.items():
        value = getattr(config, name)
        if value == defaults[name]:
            continue
        if isinstance(value, bool):
            argv.append(flag_name(setting))  # store_true flags; every default is False
        elif isinstance(value, list):  # a 0/1 per layer, as --moe-layer-freq parses it
            argv += [flag_name(setting), "[" + ",".join(map(str, value)) + "]"]
        else:
            argv += [flag_name(setting), value]
    return argv


def parse_model_flags(argv: List[str]) -> Dict[str, Any]:
    """Every flag's value (defaults filled in) as a run records them in its checkpoints."""
    from gigatron.training.config.arguments import parse_flags

    try:
        return dict(vars(parse_flags(argv)))
    except ValueError as err:
        raise ConversionError(f"the model's flags do not parse: "
                              f"{str(err).splitlines()[0]}") from None


def config_from_flags(flags: Dict[str, Any], vocab_size: Optional[int] = None
                      ) -> TransformerConfig:
    """The TransformerConfig pretrain_gpt.py builds from a run's recorded flags."""
    from gigatron.training.config.table import build_settings, defaults
    from gigatron.training.config.megatron.model import build_model_config
    from gigatron.training.config.validation import Problems

    settings = build_settings(argparse.Namespace(**{**defaults(), **flags}))
    # the single-device model, whatever layout the flags recorded
    settings = dataclasses.replace(settings, parallel=dataclasses.replace(settings.parallel,
                                                                          tp=1))
    problems = Problems()
    config = build_model_config(settings, vocab_size, problems)
    if config is None:
        raise ConversionError("the checkpoint's flags do not build a model: "
                              + "; ".join(problems.lines))
    return config


def unexpressed_fields(config: TransformerConfig, rebuilt: TransformerConfig) -> List[str]:
    """Fields the flags rebuild differently (name=value of `config`)."""
    return [f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
            if f.name not in _RUNTIME_ONLY and getattr(config, f.name) != getattr(rebuilt, f.name)]


def config_to_json(config: TransformerConfig) -> Dict[str, Any]:
    """The TransformerConfig's fields as JSON values (dtype by name)."""
    data = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    data["params_dtype"] = _DTYPE_NAMES[config.params_dtype]
    return data


def config_from_json(data: Dict[str, Any], where: str) -> TransformerConfig:
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(data) - known)
    require(not unknown, f"{where}: unknown TransformerConfig fields {', '.join(unknown)}")
    return TransformerConfig(**data)


def save_model(root: str, config: TransformerConfig, state: StateDict, source: str,
               special_ids: Optional[Dict[str, Optional[int]]] = None) -> str:
    """Write a single-device (global-name) state dict as a gigatron checkpoint in `root`
    (with the source's bos/eos ids, for an export back); returns the iteration folder."""
    from gigatron.training.checkpoint.torch_dist.save_load import save_global_model

    argv = model_flags(config)
    metadata = {"flags": parse_model_flags(argv), "model_flags": argv,
                "model_config": config_to_json(config), "converted_from": source,
                SPECIAL_IDS_KEY: special_ids or {}}
    tensors = {k: (v[:config.vocab_size] if k in VOCAB_NAMES else v).detach().contiguous()
               for k, v in state.items()}
    return save_global_model(tensors, root, CONVERTED_ITERATION, metadata)


def load_model(root: str) -> Tuple[TransformerConfig, StateDict]:
    """(config, single-device state dict) of any gigatron checkpoint: a converted one (its
    recorded config) or one a run saved at any layout (the config its flags build; the
    vocabulary is as many tokens as the saved table has rows)."""
    config, state, _ = _load_with_metadata(root)
    return config, state


def _load_with_metadata(root: str) -> Tuple[TransformerConfig, StateDict, Dict[str, Any]]:
    from gigatron.training.checkpoint.torch_dist.save_load import load_global_model

    try:
        state, metadata = load_global_model(root)
    except ValueError as err:  # a missing, damaged or torch-format checkpoint: named
        raise ConversionError(str(err).splitlines()[0]) from None
    if "model_config" in metadata:
        return (*_padded(config_from_json(metadata["model_config"], root), state), metadata)
    flags = metadata.get("flags")
    require(isinstance(flags, dict), f"checkpoint {root} records no flags: its model's shape "
            f"is unknown")
    require("embedding.word_embeddings.weight" in state, f"checkpoint {root} holds no "
            f"embedding.word_embeddings.weight")
    vocab = state["embedding.word_embeddings.weight"].shape[0]
    assert isinstance(flags, dict)  # (require raised otherwise)
    return (*_padded(config_from_flags(flags, vocab), state), metadata)


def _padded(config: TransformerConfig, state: StateDict) -> Tuple[TransformerConfig, StateDict]:
    """The single-device GPTModel's vocabulary rows (zeros after the real ones)."""
    return config, {k: pad_vocab(v, config) if k in VOCAB_NAMES else v
                    for k, v in state.items()}


def hf_to_gigatron(hf_dir: str, save: str) -> TransformerConfig:
    """Convert a Hugging Face folder into a gigatron checkpoint in `save`; returns the
    config."""
    from gigatron.models.hf_convert import read_hf, read_special_token_ids

    config, state = read_hf(hf_dir)
    save_model(save, config, state, f"huggingface:{hf_dir}", read_special_token_ids(hf_dir))
    return config


def gigatron_to_hf(load: str, out_dir: str, family: str = "",
                   tokenizer_flags: Optional[Dict[str, Any]] = None
                   ) -> Tuple[Dict[str, Any], str]:
    """Convert a gigatron checkpoint (any layout) into a Hugging Face folder with the run's
    tokenizer (its saved flags, `tokenizer_flags` given override them); returns the written
    config.json and a line saying what tokenizer the folder holds."""
    from gigatron.models.hf_convert import write_hf

    config, state, metadata = _load_with_metadata(load)
    special_ids, tokenizer_line = export_tokenizer(metadata, tokenizer_flags or {}, out_dir,
                                                   config.max_position_embeddings)
    return write_hf(out_dir, config, state, family, special_ids), tokenizer_line


def export_tokenizer(metadata: Dict[str, Any], given: Dict[str, Any], out_dir: str,
                     max_length: int) -> Tuple[Dict[str, Optional[int]], str]:
    """Write the checkpoint's tokenizer as Hugging Face files in `out_dir`: (bos/eos ids for
    config.json, what was written). A checkpoint without one (converted, NullTokenizer,
    --mock-data) keeps the ids it recorded and gets no tokenizer files."""
    from gigatron.data.tokenizer import build_tokenizer, missing_tokenizer_flags, TOKENIZER_FLAGS
    from gigatron.data.tokenizer_export import write_hf_tokenizer

    flags = {**(metadata.get("flags") or {}), **{k: v for k, v in given.items() if v is not None}}
    tokenizer_type, missing = missing_tokenizer_flags(flags)
    if tokenizer_type is None or missing or tokenizer_type == "NullTokenizer":
        recorded = metadata.get(SPECIAL_IDS_KEY) or {}
        return recorded, (f"no tokenizer files: the checkpoint names no tokenizer files "
                          f"({tokenizer_type or 'mock data'}); give the run's "
                          f"--tokenizer-type and its files to add them")
    options = {k: flags[k] for k in TOKENIZER_FLAGS if flags.get(k) is not None}
    try:
        tokenizer = build_tokenizer(tokenizer_type, **options)
        ids = write_hf_tokenizer(tokenizer, tokenizer_type, flags.get("tokenizer_model"),
                                 out_dir, max_length)
    except ValueError as err:
        raise ConversionError(f"{err} (the tokenizer as the checkpoint's flags name it: a "
                              f"relative path is from the training run's folder; give "
                              f"--tokenizer-model / --vocab-file / --merge-file to point "
                              f"elsewhere)") from None
    return ids, (f"tokenizer: {tokenizer_type} as tokenizer.json, bos "
                 f"{ids['bos_token_id']}, eos {ids['eos_token_id']}")


def megatron_to_gigatron(load: str, save: str, vocab_size: Optional[int] = None,
                         with_optimizer: bool = True) -> TransformerConfig:
    """Convert a Megatron-LM checkpoint into a gigatron checkpoint, whichever format Megatron
    wrote: torch_dist (any tp / pp; with its optimizer state unless `with_optimizer` is
    False: training/checkpoint/from_megatron.py) or the legacy torch format (weights)."""
    from gigatron.models.megatron.torch_dist import find_torch_dist, read_torch_dist

    if find_torch_dist(load) is not None:
        from gigatron.training.checkpoint.from_megatron import save_converted

        checkpoint = read_torch_dist(load, vocab_size, with_optimizer)
        save_converted(checkpoint, save, f"megatron:{load}")
        return checkpoint.config
    from gigatron.models.megatron.legacy import read_megatron

    config, state = read_megatron(load, vocab_size)
    save_model(save, config, state, f"megatron:{load}")
    return config
