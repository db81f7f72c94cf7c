"""GPTModel: pipeline stages rebuild the same model, name-seeded init, output contract,
meta-device construction, tensor-parallel RNG tracker. Tolerances stated per test."""
import pytest
import torch

from gigatron.models.gpt import GPTModel
from gigatron.models.zoo import load_config
from gigatron.parallel.tensor import TensorParallelRNGTracker, model_parallel_seed

NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)


def _ids(cfg, b=2):
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=g)


@pytest.mark.parametrize("style", ["debug-gpt2", "debug-llama"])
def test_two_pipeline_stages_equal_the_whole_model(style):
    """Stage 0 (embedding + layer 0) -> stage 1 (layer 1 + head): same weights, loss, grads.

    Exact for weights; loss and grads within rtol 1e-6 / atol 1e-8 (the tied embedding's
    grad is the sum of two stage-local parts, so summation order differs)."""
    cfg = load_config(style, **NO_DROPOUT)
    full = GPTModel(cfg)
    first = GPTModel(cfg, post_process=False, layer_range=[0])
    last = GPTModel(cfg, pre_process=False, layer_range=[1])
    ref = dict(full.named_parameters())
    names = [n for n, _ in first.named_parameters()] + [n for n, _ in last.named_parameters()]
    tied = not cfg.untie_embeddings_and_output_weights
    assert set(names) == set(ref) | ({"output_layer.weight"} if tied else set())
    for n, p in list(first.named_parameters()) + list(last.named_parameters()):
        source = "embedding.word_embeddings.weight" if n not in ref else n
        assert torch.equal(p, ref[source]), n

    ids = _ids(cfg)
    labels = ids.roll(-1, dims=1)
    full_loss = full(ids, labels=labels)
    full_loss.sum().backward()
    hidden = first(ids)
    assert hidden.shape == (cfg.seq_length, 2, cfg.hidden_size)
    received = hidden.detach().requires_grad_(True)
    loss = last(hidden_states=received, labels=labels)
    loss.sum().backward()
    hidden.backward(received.grad)
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=1e-8)

    grads = {n: p.grad for n, p in list(first.named_parameters()) + list(last.named_parameters())}
    if tied:  # what the embedding-group all-reduce will do
        summed = grads["embedding.word_embeddings.weight"] + grads.pop("output_layer.weight")
        grads["embedding.word_embeddings.weight"] = summed
    for n, g in grads.items():
        torch.testing.assert_close(g, ref[n].grad, rtol=1e-6, atol=1e-8, msg=n)
    assert first.embedding.word_embeddings.weight.shared_embedding == tied
    assert last.output_layer.weight.shared_embedding == tied
    assert not full.embedding.word_embeddings.weight.shared_embedding


def test_initialisation_follows_megatron_and_depends_on_seed():
    cfg = load_config("debug-gpt2", hidden_size=256, num_attention_heads=4, num_layers=8,
                      make_vocab_size_divisible_by=128)
    model = GPTModel(cfg, device="cpu")
    p = dict(model.named_parameters())
    qkv = p["decoder.layers.3.self_attention.linear_qkv.weight"]
    proj = p["decoder.layers.3.self_attention.linear_proj.weight"]
    assert abs(qkv.std().item() - 0.02) < 0.002
    assert abs(proj.std().item() - 0.02 / 4.0) < 0.0005  # 0.02 / sqrt(2 * 8 layers)
    assert torch.equal(p["decoder.layers.3.input_layernorm.weight"], torch.ones(256))
    assert not p["decoder.layers.3.mlp.linear_fc1.bias"].any()
    emb = p["embedding.word_embeddings.weight"]
    assert emb.shape[0] == cfg.padded_vocab_size() > cfg.vocab_size
    assert not emb[cfg.vocab_size:].any() and emb[:cfg.vocab_size].abs().min() > 0
    other = GPTModel(cfg, seed=99)
    assert not torch.equal(other.embedding.word_embeddings.weight, emb)
    assert torch.equal(GPTModel(cfg).embedding.word_embeddings.weight, emb)
    assert not torch.equal(qkv, p["decoder.layers.4.self_attention.linear_qkv.weight"])


