"""Hugging Face import/export: tiny random GPT-2 and Llama models built locally (no downloads)
give the same logits in transformers and in gigatron, both ways, through gigatron
checkpoints (training/checkpoint/torch_dist/save_load.py's global-model functions)."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gigatron.models.gpt import GPTModel  # noqa: E402
from gigatron.models.hf_common import ConversionError  # noqa: E402
from gigatron.training.checkpoint.convert import (  # noqa: E402
    gigatron_to_hf,
    hf_to_gigatron,
    load_model,
    save_model,
)


VOCAB = 101  # not a multiple of 128: gigatron pads the table, only real logits are compared


def _gpt2(tmp_path, **overrides):
    torch.manual_seed(0)
    kwargs = dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    kwargs.update(overrides)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs)).eval()
    _randomize_norms(model)
    model.save_pretrained(tmp_path / "hf")
    return model


def _llama(tmp_path, **overrides):
    torch.manual_seed(0)
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False, rope_theta=50000.0)
    kwargs.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval()
    _randomize_norms(model)
    model.save_pretrained(tmp_path / "hf")
    return model


def _randomize_norms(model):
    """Norms start at ones/zeros; random values make a swapped norm visible."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))


def _tokens(seed=1, batch=2, seq=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def _gigatron_logits(folder, tokens):
    config, state = load_model(folder)
    model = GPTModel(config)
    model.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape[-1] == config.padded_vocab_size(1) > VOCAB
    return logits[..., :config.vocab_size]  # padded rows are not tokens


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def _assert_export_loads(folder, cls):
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], (kind, info[kind])
    return model.eval()


def test_gpt2_import_matches_transformers_logits(tmp_path):
    hf = _gpt2(tmp_path)
    hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    config, _ = load_model(str(tmp_path / "gig"))
    assert config.activation == "gelu_tanh" and not config.untie_embeddings_and_output_weights
    tokens = _tokens()
    torch.testing.assert_close(_gigatron_logits(str(tmp_path / "gig"), tokens),
                               _hf_logits(hf, tokens), rtol=0, atol=1e-5)


def test_gpt2_export_loads_in_transformers_with_equal_logits(tmp_path):
    _gpt2(tmp_path)
    hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    exported = _assert_export_loads(str(tmp_path / "out"), transformers.GPT2LMHeadModel)
    tokens = _tokens(seed=2)
    torch.testing.assert_close(_hf_logits(exported, tokens),
                               _gigatron_logits(str(tmp_path / "gig"), tokens),
                               rtol=0, atol=1e-5)


def test_gpt2_exported_from_a_gigatron_initialised_model(tmp_path):
    from gigatron.models.config import TransformerConfig
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               vocab_size=VOCAB, seq_length=16, activation="gelu_tanh",
                               hidden_dropout=0.0, attention_dropout=0.0)
    save_model(str(tmp_path / "gig"), config, GPTModel(config, seed=7).state_dict(), "test")
    gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    exported = _assert_export_loads(str(tmp_path / "out"), transformers.GPT2LMHeadModel)
    tokens = _tokens(seed=3, seq=16)
    torch.testing.assert_close(_hf_logits(exported, tokens),
                               _gigatron_logits(str(tmp_path / "gig"), tokens),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides", [
    {},  # GQA (2 kv heads for 4 query heads), untied head, rope_theta 50000
    {"num_key_value_heads": 1, "tie_word_embeddings": True},  # MQA, tied
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
     "max_position_embeddings": 16384, "rope_theta": 500000.0},  # Llama 3.1
    {"attention_bias": True, "mlp_bias": True, "head_dim": 12},  # biases, head_dim != h/n
], ids=["gqa_untied", "mqa_tied", "llama3_rope_scaling", "biases_head_dim"])
def test_llama_import_and_export_match_transformers_logits(tmp_path, overrides):
    hf = _llama(tmp_path, **overrides)
    hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    tokens = _tokens(seed=4, seq=20)
    ours = _gigatron_logits(str(tmp_path / "gig"), tokens)
    torch.testing.assert_close(ours, _hf_logits(hf, tokens), rtol=0, atol=1e-5)
    gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    exported = _assert_export_loads(str(tmp_path / "out"), transformers.LlamaForCausalLM)
    torch.testing.assert_close(_hf_logits(exported, tokens), ours, rtol=0, atol=1e-5)


def test_sharded_safetensors_folder_imports(tmp_path):
    hf = _gpt2(tmp_path)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    hf_to_gigatron(str(tmp_path / "sharded"), str(tmp_path / "gig"))
    tokens = _tokens(seed=5)
    torch.testing.assert_close(_gigatron_logits(str(tmp_path / "gig"), tokens),
                               _hf_logits(hf, tokens), rtol=0, atol=1e-5)


