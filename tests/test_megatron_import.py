"""Megatron-LM torch checkpoints (any tp/pp/virtual pipeline) import into gigatron.

Against megatron-core itself when it is importable: a tiny Megatron-Core GPTModel (local
layer spec) runs on forked gloo ranks, its state dicts are written as Megatron-LM's
save_checkpoint writes them, and the imported gigatron model's logits equal Megatron-Core's
(fp32, 1e-5). Always, without megatron-core: a hand-built Megatron layout of a known gigatron
model (including transformer_engine names) imports to exactly that model, and the logits
comparison is shown to catch a swapped q/k/v or gate/up.
"""
import argparse
import os
import sys

import pytest
import torch

from megatron_layout import megatron_args, megatron_padded, rank_chunks, write_megatron
from multirank import run_on_ranks

from gigatron.models.gpt import GPTModel
from gigatron.models.hf_common import ConversionError
from gigatron.models.megatron.legacy import (
    layer_offsets,
    merge_tensor_parallel,
    read_megatron,
)
from gigatron.models.megatron.args import config_from_megatron_args

LLAMA_LIKE = {}  # megatron_args' defaults: RoPE, SwiGLU, GQA 4/2, RMSNorm, untied, no biases
# multi-latent attention (YaRN, latent norms, v head 6 < q/k head 12), DeepSeek-V3's saved args
MLA = dict(group_query_attention=False, multi_latent_attention=True, q_lora_rank=16,
           kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
           qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0,
           mscale_all_dim=1.0, yarn_original_max_position_embeddings=8)
GPT_LIKE = dict(position_embedding_type="learned_absolute", normalization="LayerNorm",
                swiglu=False, bias_gelu_fusion=True, add_bias_linear=True, add_qkv_bias=True,
                untie_embeddings_and_output_weights=False, group_query_attention=False,
                num_query_groups=1, ffn_hidden_size=64)



def _tokens(vocab=100, batch=2, seq=16, seed=1):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _gigatron_logits(config, state, tokens):
    model = GPTModel(config)
    model.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        return model(tokens)


# --- pure pieces: each would catch a swapped half, group or stage ----------------------------

def test_swiglu_fc1_shards_merge_to_gate_then_up():
    config = config_from_megatron_args(megatron_args(tp=2))
    ranks = [torch.tensor([[10.], [20.]]), torch.tensor([[11.], [21.]])]  # [gate_r; up_r]
    merged = merge_tensor_parallel("decoder.layers.0.mlp.linear_fc1.weight", ranks, config)
    assert merged.flatten().tolist() == [10., 11., 20., 21.]  # [gate_0 gate_1; up_0 up_1]


def test_qkv_shards_merge_in_query_group_order():
    config = config_from_megatron_args(megatron_args(tp=2))  # 2 groups of 2 heads, d = 8
    per_group = (2 + 2) * 8
    ranks = [torch.full((per_group, 1), float(r)) for r in range(2)]
    merged = merge_tensor_parallel("decoder.layers.0.self_attention.linear_qkv.weight", ranks,
                                   config)
    assert merged[:per_group].eq(0).all() and merged[per_group:].eq(1).all()
    proj = merge_tensor_parallel("decoder.layers.0.self_attention.linear_proj.weight",
                                 [torch.zeros(2, 3), torch.ones(2, 3)], config)
    assert proj.shape == (2, 6) and proj[:, 3:].eq(1).all()


def test_replicas_that_differ_across_tp_are_refused():
    config = config_from_megatron_args(megatron_args(tp=2))
    with pytest.raises(ConversionError, match="tp rank 1's copy differs"):
        merge_tensor_parallel("decoder.final_layernorm.weight",
                              [torch.ones(4), torch.zeros(4)], config)


