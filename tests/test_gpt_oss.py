"""gpt-oss's attention and MLP kinds (issue 39) equal transformers' GptOss layers on the
same weights (fp32): sliding-window and full attention with learned sinks and biases on
q, k, v and the output (Hugging Face's sliding_window W is Megatron's window_size W-1,0:
HF lets a query see W keys, itself included), and the quick-GeGLU gate with gpt-oss's
offset 1 and clamp 7 (Hugging Face interleaves gate and up columns; Megatron stacks them).
The flags build these fields; what cannot run is refused in one line naming the flag.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from gigatron.models.attention_kinds import is_window_layer  # noqa: E402
from gigatron.models.config import TransformerConfig  # noqa: E402
from gigatron.models.transformer import MLP, SelfAttention, rotary_cos_sin  # noqa: E402

SEQ, BATCH, WINDOW = 13, 2, 4
HF = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
          head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
          num_hidden_layers=2, sliding_window=WINDOW, attention_bias=True,
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def gigatron_config(**overrides):
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  kv_channels=8, vocab_size=64, seq_length=SEQ, ffn_hidden_size=16,
                  position_embedding_type="rope", normalization="RMSNorm",
                  hidden_dropout=0.0, attention_dropout=0.0, window_size=(WINDOW - 1, 0),
                  window_attn_skip_freq=2, softmax_type="learnable", activation="quick_geglu",
                  glu_linear_offset=1.0, activation_func_clamp_value=7.0)
    fields.update(overrides)
    return TransformerConfig(**fields)


def load_hf_attention(ours, theirs):
    """Copy transformers' q/k/v/o projections and sinks into gigatron's attention."""
    groups, d = 2, 8
    hpg = 4 // groups
    q_w = theirs.q_proj.weight.view(groups, hpg, d, -1)
    k_w = theirs.k_proj.weight.view(groups, 1, d, -1)
    v_w = theirs.v_proj.weight.view(groups, 1, d, -1)
    q_b, k_b, v_b = (p.bias.view(groups, -1, d) for p in (theirs.q_proj, theirs.k_proj,
                                                          theirs.v_proj))
    with torch.no_grad():
        ours.linear_qkv.weight.copy_(torch.cat([q_w, k_w, v_w], 1).reshape(-1, 32))
        ours.linear_qkv.bias.copy_(torch.cat([q_b, k_b, v_b], 1).reshape(-1))
        ours.linear_proj.weight.copy_(theirs.o_proj.weight)
        ours.linear_proj.bias.copy_(theirs.o_proj.bias)
        ours.core_attention.softmax_offset.copy_(theirs.sinks)


def _rel(got, want):
    """Largest difference over the largest magnitude (fp32 rounding grows with the values)."""
    return ((got - want).abs().max() / want.abs().max()).item()


def hf_mask(window):
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None]
    seen = (j <= i) & ((i - j < window) if window else True)
    return torch.zeros(SEQ, SEQ).masked_fill(~seen, float("-inf"))[None, None]


@pytest.mark.parametrize("layer", [0, 1])
def test_attention_equals_transformers_gpt_oss_attention(layer):
    from transformers.models.gpt_oss import modeling_gpt_oss as hf

    torch.manual_seed(0)
    hf_config = hf.GptOssConfig(**HF)
    hf_config._attn_implementation = "eager"
    theirs = hf.GptOssAttention(hf_config, layer)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    config = gigatron_config()
    ours = SelfAttention(config, None, None, layer_number=layer)
    load_hf_attention(ours, theirs)
    assert is_window_layer(config, layer) == (theirs.sliding_window is not None)
    x = torch.randn(BATCH, SEQ, 32, requires_grad=True)
    rotary = hf.GptOssRotaryEmbedding(hf_config)
    cos, sin = rotary(x, torch.arange(SEQ)[None].expand(BATCH, -1))
    want, _ = theirs(x, (cos, sin), hf_mask(theirs.sliding_window))
    got = ours(x.transpose(0, 1), rotary_cos_sin(SEQ, config, None)).transpose(0, 1)
    assert _rel(got, want) < 1e-5
    grad = torch.randn_like(want)
    g_sinks_theirs, g_x_theirs = torch.autograd.grad(want, (theirs.sinks, x), grad)
    g_sinks, g_x = torch.autograd.grad(got, (ours.core_attention.softmax_offset, x), grad)
    assert _rel(g_sinks, g_sinks_theirs) < 1e-5
    assert _rel(g_x, g_x_theirs) < 1e-5


def test_quick_geglu_mlp_equals_transformers_gpt_oss_expert():
    from transformers.models.gpt_oss import modeling_gpt_oss as hf

    torch.manual_seed(0)
    experts = hf.GptOssExperts(hf.GptOssConfig(**HF))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 2.0)  # large enough that the clamp at 7 bites
    ours = MLP(gigatron_config(), None)
    gate_up, bias = experts.gate_up_proj[0], experts.gate_up_proj_bias[0]  # [h, 2f] interleaved
    with torch.no_grad():
        ours.linear_fc1.weight.copy_(torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], 1).t())
        ours.linear_fc1.bias.copy_(torch.cat([bias[::2], bias[1::2]]))
        ours.linear_fc2.weight.copy_(experts.down_proj[0].t())
        ours.linear_fc2.bias.copy_(experts.down_proj_bias[0])
    x = torch.randn(SEQ, 32)
    gate_up_out = x @ gate_up + bias
    assert (gate_up_out.abs() > 7).any()
    want = experts._apply_gate(gate_up_out) @ experts.down_proj[0] + experts.down_proj_bias[0]
    assert (ours(x[:, None])[:, 0] - want).abs().max() < 1e-4


def test_window_layers_follow_megatron_skip_freq():
    config = gigatron_config(num_layers=6, window_attn_skip_freq=3)
    assert [is_window_layer(config, i) for i in range(6)] == [True, True, False] * 2
    config = gigatron_config(num_layers=3, window_attn_skip_freq=[0, 1, 1])
    assert [is_window_layer(config, i) for i in range(3)] == [False, True, True]
    assert all(is_window_layer(gigatron_config(window_attn_skip_freq=None), i) for i in (0, 1))
    assert not is_window_layer(gigatron_config(window_size=(-1, 0), window_attn_skip_freq=None), 0)


@pytest.mark.parametrize("fields, message", [
    (dict(window_size=(4, 2)), "only causal windows"),
    (dict(activation="gelu"), "add --swiglu or --quick-geglu"),
    (dict(window_attn_skip_freq=[1, 0, 1]), "lists 3 layers for --num-layers 2"),
])
def test_config_refuses_what_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        gigatron_config(**fields)


def _gpt_oss_model():
    from gigatron.models.gpt import GPTModel

    config = gigatron_config(seq_length=32, max_position_embeddings=32, vocab_size=128,
                             activation_func_clamp_value=None)
    model = GPTModel(config, seed=3).eval()
    with torch.no_grad():  # sinks far from 0, so a lost sink shows
        for layer in model.decoder.layers.values():
            layer.self_attention.core_attention.softmax_offset.normal_(0, 2.0)
    return model


def test_kv_cache_steps_with_windows_and_sinks_equal_the_full_forward():
    """Prefill + one-token steps through the cache (windowed layer 0 beyond its window of
    3, full layer 1, sinks) give the full forward's logits (atol 1e-5); greedy generation
    with the cache equals recomputing without it, left-padded rows included."""
    from gigatron.models.generation import generate
    from gigatron.models.kv_cache import KVCache

    model = _gpt_oss_model()
    ids = torch.tensor([[5, 17, 3, 99, 41, 8, 11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.config, 1, ids.shape[1])
        steps = [model(ids[:, :6], kv_cache=cache)]
        steps += [model(ids[:, i:i + 1], kv_cache=cache) for i in range(6, ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    prompts = [[5, 17, 3, 99, 41, 8], [120, 7], [60, 61, 62]]
    cached = generate(model, prompts, 8)
    assert generate(model, prompts, 8, use_cache=False).tokens == cached.tokens
    for prompt, tokens in zip(prompts, cached.tokens):
        assert generate(model, [prompt], 8).tokens[0] == tokens


@pytest.mark.parametrize("name, total, active", [("gpt-oss-20b", 20_914_757_184, 3.61e9),
                                                 ("gpt-oss-120b", 116_829_156_672, 5.13e9)])
def test_zoo_counts_are_the_published_ones(name, total, active):
    """Totals: transformers' GptOssForCausalLM of the published config.json (sinks, router
    and expert biases included), i.e. OpenAI's 20.9B and 116.8B. Active: OpenAI's model
    card counts the routed experts a token uses (4 of 32 or 128) and not the input
    embedding: 3.61B and 5.13B."""
    from gigatron.models.gpt import GPTModel
    from gigatron.models.zoo import load_config

    config = load_config(name)
    model = GPTModel(config, device=torch.device("meta"))
    counts = {n: p.numel() for n, p in model.named_parameters()}
    assert sum(counts.values()) == total
    experts = sum(n for name_, n in counts.items() if ".mlp.experts." in name_)
    unused = experts * (1 - config.moe_router_topk / config.num_moe_experts)
    embedding = counts["embedding.word_embeddings.weight"]
    assert round((total - unused - embedding) / 1e7) == round(active / 1e7)
    assert [is_window_layer(config, i) for i in range(4)] == [True, False, True, False]


def test_flags_build_the_gpt_oss_fields_and_enable_gpt_oss_sets_its_yarn():
    from gigatron.training.config.arguments import parse_args
    from gigatron.training.config.validation import ConfigError

    base = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data --vocab-size 100 "
            "--attention-dropout 0 --position-embedding-type rope").split()
    model = parse_args(base + ("--window-size 3,0 --window-attn-skip-freq ([1,0]*2) "
                               "--softmax-type learnable --quick-geglu --glu-linear-offset 1 "
                               "--activation-func-clamp-value 7 --enable-gpt-oss "
                               "--rope-type rope").split(),  # as examples/gptoss/02_train.sh
                       1).model
    assert (model.window_size, model.window_attn_skip_freq, model.softmax_type) == \
        ((3, 0), [1, 0, 1, 0], "learnable")
    assert (model.activation, model.glu_linear_offset, model.activation_func_clamp_value) == \
        ("quick_geglu", 1.0, 7.0)
    assert (model.rope_type, model.rotary_scaling_factor, model.original_max_position_embeddings,
            model.beta_fast, model.beta_slow, model.yarn_correction_range_round_to_int) == \
        ("yarn", 32.0, 4096, 32.0, 1.0, False)
    for flags, message in (("--window-size 3", "give two integers L,0"),
                           ("--quick-geglu --swiglu", "are exclusive"),
                           ("--window-attn-skip-freq 2", "needs --window-size")):
        with pytest.raises(ConfigError, match=message):
            parse_args(base + flags.split(), 1)


def test_attention_dropout_on_window_and_sink_layers_is_seeded_and_drops():
    """Megatron's default --attention-dropout 0.1 on gpt-oss layers (the band attention's
    dropout, parallel/context/band.py; its exactness is tests/test_band_attention.py's):
    the masks follow the torch seed, training output differs from eval, backward runs."""
    config = gigatron_config(attention_dropout=0.3)
    torch.manual_seed(0)
    attention = SelfAttention(config, None, None, layer_number=0)
    with torch.no_grad():
        for p in attention.parameters():  # built empty: gigatron initialises in GPTModel
            p.normal_(0, 0.3)
    x = torch.randn(SEQ, BATCH, 32, requires_grad=True)
    rotary = rotary_cos_sin(SEQ, config, None)
    outs = []
    for _ in range(2):
        torch.manual_seed(5)
        outs.append(attention(x, rotary))
    assert torch.equal(outs[0], outs[1])
    attention.eval()
    assert (attention(x, rotary) - outs[0]).abs().max() > 1e-2
    outs[0].sum().backward()
    assert attention.core_attention.softmax_offset.grad is not None


def test_plan_and_mfu_count_the_gated_mlp_and_the_windows():
    """MFU's FLOPs count quick GeGLU's fc1 twice as wide, as SwiGLU's; the planner's
    attention core counts a windowed layer's band (about 2 x 128 keys a query at window
    127), not the whole sequence: gpt-oss-20b at 8192 tokens does (8192 + 256) / 2 / 8192
    of the full model's core work."""
    from gigatron.models.zoo import load_config
    from gigatron.training.observe.flops import flops_per_token
    from gigatron.training.plan.cost import _layer_flops

    oss = load_config("gpt-oss-20b", seq_length=8192, num_layers=4)
    swiglu = load_config("gpt-oss-20b", seq_length=8192, num_layers=4, activation="swiglu",
                         glu_linear_offset=0.0, activation_func_clamp_value=None)
    assert flops_per_token(oss) == flops_per_token(swiglu)
    full = load_config("gpt-oss-20b", seq_length=8192, num_layers=4, window_size=None,
                       window_attn_skip_freq=None)
    ratio = _layer_flops(oss, 8192, 1)["core"] / _layer_flops(full, 8192, 1)["core"]
    assert ratio == pytest.approx((8192 + 256) / 2 / 8192)
    assert _layer_flops(oss, 8192, 1)["dense"] == _layer_flops(swiglu, 8192, 1)["dense"]
