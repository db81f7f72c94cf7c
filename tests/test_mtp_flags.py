"""--mtp-num-layers and --mtp-loss-scaling-factor: Megatron-LM's names and defaults set
Megatron-Core's TransformerConfig fields; what cannot run is one line naming the flag; the
MTP transformer layer takes the last decoder layer's kind (MoE, sliding window)."""
from __future__ import annotations

import dataclasses

import pytest

from gigatron.training.config.arguments import parse_args
from gigatron.training.config.megatron.catalog import MEGATRON_LM, entries
from gigatron.training.config.validation import ConfigError

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 4 --lr 1e-3 --mock-data --vocab-size 128 "
        "--position-embedding-type rope").split()


def test_flags_set_the_fields_with_megatrons_defaults():
    megatron = {names[0]: default for _, names, default in entries(MEGATRON_LM)}
    assert megatron["--mtp-loss-scaling-factor"] == 0.1
    plain = parse_args(BASE, 1).model
    assert plain.mtp_num_layers is None and plain.mtp_loss_scaling_factor == 0.1
    model = parse_args(BASE + "--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3".split(),
                       1).model
    assert (model.mtp_num_layers, model.mtp_loss_scaling_factor) == (1, 0.3)


@pytest.mark.parametrize("flags, world, line", [
    ("--mtp-num-layers 0", 1, "--mtp-num-layers must be > 0"),
    ("--mtp-num-layers 1 --context-parallel-size 2", 2,
     "--mtp-num-layers with --context-parallel-size > 1 is not implemented"),
    ("--mtp-num-layers 1 --pipeline-model-parallel-size 2 --position-embedding-type "
     "learned_absolute", 2, "needs --position-embedding-type rope or none"),
    ("--mtp-num-layers 1 --pipeline-model-parallel-size 2 --pipeline-schedule zbv "
     "--num-layers 4 --num-layers-per-virtual-pipeline-stage 1 "
     "--untie-embeddings-and-output-weights", 2, "--mtp-num-layers with --pipeline-schedule "
     "zbv is not supported"),
    ("--mtp-standalone", 1, "--mtp-standalone"),
])
def test_what_cannot_run_is_one_line_naming_the_flag(flags, world, line):
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + flags.split(), world)
    assert any(line in problem for problem in err.value.problems), err.value.problems


def test_the_mtp_layer_is_of_the_last_decoder_layers_kind():
    import torch

    from gigatron.models.gpt import GPTModel
    from gigatron.models.moe.layer import MoELayer

    model = parse_args(BASE + "--num-layers 3 --num-experts 4 --moe-layer-freq [0,1,0] "
                       "--mtp-num-layers 1 --window-size 4,0 --window-attn-skip-freq "
                       "[1,1,0]".split(), 1).model
    gpt = GPTModel(model, device=torch.device("meta"))
    layer = gpt.mtp.layers[0].transformer_layer
    assert not isinstance(layer.mlp, MoELayer)  # the last decoder layer is dense
    assert layer.self_attention.core_attention.window is None  # and has full attention
    last_moe = dataclasses.replace(model, moe_layer_freq=[0, 0, 1], window_attn_skip_freq=[0, 0, 1])
    layer = GPTModel(last_moe, device=torch.device("meta")).mtp.layers[0].transformer_layer
    assert isinstance(layer.mlp, MoELayer) and layer.self_attention.core_attention.window == 4


def test_moe_logging_counts_the_mtp_moe_layers():
    """The logged balancing loss is a mean over MoE layers: the MTP's count, as Megatron-LM's
    track_moe_metrics counts them (its per-layer statistics are logged under its number)."""
    import torch

    from gigatron.training.run.moe import MoETraining

    model = parse_args(BASE + "--num-experts 4 --moe-layer-freq [0,1] --mtp-num-layers "
                       "2".split(), 1).model
    assert MoETraining([], model, None, 1, torch.device("cpu")).layers == [1, 2, 3]
