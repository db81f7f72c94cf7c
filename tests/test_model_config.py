"""TransformerConfig validation: bad shapes raise ValueErrors that name the field."""
import pytest

from gigatron.models.config import TransformerConfig
from gigatron.models.zoo import load_config


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=100)
    base.update(kw)
    return TransformerConfig(**base)


@pytest.mark.parametrize("kw,tp,field", [
    (dict(num_attention_heads=6, num_query_groups=6, hidden_size=66), 4, "num_attention_heads"),
    (dict(num_query_groups=2), 4, "num_query_groups"),
    (dict(ffn_hidden_size=66), 4, "ffn_hidden_size"),
    (dict(sequence_parallel=True, seq_length=30), 4, "seq_length"),
])
def test_tensor_parallel_divisibility_errors_name_the_field(kw, tp, field):
    cfg = _cfg(**kw)
    with pytest.raises(ValueError, match=field):
        cfg.validate(tp)


@pytest.mark.parametrize("kw,field", [
    (dict(hidden_size=60), "hidden_size"),
    (dict(num_query_groups=3), "num_query_groups"),
    (dict(normalization="BatchNorm"), "normalization"),
    (dict(activation="relu"), "activation"),
    (dict(params_dtype="fp8"), "params_dtype"),
    (dict(recompute_granularity="full"), "recompute_method"),
    (dict(recompute_granularity="full", recompute_method="block"), "recompute_num_layers"),
    (dict(recompute_granularity="selective", recompute_method="uniform"), "recompute_method"),
    (dict(hidden_dropout=1.0), "hidden_dropout"),
])
def test_bad_fields_are_named(kw, field):
    with pytest.raises(ValueError, match=field):
        _cfg(**kw)


def test_defaults_follow_megatron():
    cfg = _cfg()
    assert cfg.ffn_hidden_size == 256 and cfg.num_query_groups == 8
    assert cfg.max_position_embeddings == cfg.seq_length
    assert cfg.make_vocab_size_divisible_by == 128


def test_vocab_is_padded_to_multiple_of_divisor_times_tp():
    cfg = load_config("gpt2-124m")
    assert [cfg.padded_vocab_size(tp) for tp in (1, 2, 4)] == [50304, 50432, 50688]
