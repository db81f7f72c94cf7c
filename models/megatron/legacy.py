"""Megatron-LM checkpoints (torch format, any tp/pp/virtual pipeline) -> one gigatron state dict.

gigatron's parameter names are Megatron-Core GPTModel's (local layer spec), so the work is:

* names: the transformer_engine spec fuses the norms into the next linear
  (`self_attention.linear_qkv.layer_norm_weight` is the input norm,
  `mlp.linear_fc1.layer_norm_weight` the pre-MLP norm); `_extra_state` entries (FP8
  metadata) carry no weights.
* pipeline: each chunk numbers its layers from 0; a chunk's global offset is the layer count
  of the chunks before it in the order activations flow, (virtual stage, pipeline rank) --
  what Megatron-Core's get_transformer_layer_offset computes for every split it supports.
* tensor parallelism: column-parallel weights (the vocabulary, linear_qkv, linear_fc1, the
  output layer) are concatenated along dim 0, row-parallel ones (linear_proj, linear_fc2)
  along dim 1, the rest are replicas. The fused QKV is laid out per query group and the
  groups are split in order, so concatenation is already gigatron's [q heads; k; v] per
  group. With SwiGLU each rank's fc1 holds [gate_r; up_r]; gigatron's holds [gate; up].
* vocabulary: Megatron pads to a multiple of make_vocab_size_divisible_by x tp; gigatron's
  single-device table pads to a multiple of make_vocab_size_divisible_by (zero rows).
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import ConversionError, StateDict, pad_vocab, require
from gigatron.models.megatron.args import config_from_megatron_args, vocab_sizes
from gigatron.models.megatron.files import read_checkpoint
from gigatron.models.megatron.moe import experts_to_gigatron, is_routed_expert, moe_layer_names

# names inside a layer: Megatron-Core (local or transformer_engine spec) -> gigatron
_LAYER_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    # multi-latent attention: transformer_engine fuses the latent norms into the up-projections
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    **{f"self_attention.{n}.weight": f"self_attention.{n}.weight" for n in (
        "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
        "linear_kv_up_proj", "kv_layernorm")},
    **{n: n for n in (
        "input_layernorm.weight", "input_layernorm.bias",
        "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
        "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
        "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
        "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
        "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
        "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
        "mlp.linear_fc2.weight", "mlp.linear_fc2.bias", *moe_layer_names())},
}
_MODEL_NAMES = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                "decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
                "output_layer.weight")
_COLUMN = ("word_embeddings.weight", "linear_qkv.weight", "linear_qkv.bias",
           "linear_fc1.weight", "linear_fc1.bias", "output_layer.weight", "eh_proj.weight",
           "linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_up_proj.weight")
# MLA's down-projections: column-parallel in the local spec, replicated (TELinear
# 'duplicated') in the transformer_engine spec
_DOWN = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
# multi-token prediction (models/mtp/): the same names in gigatron, the layer's mapped as above
_MTP = re.compile(r"mtp\.layers\.(\d+)\.(?:(?:enorm|hnorm|final_layernorm)\.(?:weight|bias)"
                  r"|eh_proj\.weight|transformer_layer\.(.+))$")
_VOCAB_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")

Shards = Dict[str, List[torch.Tensor]]  # gigatron name -> one tensor per tp rank


def gigatron_name(name: str, offset: int) -> Optional[str]:
    """gigatron's name of a Megatron-Core parameter of a chunk whose first layer is global
    layer `offset`; None for entries without weights; ConversionError if unknown."""
    if name.endswith("_extra_state"):
        return None
    match = _LAYER.match(name)
    if match:
        inner = _LAYER_NAMES.get(match.group(2))
        if inner is None and is_routed_expert(match.group(2)):
            inner = match.group(2)  # named by experts_to_gigatron once merged over tp
        if inner is not None:
            return f"decoder.layers.{offset + int(match.group(1))}.{inner}"
    elif name in _MODEL_NAMES:
        return name
    elif (mtp := _MTP.match(name)):
        if mtp.group(2) is None:
            return name
        inner = _LAYER_NAMES.get(mtp.group(2))
        if inner is None and is_routed_expert(mtp.group(2)):
            inner = mtp.group(2)
        if inner is not None:
            return f"mtp.layers.{mtp.group(1)}.transformer_layer.{inner}"
    hint = (" (mixture of experts is read from torch_dist checkpoints only: resave with "
            "--ckpt-format torch_dist)" if ".experts." in name
            else " (legacy, pre-Megatron-Core model: not supported)"
            if name.startswith("language_model.") else "")
    raise ConversionError(f"Megatron parameter {name} is not understood{hint}")


def chunk_layer_count(chunk: StateDict) -> int:
    """Layers in one chunk, checking they are numbered 0..n-1 as Megatron-Core saves them."""
    local = sorted({int(m.group(1)) for k in chunk if (m := _LAYER.match(k))})
    require(local == list(range(len(local))), f"a model chunk holds layers {local}, not "
            f"0..{len(local) - 1}")
    return len(local)


def flow_order(pp: int, vp: int) -> List[Tuple[int, int]]:
    """(pipeline rank, chunk index) in the order activations pass through them."""
    return [(p, v) for v in range(vp) for p in range(pp)]


def layer_offsets(layer_counts: Dict[Tuple[int, int], int], pp: int, vp: int
                  ) -> Dict[Tuple[int, int], int]:
    """Global number of each chunk's first layer: the layers of the chunks before it."""
    offsets, seen = {}, 0
    for key in flow_order(pp, vp):
        offsets[key] = seen
        seen += layer_counts[key]
    return offsets