@pytest.mark.parametrize("counts, pp, vp, expected", [
    ({(0, 0): 4, (1, 0): 4}, 2, 1, {(0, 0): 0, (1, 0): 4}),
    # interleaved: 8 layers, pp 2, vp 2 -> (rank 0, chunk 1) starts at 4 (Megatron's
    # vp_stage * num_layers / vp + pp_rank * layers per virtual rank)
    ({(p, v): 2 for p in range(2) for v in range(2)}, 2, 2,
     {(0, 0): 0, (1, 0): 2, (0, 1): 4, (1, 1): 6}),
    # uneven (--decoder-first-pipeline-num-layers 1 of 5 over pp 3)
    ({(0, 0): 1, (1, 0): 2, (2, 0): 2}, 3, 1, {(0, 0): 0, (1, 0): 1, (2, 0): 3}),
])
def test_layer_offsets_follow_the_pipeline_flow(counts, pp, vp, expected):
    assert layer_offsets(counts, pp, vp) == expected


def test_layer_offsets_match_megatron_core_get_transformer_layer_offset():
    """The flow-order count equals megatron-core's own offset formula for its splits."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig as CoreConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cases = [dict(num_layers=8, pp=2, vp=None), dict(num_layers=8, pp=2, vp=2),
             dict(num_layers=12, pp=2, vp=3), dict(num_layers=5, pp=3, vp=None, first=1),
             dict(num_layers=7, pp=3, vp=None, first=3, last=2)]
    for case in cases:
        pp, vp = case["pp"], case["vp"]
        core = CoreConfig(num_layers=case["num_layers"], hidden_size=8, num_attention_heads=1,
                          pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vp,
                          num_layers_in_first_pipeline_stage=case.get("first"),
                          num_layers_in_last_pipeline_stage=case.get("last"),
                          pipeline_dtype=torch.float32)
        theirs = {(p, v): get_transformer_layer_offset(core, v if vp else None, p)
                  for p in range(pp) for v in range(vp or 1)}
        flow = sorted(theirs, key=lambda k: theirs[k])
        counts = {key: (theirs[flow[i + 1]] if i + 1 < len(flow) else case["num_layers"])
                  - theirs[key] for i, key in enumerate(flow)}
        assert layer_offsets(counts, pp, vp or 1) == theirs, case


# --- hand-built Megatron layouts (no megatron-core needed) -----------------------------------

def _reference(args: argparse.Namespace, seed=0):
    """A random gigatron model of the args' shape: weights large enough (std 0.2) for
    attention to matter, norms and biases random too, so any swap shows in the logits."""
    config = config_from_megatron_args(args)
    torch.manual_seed(seed)
    model = GPTModel(config, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn_like(p)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                p[config.vocab_size:] = 0  # gigatron's padding rows are zeros
    return config, {k: v.clone() for k, v in model.state_dict().items()}


def _write_layout(root, args, state, config, te=False, corrupt=None):
    vocab = {k: megatron_padded(v, config.vocab_size, args.padded_vocab_size)
             for k, v in state.items() if k in ("embedding.word_embeddings.weight",
                                                "output_layer.weight")}
    chunks = rank_chunks({**state, **vocab}, config.num_layers,
                         args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                         args.virtual_pipeline_model_parallel_size or 1,
                         config.activation == "swiglu",
                         not config.untie_embeddings_and_output_weights, te)
    if corrupt is not None:
        corrupt(chunks)
    write_megatron(root, 20, args, chunks)


@pytest.mark.parametrize("model, tp, pp, vp, te", [
    (LLAMA_LIKE, 2, 2, None, False),
    (LLAMA_LIKE, 2, 1, None, True),
    (GPT_LIKE, 2, 2, 2, True),
    (dict(GPT_LIKE, swiglu=True, bias_gelu_fusion=False), 4, 1, None, False),
    (dict(LLAMA_LIKE, qk_layernorm=True), 2, 1, None, True),
    (dict(GPT_LIKE, qk_layernorm=True), 2, 1, None, False),
    (MLA, 2, 2, None, False),
    (dict(MLA, q_lora_rank=None), 2, 1, None, True),
], ids=["llama_tp2_pp2", "llama_tp2_te", "gpt_tp2_pp2_vp2_te", "swiglu_bias_tp4",
        "qk_layernorm_tp2_te", "qk_layernorm_layernorm_tp2", "mla_tp2_pp2",
        "mla_no_q_lora_tp2_te"])
def test_hand_built_megatron_layout_imports_to_the_same_model(tmp_path, model, tp, pp, vp, te):
    args = megatron_args(tp=tp, pp=pp, vp=vp, vocab_size=100, **model)
    config, state = _reference(args)
    _write_layout(str(tmp_path / "meg"), args, state, config, te=te)
    imported_config, imported = read_megatron(str(tmp_path / "meg"))
    assert imported_config == config
    assert imported.keys() == state.keys()
    if model.get("multi_latent_attention"):  # the saved MLA and YaRN args, read
        assert (config.q_lora_rank, config.kv_lora_rank, config.v_head_dim, config.rope_type,
                config.original_max_position_embeddings) == (model["q_lora_rank"], 12, 6,
                                                              "yarn", 8)
    for name, tensor in state.items():
        assert torch.equal(imported[name], tensor), name


def _swap_q_k(chunks):
    """Rank 0's first query head and its group's key head trade places."""
    qkv = chunks[(0, 0)][0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    d = 8
    q, k = qkv[:d].clone(), qkv[2 * d:3 * d].clone()
    qkv[:d], qkv[2 * d:3 * d] = k, q


def _swap_gate_up(chunks):
    fc1 = chunks[(1, 0)][0]["decoder.layers.1.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    chunks[(1, 0)][0]["decoder.layers.1.mlp.linear_fc1.weight"] = torch.cat([up, gate])


@pytest.mark.parametrize("corrupt", [_swap_q_k, _swap_gate_up], ids=["q_k", "gate_up"])
def test_logit_comparison_catches_a_swapped_half(tmp_path, corrupt):
    args = megatron_args(tp=2, vocab_size=100)
    config, state = _reference(args)
    _write_layout(str(tmp_path / "meg"), args, state, config, corrupt=corrupt)
    tokens = _tokens()
    wrong = _gigatron_logits(*read_megatron(str(tmp_path / "meg")), tokens)
    right = _gigatron_logits(config, state, tokens)
    # the import tests compare at 1e-5: a swap is a hundred times that at least
    assert (wrong - right)[..., :config.vocab_size].abs().max() > 1e-3


def test_vocab_size_drops_megatron_padding_and_padded_rows_stay_tokens_without_it(tmp_path):
    args = megatron_args(tp=2)  # 100 real tokens padded to 128; the args do not say 100
    config, state = _reference(argparse.Namespace(**{**vars(args), "vocab_size": 100}))
    _write_layout(str(tmp_path / "meg"), args, state, config)
    kept, _ = read_megatron(str(tmp_path / "meg"))
    assert kept.vocab_size == args.padded_vocab_size == 128
    trimmed, weights = read_megatron(str(tmp_path / "meg"), vocab_size=100)
    assert trimmed.vocab_size == 100
    assert torch.equal(weights["embedding.word_embeddings.weight"],
                       state["embedding.word_embeddings.weight"])


@pytest.mark.parametrize("change, named", [
    (dict(num_experts=8), "num_experts=8 (mixture of experts)"),
    (dict(qk_l2_norm=True), "qk_l2_norm"),
    (dict(position_embedding_type="mrope"), "position_embedding_type='mrope'"),
    (dict(num_layers=6), "holds 4 layers, its args say num_layers=6"),
    (dict(hidden_size=48, kv_channels=12), "do not fit the model"),
])
def test_what_gigatron_cannot_load_is_one_line_naming_it(tmp_path, change, named):
    args = megatron_args(tp=2, vocab_size=100)
    config, state = _reference(args)
    _write_layout(str(tmp_path / "meg"), argparse.Namespace(**{**vars(args), **change}),
                  state, config)
    with pytest.raises(ConversionError) as err:
        read_megatron(str(tmp_path / "meg"))
    assert named in str(err.value) and "\n" not in str(err.value)


def test_missing_rank_folder_and_torch_dist_format_are_named(tmp_path):
    args = megatron_args(tp=2, vocab_size=100)
    config, state = _reference(args)
    _write_layout(str(tmp_path / "meg"), args, state, config)
    os.rename(tmp_path / "meg" / "iter_0000020" / "mp_rank_01",
              tmp_path / "meg" / "iter_0000020" / "elsewhere")
    with pytest.raises(ConversionError, match="tensor_model_parallel_size=2"):
        read_megatron(str(tmp_path / "meg"))
    dist_ckpt = tmp_path / "dist" / "iter_0000005"
    dist_ckpt.mkdir(parents=True)
    (dist_ckpt / "common.pt").write_bytes(b"")
    (tmp_path / "dist" / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(ConversionError, match="torch_dist checkpoint"):
        read_megatron(str(tmp_path / "dist"))


def test_cli_writes_a_gigatron_checkpoint_and_prints_the_model_flags(tmp_path, capsys):
    from gigatron.cli import convert
    from gigatron.training.checkpoint.convert import load_model

    args = megatron_args(tp=2, pp=2, vocab_size=100)
    config, state = _reference(args)
    _write_layout(str(tmp_path / "meg"), args, state, config, te=True)
    assert convert.main(["megatron-to-gigatron", "--load", str(tmp_path / "meg"),
                         "--save", str(tmp_path / "gig")]) == 0
    out = capsys.readouterr().out
    assert "--swiglu" in out and "--group-query-attention --num-query-groups 2" in out
    loaded_config, loaded = load_model(str(tmp_path / "gig"))
    assert loaded_config == config
    tokens = _tokens()
    torch.testing.assert_close(_gigatron_logits(loaded_config, loaded, tokens),
                               _gigatron_logits(config, state, tokens), rtol=0, atol=0)
    assert convert.main(["megatron-to-gigatron", "--load", str(tmp_path / "nothing"),
                         "--save", str(tmp_path / "x")]) == 1
    assert "latest_checkpointed_iteration.txt" in capsys.readouterr().err


# --- against megatron-core ---------------------------------------------------------------

@pytest.mark.parametrize("model, tp, pp, vp", [
    (LLAMA_LIKE, 1, 1, None),
    (LLAMA_LIKE, 2, 1, None),
    (LLAMA_LIKE, 1, 2, None),
    (GPT_LIKE, 2, 2, None),
    (LLAMA_LIKE, 1, 2, 2),
    (dict(LLAMA_LIKE, qk_layernorm=True), 2, 1, None),
    (dict(GPT_LIKE, qk_layernorm=True), 2, 1, None),
], ids=["llama_tp1", "llama_tp2", "llama_pp2", "gpt_tp2_pp2", "llama_pp2_vp2",
        "qk_layernorm_tp2", "qk_layernorm_layernorm_tp2"])
def test_megatron_core_checkpoint_imports_with_equal_logits(tmp_path, model, tp, pp, vp):
    pytest.importorskip("megatron.core")
    import megatron_reference

    args = megatron_args(tp=tp, pp=pp, vp=vp, **model)
    tokens = _tokens()
    results = run_on_ranks(megatron_reference.run_and_save, tp * pp, args,
                           str(tmp_path / "meg"), tokens, timeout=180)
    theirs = next(r for r in results if r is not None)
    config, state = read_megatron(str(tmp_path / "meg"))
    assert config.vocab_size == args.padded_vocab_size  # Megatron's softmax sees every row
    ours = _gigatron_logits(config, state, tokens)
    torch.testing.assert_close(ours[..., :theirs.shape[-1]], theirs, rtol=0, atol=1e-5)


def test_args_holding_classes_of_a_missing_package_still_load(tmp_path, monkeypatch):
    """Megatron pickles its enums into the args (attention_backend...): they must not need
    megatron installed to read the checkpoint."""
    import enum
    import types

    module = types.ModuleType("not_installed_megatron_enums")
    Backend = enum.Enum("AttnBackend", {"auto": 5})
    Backend.__module__ = module.__name__
    module.AttnBackend = Backend
    monkeypatch.setitem(sys.modules, module.__name__, module)
    args = megatron_args(tp=2, vocab_size=100, attention_backend=Backend.auto)
    config, state = _reference(args)
    _write_layout(str(tmp_path / "meg"), args, state, config)
    monkeypatch.delitem(sys.modules, module.__name__)
    imported_config, _ = read_megatron(str(tmp_path / "meg"))
    assert imported_config == config
