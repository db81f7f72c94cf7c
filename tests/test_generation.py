"""gigatron.generate: the KV cache gives the tokens (and logits) of cache-free recomputation,
left-padded batches give each prompt's tokens alone, sampling is seeded and filtered as
documented, stop tokens end a prompt, and tp=2 on two CPU ranks generates tp=1's tokens."""
import pytest
import torch

import gigatron
from gigatron.models.config import TransformerConfig
from gigatron.models.generation import (SamplingParams, filter_logits, generate, left_pad,
                                        next_tokens)
from gigatron.models.gpt import GPTModel
from gigatron.models.kv_cache import KVCache
from gigatron.models.zoo import load_config

STYLES = ["debug-gpt2", "debug-llama"]  # learned positions + MHA, RoPE + GQA
PROMPTS = [[5, 17, 3, 99, 41, 8], [120, 7], [60, 61, 62]]
NEW = 10


def _model(style, seed=7, **overrides):
    config = load_config(style, hidden_dropout=0.0, attention_dropout=0.0,
                         max_position_embeddings=32, **overrides)
    return GPTModel(config, seed=seed).eval()


def _greedy_by_full_forward(model, prompt, steps):
    """The training forward (no cache, no mask) over the whole sequence at every step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def test_generate_is_exposed_lazily_on_the_package():
    assert gigatron.generate is generate


@pytest.mark.parametrize("style", STYLES)
def test_greedy_with_kv_cache_equals_full_recomputation_of_each_prompt(style):
    model = _model(style)
    batched = generate(model, PROMPTS, NEW)
    assert [len(t) for t in batched.tokens] == [NEW] * len(PROMPTS)
    for prompt, tokens in zip(PROMPTS, batched.tokens):
        assert tokens == _greedy_by_full_forward(model, prompt, NEW)
    assert generate(model, PROMPTS, NEW, use_cache=False).tokens == batched.tokens


@pytest.mark.parametrize("style", STYLES)
def test_kv_cache_step_logits_equal_the_full_forward(style):
    """Prefill + one-token steps through the cache give the full forward's logits at each
    position (atol 1e-5: attention sums in another order)."""
    model = _model(style)
    ids = torch.tensor([PROMPTS[0] + [11, 12, 13, 14]])
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.config, 1, ids.shape[1])
        steps = [model(ids[:, :6], kv_cache=cache)]
        steps += [model(ids[:, i:i + 1], kv_cache=cache) for i in range(6, ids.shape[1])]
    assert cache.length == ids.shape[1]
    v = model.config.vocab_size
    torch.testing.assert_close(torch.cat(steps, dim=1)[..., :v], full[..., :v],
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("style", STYLES)
def test_left_padded_rows_give_the_logits_of_each_prompt_alone(style):
    """Padding is masked out of attention and positions count real tokens (atol 1e-5)."""
    model = _model(style)
    tokens, mask = left_pad(PROMPTS, pad_token=0)
    assert mask.tolist()[1] == [0, 0, 0, 0, 1, 1]
    with torch.no_grad():
        padded = model(tokens, attention_mask=mask)
        for row, prompt in enumerate(PROMPTS):
            alone = model(torch.tensor([prompt]))[0]
            real = padded[row, tokens.shape[1] - len(prompt):]
            v = model.config.vocab_size
            torch.testing.assert_close(real[:, :v], alone[:, :v], rtol=0, atol=1e-5)
    # the test can fail: without the mask the padded row's logits differ
    with torch.no_grad():
        unmasked = model(tokens)[1, -1, :model.config.vocab_size]
    assert not torch.allclose(unmasked, padded[1, -1, :model.config.vocab_size], atol=1e-3)


@pytest.mark.parametrize("style", STYLES)
def test_sampling_is_seeded_and_the_cache_does_not_change_it(style):
    model = _model(style)
    kw = dict(temperature=0.9, top_k=20, top_p=0.95, seed=3)
    first = generate(model, PROMPTS, NEW, **kw)
    assert generate(model, PROMPTS, NEW, **kw).tokens == first.tokens
    assert generate(model, PROMPTS, NEW, use_cache=False, **kw).tokens == first.tokens
    assert generate(model, PROMPTS, NEW, **{**kw, "seed": 4}).tokens != first.tokens
    assert first.tokens != generate(model, PROMPTS, NEW).tokens  # it does sample


def test_top_k_1_samples_the_argmax():
    model = _model("debug-llama")
    assert generate(model, PROMPTS, NEW, temperature=2.0, top_k=1, seed=5).tokens == \
        generate(model, PROMPTS, NEW).tokens


def test_filter_logits_keeps_top_k_then_the_top_p_nucleus():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    kept = lambda out: torch.isfinite(out)[0].nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.4)) == [1]  # 0.4 reaches 0.4
    assert kept(filter_logits(logits, top_p=0.5)) == [1, 3]  # 0.4 < 0.5 <= 0.7
    assert kept(filter_logits(logits, top_p=0.71)) == [1, 3, 4]
    assert kept(filter_logits(logits, top_k=2, top_p=0.99)) == [1, 3]
    assert kept(filter_logits(logits, top_p=1e-6)) == [1]  # the argmax always stays
    assert kept(filter_logits(logits)) == [0, 1, 2, 3, 4]


def test_sampled_frequencies_follow_the_filtered_softmax():
    """20000 draws from 3 kept tokens: each frequency within 0.02 of its renormalised
    probability (the standard error is about 0.0035)."""
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = probs.log().expand(20000, 5)
    g = torch.Generator().manual_seed(0)
    drawn = next_tokens(logits, SamplingParams(temperature=1.0, top_p=0.8), g)
    freq = torch.bincount(drawn, minlength=5).float() / len(drawn)
    expected = torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15]) / 0.85
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.02)


def _first_new_token(tokens):
    """(i, token): the first token after the first that was not drawn before it."""
    i = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    return i, tokens[i]


def test_stop_tokens_end_each_prompt_and_the_batch():
    model = _model("debug-llama")
    free = generate(model, PROMPTS, NEW).tokens
    at, stop = _first_new_token(free[0])
    result = generate(model, PROMPTS, NEW, stop_tokens=[stop])
    assert result.tokens[0] == free[0][:at + 1] and result.stopped[0]
    for row in (1, 2):  # the others go on, unless they draw it too
        cut = free[row].index(stop) + 1 if stop in free[row] else NEW
        assert result.tokens[row] == free[row][:cut]
    everyone = generate(model, [PROMPTS[0]], NEW, stop_tokens=[free[0][0]])
    assert everyone.tokens == [free[0][:1]] and everyone.stopped == [True]


def test_on_step_streams_each_new_token_and_none_after_a_stop():
    model = _model("debug-llama")
    free = generate(model, PROMPTS[:2], NEW).tokens
    at, stop = _first_new_token(free[0])
    seen = []
    result = generate(model, PROMPTS[:2], NEW, stop_tokens=[stop], on_step=seen.append)
    assert [s[0] for s in seen][:at + 1] == free[0][:at + 1]
    assert all(s[0] is None for s in seen[at + 1:])
    assert [s[1] for s in seen if s[1] is not None] == result.tokens[1]


def test_bad_arguments_are_one_clear_error_each():
    model = _model("debug-gpt2")
    with pytest.raises(ValueError, match="top_k / top_p filter a sampled token"):
        generate(model, PROMPTS, 2, top_k=5)
    with pytest.raises(ValueError, match="top_p must be in"):
        generate(model, PROMPTS, 2, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        generate(model, PROMPTS, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[1], []], 2)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, PROMPTS, 40)
    stage = GPTModel(model.config, post_process=False)
    with pytest.raises(ValueError, match="pipeline size 1"):
        generate(stage, PROMPTS, 2)


def test_generate_leaves_the_training_mode_as_it_was():
    model = _model("debug-gpt2").train()
    generate(model, PROMPTS, 2)
    assert model.training


def _tp_generate(rank, world, style, kw):
    import torch.distributed as dist

    config = load_config(style, hidden_dropout=0.0, attention_dropout=0.0,
                         max_position_embeddings=32)
    model = GPTModel(config, tp_group=dist.group.WORLD, seed=7)
    return generate(model, PROMPTS, NEW, **kw).tokens


@pytest.mark.parametrize("style", STYLES)
def test_tp2_generates_the_tokens_of_tp1(style):
    """Same seed, same full model (parallelism-invariant init): greedy and sampled tokens
    equal on both ranks and equal to one device's."""
    from multirank import run_on_ranks

    for kw in ({}, dict(temperature=0.8, top_p=0.9, seed=11)):
        expected = generate(_model(style), PROMPTS, NEW, **kw).tokens
        assert run_on_ranks(_tp_generate, 2, style, kw) == [expected, expected]


def test_kv_cache_refuses_more_tokens_than_it_holds():
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               vocab_size=16, seq_length=8)
    cache = KVCache(config, 1, 4)
    cache.commit(cache.begin(3))
    with pytest.raises(ValueError, match="do not fit"):
        cache.begin(2)