def collect_shards(models: Dict[Tuple[int, int], List[StateDict]], tp: int, pp: int
                   ) -> Tuple[Shards, int]:
    """Every parameter under its gigatron name with its tp shards in rank order, and the
    number of layers found."""
    vp = len(models[(0, 0)])
    counts = {(p, v): chunk_layer_count(models[(0, p)][v]) for p in range(pp) for v in range(vp)}
    for (t, p), chunks in models.items():
        for v, chunk in enumerate(chunks):
            require(chunk_layer_count(chunk) == counts[(p, v)], f"tp rank {t} holds "
                    f"{chunk_layer_count(chunk)} layers in pipeline rank {p} chunk {v}, tp "
                    f"rank 0 holds {counts[(p, v)]}")
    offsets = layer_offsets(counts, pp, vp)
    shards: Shards = {}
    for t in range(tp):
        for p in range(pp):
            for v, chunk in enumerate(models[(t, p)]):
                for name, tensor in chunk.items():
                    if name.startswith("embedding.") and (p, v) != (0, 0):
                        continue  # multi-token prediction's copy on the last stage
                    ours = gigatron_name(name, offsets[(p, v)])
                    if ours is not None and isinstance(tensor, torch.Tensor):
                        shards.setdefault(ours, []).append(tensor)
    return shards, sum(counts.values())


def _latent_size(name: str, config: TransformerConfig) -> int:
    """Output channels of an MLA down-projection (a replica's rows; a column shard has
    fewer)."""
    if name.endswith("linear_q_down_proj.weight"):
        return int(config.q_lora_rank or 0)
    return config.kv_lora_rank + config.qk_pos_emb_head_dim


def merge_tensor_parallel(name: str, shards: Sequence[torch.Tensor],
                          config: TransformerConfig) -> torch.Tensor:
    """The full tensor of a parameter saved as one shard per tp rank."""
    if len(shards) == 1:
        return shards[0]
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")) and config.activation == "swiglu":
        gates, ups = zip(*(s.chunk(2) for s in shards))
        return torch.cat([*gates, *ups])
    if name.endswith(_COLUMN) or (name.endswith(_DOWN) and
                                  shards[0].shape[0] < _latent_size(name, config)):
        return torch.cat(list(shards))
    if name.endswith(_ROW):
        return torch.cat(list(shards), dim=1)
    for rank, shard in enumerate(shards[1:], start=1):
        require(torch.equal(shard, shards[0]), f"{name} is replicated across tensor-parallel "
                f"ranks but tp rank {rank}'s copy differs from rank 0's: the shards do not "
                f"belong to one checkpoint")
    return shards[0]