def test_layer_range_uses_global_layer_numbers_in_names():
    cfg = load_config("debug-llama", num_layers=4)
    stage = GPTModel(cfg, pre_process=False, post_process=False, layer_range=[2, 3])
    names = [n for n, _ in stage.named_parameters()]
    assert names and all(n.startswith(("decoder.layers.2.", "decoder.layers.3.")) for n in names)
    full = dict(GPTModel(cfg).named_parameters())
    assert all(torch.equal(p, full[n]) for n, p in stage.named_parameters())
    with pytest.raises(ValueError, match="layer_range"):
        GPTModel(cfg, layer_range=[4])


def test_outputs_follow_the_contract():
    cfg = load_config("debug-llama", **NO_DROPOUT)
    model = GPTModel(cfg)
    ids = _ids(cfg)
    logits = model(ids)
    assert logits.shape == (2, cfg.seq_length, cfg.padded_vocab_size())
    loss = model(ids, labels=ids)
    assert loss.shape == (2, cfg.seq_length) and loss.dtype == torch.float32
    v = cfg.vocab_size
    ref = torch.nn.functional.cross_entropy(logits[..., :v].reshape(-1, v), ids.reshape(-1),
                                            reduction="none")
    torch.testing.assert_close(loss.reshape(-1), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="input_ids"):
        model()


def test_attention_backends_agree():
    """sdpa and unfused (softmax via gigatron.ops) within rtol 1e-5 / atol 1e-6."""
    ids = _ids(load_config("debug-llama"))
    out = [GPTModel(load_config("debug-llama", attention_backend=b, **NO_DROPOUT))(ids)
           for b in ("sdpa", "unfused")]
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-6)


def test_bf16_params_give_fp32_loss_close_to_fp32_model():
    ids = _ids(load_config("debug-gpt2"))
    losses = [GPTModel(load_config("debug-gpt2", params_dtype=d, **NO_DROPOUT))(ids, labels=ids)
              for d in ("fp32", "bf16")]
    assert losses[1].dtype == torch.float32
    torch.testing.assert_close(losses[1], losses[0], rtol=0.05, atol=0.05)


def test_meta_device_allocates_nothing():
    model = GPTModel(load_config("llama2-7b"), device="meta")
    assert all(p.is_meta for p in model.parameters())


def test_rng_tracker_streams_are_reproducible_per_rank_and_leave_default_rng_alone():
    def draw(rank):
        tracker = TensorParallelRNGTracker()
        tracker.add("model-parallel-rng", model_parallel_seed(1234, rank))
        with tracker.fork(torch.device("cpu")):
            a = torch.rand(4)
        with tracker.fork(torch.device("cpu")):
            b = torch.rand(4)
        return a, b

    torch.manual_seed(0)
    before = torch.get_rng_state()
    r0, r0_again, r1 = draw(0), draw(0), draw(1)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(r0[0], r0_again[0]) and torch.equal(r0[1], r0_again[1])
    assert not torch.equal(r0[0], r0[1])  # the stream advances between forks
    assert not torch.equal(r0[0], r1[0])  # tp ranks draw different masks
    tracker = TensorParallelRNGTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed"):
        tracker.add("b", 1)


def test_padded_vocabulary_logits_are_minus_infinity_and_real_ones_finite():
    cfg = load_config("debug-llama", vocab_size=197, **NO_DROPOUT)
    assert cfg.padded_vocab_size() > cfg.vocab_size
    logits = GPTModel(cfg)(_ids(cfg))
    assert torch.isneginf(logits[..., cfg.vocab_size:]).all()
    assert torch.isfinite(logits[..., :cfg.vocab_size]).all()


