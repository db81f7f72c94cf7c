"""Tensor parallelism (± sequence parallelism) reproduces the single-device model.

Tolerances (fp32, dropout 0): logits, losses and every parameter's gathered grad match
the single-device model with rtol=1e-5 and a tiny absolute floor atol=1e-7 (for entries
near zero, where summation order alone moves the last bits). Padded vocab rows, which the
single-device model may not have, must hold exactly zero grad.
"""
import torch
import torch.distributed as dist
from multirank import run_on_ranks

from gigatron.models.gpt import GPTModel
from gigatron.models.zoo import load_config
from gigatron.parallel.tensor import allreduce_sequence_parallel_grads, gather_full_parameter

RTOL, ATOL = 1e-5, 1e-7
STYLES = ("debug-gpt2", "debug-llama")


def _batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    return ids, labels


def _run(model, ids, labels):
    logits = model(ids)
    loss = model(ids, labels=labels)
    loss.mean().backward()
    return logits.detach(), loss.detach()


def _gather_logits(logits, group):
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _check_close(what, got, ref):
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _check_parallel_attributes(model, sp, case):
    """The tags the ZeRO wrapper, grad-norm and grad-sync code rely on."""
    expect = {"linear_qkv.weight": (True, 0), "linear_fc1.weight": (True, 0),
              "linear_proj.weight": (True, 1), "linear_fc2.weight": (True, 1),
              "word_embeddings.weight": (True, 0), "output_layer.weight": (True, 0),
              "layernorm.weight": (False, None), "linear_proj.bias": (False, None)}
    seen = set()
    for name, p in model.named_parameters():
        for suffix, (sharded, dim) in expect.items():
            if name.endswith(suffix):
                seen.add(suffix)
                assert p.tensor_model_parallel == sharded, f"{case} {name}"
                assert getattr(p, "partition_dim", None) == dim, f"{case} {name}"
                assert p.sequence_parallel == (sp and not sharded), f"{case} {name}"
        assert not p.shared_embedding, f"{case} {name}"
    assert seen >= set(expect) - {"output_layer.weight", "linear_proj.bias"}, seen


def _compare_with_single_device(rank, world_size, attention_backend="sdpa"):
    group = dist.new_group(list(range(world_size)))
    checked = []
    for style in STYLES:
        for sp in (False, True):
            kw = dict(hidden_dropout=0.0, attention_dropout=0.0,
                      attention_backend=attention_backend)
            ref = GPTModel(load_config(style, **kw))
            tp = GPTModel(load_config(style, sequence_parallel=sp, **kw), tp_group=group)
            ids, labels = _batch(ref.config)
            ref_logits, ref_loss = _run(ref, ids, labels)
            logits, loss = _run(tp, ids, labels)
            allreduce_sequence_parallel_grads(tp.parameters(), group)
            case = f"{style} tp={world_size} sp={sp}"
            vocab = ref.config.vocab_size
            full_logits = _gather_logits(logits, group)
            _check_close(f"{case} logits", full_logits[..., :vocab], ref_logits[..., :vocab])
            _check_close(f"{case} loss", loss, ref_loss)
            ref_params = dict(ref.named_parameters())
            for name, p in tp.named_parameters():
                full_w = gather_full_parameter(p, group)
                full_g = gather_full_parameter(p, group, p.grad)
                ref_p = ref_params[name]
                rows = min(full_w.shape[0], ref_p.shape[0])
                _check_close(f"{case} weight {name}", full_w[:rows], ref_p.detach()[:rows])
                _check_close(f"{case} grad {name}", full_g[:rows], ref_p.grad[:rows])
                assert not full_g[rows:].any(), f"{case} {name}: padded rows got grad"
                assert not ref_p.grad[rows:].any(), f"{case} {name}: padded rows got grad"
            _check_parallel_attributes(tp, sp, case)
            checked.append(case)
    return checked


def test_tp2_with_and_without_sequence_parallel_matches_single_device():
    results = run_on_ranks(_compare_with_single_device, 2)
    assert len(results[0]) == 4


def test_tp4_with_and_without_sequence_parallel_matches_single_device_unfused():
    results = run_on_ranks(_compare_with_single_device, 4, attention_backend="unfused")
    assert len(results[0]) == 4