def expected_shapes(config: TransformerConfig, buffers: bool = True) -> Dict[str, torch.Size]:
    """Every tensor's shape in gigatron's single-device model (built on the meta device):
    its state dict, or (`buffers` False: an optimizer's state) its parameters only."""
    from gigatron.models.gpt import GPTModel

    model = GPTModel(config, device=torch.device("meta"))
    tensors = model.state_dict() if buffers else dict(model.named_parameters())
    return {k: v.shape for k, v in tensors.items()}


def _revocab(name: str, tensor: torch.Tensor, config: TransformerConfig,
             padded: int) -> torch.Tensor:
    """Megatron's padded rows off, gigatron's (zero) padding on."""
    require(tensor.shape[0] == padded, f"{name} has {tensor.shape[0]} rows after merging the "
            f"tensor-parallel shards, the saved args say padded_vocab_size={padded}")
    return pad_vocab(tensor[:config.vocab_size], config)


def megatron_state_dict(models: Dict[Tuple[int, int], List[StateDict]], tp: int, pp: int,
                        config: TransformerConfig, padded_vocab: int, buffers: bool = True
                        ) -> StateDict:
    """gigatron's single-device state dict of every rank's Megatron-Core model chunks
    (`buffers` False: of an optimizer's state, which has none for the model's buffers)."""
    shards, layers = collect_shards(models, tp, pp)
    require(layers == config.num_layers, f"the checkpoint holds {layers} layers, its args "
            f"say num_layers={config.num_layers}")
    for name, parts in shards.items():
        require(len(parts) == tp, f"{name} is saved {len(parts)} times, once per "
                f"tensor-parallel rank expected ({tp})")
    state = experts_to_gigatron({name: merge_tensor_parallel(name, parts, config)
                                 for name, parts in shards.items()})
    if not config.untie_embeddings_and_output_weights:
        state.pop("output_layer.weight", None)  # the last stage's copy of the embedding
    for name in _VOCAB_NAMES:
        if name in state:
            state[name] = _revocab(name, state[name], config, padded_vocab)
    _check_against_model(state, config, buffers)
    return {k: v.contiguous() for k, v in state.items()}


def _check_against_model(state: StateDict, config: TransformerConfig, buffers: bool) -> None:
    expected = expected_shapes(config, buffers)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    wrong = [f"{k} {tuple(state[k].shape)} (expected {tuple(v)})" for k, v in expected.items()
             if k in state and state[k].shape != v]
    problems = ([f"missing {', '.join(missing[:4])}"] if missing else []) + \
        ([f"not in the model {', '.join(extra[:4])}"] if extra else []) + wrong[:4]
    if problems:
        raise ConversionError("the Megatron weights do not fit the model its args describe: "
                              + "; ".join(problems))


def read_megatron(load: str, vocab_size: Optional[int] = None
                  ) -> Tuple[TransformerConfig, StateDict]:
    """(config, gigatron single-device state dict) of a Megatron-LM torch checkpoint: a
    --save folder (its tracker names the iteration) or one iteration folder. `vocab_size`:
    the tokenizer's vocabulary, to drop Megatron's padding rows (default: the saved
    --vocab-size, else every padded row stays a token, as Megatron's softmax sees them)."""
    checkpoint = read_checkpoint(load)
    experts = getattr(checkpoint.args, "num_experts", None)
    require(not experts, f"{checkpoint.folder}: num_experts={experts} (mixture of experts) is "
            f"read from torch_dist checkpoints only: resave with --ckpt-format torch_dist")
    config = config_from_megatron_args(checkpoint.args, vocab_size)
    state = megatron_state_dict(checkpoint.models, checkpoint.tp, checkpoint.pp, config,
                                vocab_sizes(checkpoint.args, vocab_size)[1])
    # the model is built in the weights' dtype (a bf16 run's checkpoint stays bf16)
    config.params_dtype = state["embedding.word_embeddings.weight"].dtype
    return config, state
