"""Multi-token prediction in the FLOPs count (training/observe/flops.py) and the planner's
parameters: each depth adds exactly its own parameters (a layer of the last decoder layer's
kind, eh_proj, three norms: read from the model built on the meta device) plus another pass
through the output layer to N, and its layer to the attention term; the planner's last stage
holds the mtp.layers.N.* parameters (it reads the model)."""
from __future__ import annotations

import dataclasses

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.parallel.pipeline.partition import partition_layers
from gigatron.training.observe.flops import (flops_per_token, matmul_parameter_count,
                                             padded_vocab_size)
from gigatron.training.plan.parameters import stage_parameters

BASE = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=100,
                         seq_length=16, position_embedding_type="rope",
                         normalization="RMSNorm", activation="swiglu", ffn_hidden_size=48)


def _mtp_params(config):
    model = GPTModel(config, device=torch.device("meta"))
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))


def test_each_depth_counts_its_parameters_and_another_output_pass():
    mtp = dataclasses.replace(BASE, mtp_num_layers=2)
    vocab = padded_vocab_size(BASE.vocab_size, BASE.make_vocab_size_divisible_by, 1)
    added = matmul_parameter_count(mtp) - matmul_parameter_count(BASE)
    assert added == _mtp_params(mtp) + 2 * vocab * BASE.hidden_size
    attention = 6.0 * 2 * 2 * BASE.hidden_size * BASE.seq_length  # 12 h s per added layer
    assert flops_per_token(mtp) - flops_per_token(BASE) == 6.0 * added + attention


def test_planner_last_stage_holds_the_mtp_parameters():
    """Tied: the last stage's MTP embedding is its output weight (no extra table); untied it
    keeps a copy of the word embedding besides the output layer."""
    vocab = padded_vocab_size(BASE.vocab_size, BASE.make_vocab_size_divisible_by, 1)
    partition = partition_layers(4, 2)
    for untie, copy in ((False, 0), (True, vocab * BASE.hidden_size)):
        plain = dataclasses.replace(BASE, untie_embeddings_and_output_weights=untie)
        mtp = dataclasses.replace(plain, mtp_num_layers=1)
        counts = [[sum(s.numel for s in stage_parameters(c, 1, partition, rank)[0])
                   for rank in range(2)] for c in (plain, mtp)]
        assert counts[1][0] == counts[0][0]
        assert counts[1][1] - counts[0][1] == _mtp_params(mtp) + copy