@pytest.mark.parametrize("style", ["debug-gpt2", "debug-llama"])  # LayerNorm, RMSNorm
def test_apply_layernorm_1p_equals_the_plain_model_whose_norm_weights_are_1_plus_w(style):
    """Zero-centred norms start at 0 and scale by 1 + w: exactly the plain model (weights
    1 + w) for every norm, the final one included (rtol 0, atol 0: the same fp32 sum)."""
    one_p = GPTModel(load_config(style, layernorm_zero_centered_gamma=True, **NO_DROPOUT))
    plain = GPTModel(load_config(style, **NO_DROPOUT))
    norms = [n for n, _ in one_p.named_parameters() if "layernorm.weight" in n]
    assert "decoder.final_layernorm.weight" in norms and len(norms) == 2 * 2 + 1
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in one_p.named_parameters():
            if name in norms:
                assert not p.any(), f"{name} must start at 0"
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        plain.load_state_dict(one_p.state_dict())
        for name, p in plain.named_parameters():
            if name in norms:
                p.add_(1.0)
    ids = _ids(one_p.config)
    torch.testing.assert_close(one_p(ids), plain(ids), rtol=0, atol=0)
    assert not torch.equal(one_p(ids), GPTModel(one_p.config)(ids))  # the weights matter


def test_apply_layernorm_1p_flag_sets_zero_centred_norms():
    from gigatron.training.config.arguments import parse_args

    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --train-iters 4 --lr 1e-3 --mock-data --vocab-size 100")
    assert parse_args((base + " --apply-layernorm-1p").split(), 1).model \
        .layernorm_zero_centered_gamma
    assert not parse_args(base.split(), 1).model.layernorm_zero_centered_gamma


@pytest.mark.parametrize("style", ["debug-gpt2", "debug-llama"])  # learned, RoPE positions
def test_position_ids_are_honoured(style):
    """position_ids 0..s-1 are the default exactly; other positions change the output."""
    cfg = load_config(style, **NO_DROPOUT)
    model = GPTModel(cfg)
    ids = _ids(cfg)
    arange = torch.arange(cfg.seq_length).expand_as(ids)
    torch.testing.assert_close(model(ids, position_ids=arange), model(ids), rtol=0, atol=0)
    gapped = arange + (arange >= cfg.seq_length // 2) * 3  # a jump mid-sequence
    out = model(ids, position_ids=gapped)
    assert not torch.allclose(out[:, cfg.seq_length // 2:], model(ids)[:, cfg.seq_length // 2:])


def test_last_logits_only_is_the_last_position_of_the_full_logits():
    """Within atol 1e-6: a one-row matmul may sum in another order than the full one."""
    cfg = load_config("debug-llama", **NO_DROPOUT)
    model = GPTModel(cfg)
    ids = _ids(cfg)
    last = model(ids, last_logits_only=True)
    assert last.shape == (2, 1, cfg.padded_vocab_size())
    torch.testing.assert_close(last, model(ids)[:, -1:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("style", ["debug-gpt2", "debug-llama"])
def test_backward_has_no_slice_or_select_of_activations(style):
    """q, k and v come out of the fused projection by one split (its backward is one cat) and
    a whole-width RoPE slices nothing: a slice's or a select's backward zero-fills an input-sized
    grad and adds it in, which cost ~15 ms of a GPT 1.3B step on an H200."""
    cfg = load_config(style)
    model = GPTModel(cfg)
    ids = torch.arange(2 * cfg.seq_length).view(2, -1) % cfg.vocab_size
    seen, todo, kinds = set(), [model(ids, labels=ids).mean().grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        kinds.add(type(fn).__name__)
        todo += [child for child, _ in fn.next_functions]
    assert "SplitWithSizesBackward0" in kinds
    assert not kinds & {"SliceBackward0", "SelectBackward0"}, sorted(kinds)