def test_llama_import_sets_gqa_theta_and_untied_head(tmp_path):
    _llama(tmp_path)
    config = hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    assert (config.num_query_groups, config.num_attention_heads) == (2, 4)
    assert config.rotary_base == 50000.0 and config.untie_embeddings_and_output_weights
    assert config.activation == "swiglu" and config.normalization == "RMSNorm"


@pytest.mark.parametrize("change, named", [
    ({"model_type": "bert", "architectures": ["BertModel"]}, "BertModel"),
    ({"activation_function": "relu"}, "activation_function"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
])
def test_unsupported_gpt2_config_is_one_line_naming_the_field(tmp_path, change, named):
    _gpt2(tmp_path)
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    data.update(change)
    path.write_text(json.dumps(data))
    with pytest.raises(ConversionError) as err:
        hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    assert named in str(err.value) and "\n" not in str(err.value)


def test_unsupported_llama_rope_scaling_is_named(tmp_path):
    _llama(tmp_path)
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    data.pop("rope_parameters", None)
    data["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    path.write_text(json.dumps(data))
    with pytest.raises(ConversionError, match="rope_type 'yarn'"):
        hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))


def test_cli_round_trip(tmp_path):
    from gigatron.cli import convert
    _gpt2(tmp_path)
    assert convert.main(["hf-to-gigatron", "--load", str(tmp_path / "hf"),
                         "--save", str(tmp_path / "gig")]) == 0
    assert convert.main(["gigatron-to-hf", "--load", str(tmp_path / "gig"),
                         "--save", str(tmp_path / "out")]) == 0
    assert os.path.isfile(tmp_path / "out" / "model.safetensors")
    _assert_export_loads(str(tmp_path / "out"), transformers.GPT2LMHeadModel)


def test_export_to_a_family_that_cannot_express_the_model_fails_in_one_line(tmp_path):
    from gigatron.cli import convert
    _llama(tmp_path)
    hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    with pytest.raises(ConversionError, match="cannot export to GPT-2: position_embedding_type"):
        gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"), family="gpt2")
    assert convert.main(["gigatron-to-hf", "--load", str(tmp_path / "gig"),
                         "--save", str(tmp_path / "out"), "--family", "gpt2"]) == 1


def test_bf16_weights_round_trip_exactly_and_keep_their_dtype(tmp_path):
    from safetensors.torch import load_file
    hf = _llama(tmp_path).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    config = hf_to_gigatron(str(tmp_path / "bf16"), str(tmp_path / "gig"))
    assert config.params_dtype == torch.bfloat16
    assert load_model(str(tmp_path / "gig"))[0].params_dtype == torch.bfloat16
    gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    before = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert after[name].dtype == torch.bfloat16 and torch.equal(after[name], tensor), name


@pytest.mark.parametrize("family, overrides", [
    ("gpt2", {}),
    ("gpt2", {"activation_function": "gelu", "n_inner": 40}),
    ("llama", {}),
    ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192},
               "max_position_embeddings": 16384, "rope_theta": 500000.0}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "head_dim": 12}),
], ids=["gpt2", "gpt2_exact_gelu", "llama_gqa", "llama_mqa_tied", "llama3", "llama_biases"])
def test_recorded_model_flags_rebuild_the_converted_config(tmp_path, family, overrides):
    """What pretrain_gpt.py builds from the flags the checkpoint records (and the CLI prints)
    is the converted model."""
    from gigatron.training.checkpoint.convert import (config_from_flags, model_flags,
                                                      parse_model_flags, unexpressed_fields)

    (_gpt2 if family == "gpt2" else _llama)(tmp_path, **overrides)
    config = hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    rebuilt = config_from_flags(parse_model_flags(model_flags(config)))
    assert unexpressed_fields(config, rebuilt) == []
    assert rebuilt.activation == config.activation and rebuilt.kv_channels == config.kv_channels


def test_a_run_checkpoint_without_a_recorded_config_converts_from_its_flags(tmp_path):
    """A checkpoint pretrain_gpt.py saved records only its flags: the config they build and
    the saved vocabulary's rows make the model."""
    import gigatron.training.checkpoint.torch_dist.save_load as dist_checkpoint
    from gigatron.training.checkpoint.convert import model_flags, parse_model_flags

    hf = _llama(tmp_path)
    config = hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    state, _ = dist_checkpoint.load_global_model(str(tmp_path / "gig"))
    flags = parse_model_flags(model_flags(config))
    flags["vocab_size"] = None  # a tokenizer file gave the vocabulary
    dist_checkpoint.save_global_model(state, str(tmp_path / "run"), 7, {"flags": flags})
    gigatron_to_hf(str(tmp_path / "run"), str(tmp_path / "out"))
    exported = _assert_export_loads(str(tmp_path / "out"), transformers.LlamaForCausalLM)
    tokens = _tokens(seed=6)
    torch.testing.assert_close(_hf_logits(exported, tokens), _hf_logits(hf, tokens),
                               rtol=0, atol=1e-5)
