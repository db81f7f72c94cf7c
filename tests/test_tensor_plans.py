"""`parallelize(model, plan, groups)` splits a whole model by a plan and computes what the
whole model computes: a user's own transformer, Hugging Face GPT-2 / Llama (and the Llama
look-alikes Mistral, Qwen2) built from tiny configs (no downloads), and gigatron's GPTModel
built on one rank. Plus the plan errors, and tp=2 x dp=2 training with ZeRO.

Tolerances (fp32, dropout 0): logits, loss and every weight's gathered grad within
rtol=1e-5, with an absolute floor of 1e-5 x the tensor's largest magnitude for entries near
zero (a tp all-reduce sums partial products in another order, which moves the last bits of
a sum, not of each entry). Training: every full parameter within 1e-5 relative (L2 of the difference over L2 of
the reference), as tests/test_zero_gpt.py (Adam turns last-bit noise of near-zero grads
into ~1e-6 absolute moves of single elements).
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multirank import run_on_ranks
from torch import nn
from user_transformer import SEQ, VOCAB, UserTransformer, user_plan

from gigatron.models.tensor_plans import gigatron_gpt_plan, gpt2_plan, llama_plan, plan_for
from gigatron.parallel.tensor import (ColumnParallel, TensorParallelPlan,
                                      allreduce_sequence_parallel_grads, gather_full_parameter,
                                      parallelize, vocab_parallel_cross_entropy)
from gigatron.parallel.tensor.init import shard, unshard
from gigatron.parallel.tensor.styles import is_conv1d

RTOL, TRAIN_RTOL = 1e-5, 1e-5


def _close(what, got, ref):
    atol = RTOL * float(ref.abs().max()) if ref.numel() else 0.0
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def _ids(batch=4, seq=SEQ, vocab=VOCAB, seed=1):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _check_grads(case, model, ref, group):
    """Every parameter's full (gathered) weight and grad equal the whole model's; Hugging
    Face Conv1D weights are stored [in, out] there, [out, in] once split."""
    ref_modules = dict(ref.named_modules())
    ref_params = dict(ref.named_parameters())
    assert set(ref_params) == {n for n, _ in model.named_parameters()}, case
    for name, p in model.named_parameters():
        full_w = gather_full_parameter(p, group)
        full_g = gather_full_parameter(p, group, p.grad)
        ref_p = ref_params[name]
        owner = ref_modules[name.rpartition(".")[0]]
        if is_conv1d(owner) and name.endswith(".weight"):
            full_w, full_g = full_w.t(), full_g.t()
        _close(f"{case} weight {name}", full_w, ref_p.detach())
        _close(f"{case} grad {name}", full_g, ref_p.grad)


def _gather_last(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


# ---- pure ---------------------------------------------------------------------------------

def test_shard_of_unequal_fused_blocks_splits_each_block_and_unshards_back():
    full = torch.arange(8 * 3).view(8, 3)  # blocks of 4, 2, 2 rows (q, k, v with GQA)
    parts = [shard(full, 0, r, 2, (4, 2, 2)) for r in range(2)]
    assert parts[0][:, 0].tolist() == [0, 3, 12, 18] and parts[1][:, 0].tolist() == [6, 9, 15, 21]
    assert torch.equal(unshard(parts, 0, (4, 2, 2)), full)


# ---- the user's own transformer -------------------------------------------------------------

def _user_model_tp(rank, world, sequence_parallel):
    group = dist.new_group(list(range(world)))
    ref = UserTransformer()
    model = parallelize(copy.deepcopy(ref), user_plan(sequence_parallel), group)
    assert model.head.weight is model.tok.weight, "tied embeddings stay tied"
    ids, labels = _ids(), _ids(seed=2)
    out, ref_out = model(ids), ref(ids)
    _close("logits", out, ref_out)
    for m, o in ((model, out), (ref, ref_out)):
        F.cross_entropy(o.flatten(0, 1), labels.flatten()).backward()
    allreduce_sequence_parallel_grads(model.parameters(), group)
    _check_grads(f"user sp={sequence_parallel}", model, ref, group)
    return True


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_user_transformer_tp2_logits_and_grads_match_the_whole_model(sequence_parallel):
    assert run_on_ranks(_user_model_tp, 2, sequence_parallel) == [True, True]


# ---- Hugging Face ---------------------------------------------------------------------------

def _hf_models():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128,
                                   n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    llama = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                 max_position_embeddings=32)
    return {"gpt2": (transformers.GPT2LMHeadModel, gpt2),
            "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**llama)),
            "llama-tied": (transformers.LlamaForCausalLM,
                           transformers.LlamaConfig(tie_word_embeddings=True, **llama)),
            "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig(**llama)),
            "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**llama))}


def _hf_case(models, kind, loss_parallel, sequence_parallel, group):
    cls, config = models[kind]
    torch.manual_seed(0)
    ref = cls(config)
    options = dict(loss_parallel=loss_parallel)
    if sequence_parallel:
        options["sequence_parallel"] = True
    model = parallelize(copy.deepcopy(ref), plan_for(ref, **options), group)
    ids = _ids(vocab=128)
    ref_out = ref(ids, labels=ids)
    if loss_parallel:  # vocab-split logits, the loss computed on them without a gather
        logits = model(ids).logits
        _close("logits", _gather_last(logits, group), ref_out.logits)
        loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], group).mean()
    else:  # whole logits: the model's own forward and loss
        out = model(ids, labels=ids)
        _close("logits", out.logits, ref_out.logits)
        loss = out.loss
    _close("loss", loss, ref_out.loss)
    loss.backward()
    ref_out.loss.backward()
    allreduce_sequence_parallel_grads(model.parameters(), group)
    _check_grads(f"{kind} loss_parallel={loss_parallel} sp={sequence_parallel}", model, ref,
                 group)


def _hf_tp(rank, world, cases):
    group = dist.new_group(list(range(world)))
    models = _hf_models()
    for case in cases:
        _hf_case(models, *case, group)
    return len(cases)


def test_hf_gpt2_tp2_matches_whole_model_with_fused_qkv_tied_head_and_sequence_parallel():
    _hf_models()  # skips without transformers (imported before forking)
    cases = [("gpt2", False, False), ("gpt2", True, False), ("gpt2", False, True)]
    assert run_on_ranks(_hf_tp, 2, cases) == [3, 3]


def test_hf_llama_tp2_gqa_matches_whole_model_tied_or_not_and_look_alikes():
    _hf_models()
    cases = [("llama", False, False), ("llama", True, False), ("llama-tied", False, False),
             ("mistral", False, False), ("qwen2", True, False)]
    assert run_on_ranks(_hf_tp, 2, cases) == [5, 5]


# ---- gigatron's own GPTModel, built on one rank and split afterwards --------------------------

def _zoo_tp(rank, world):
    from gigatron.models.gpt import GPTModel
    from gigatron.models.zoo import load_config
    group = dist.new_group(list(range(world)))
    for style in ("debug-gpt2", "debug-llama"):
        ref = GPTModel(load_config(style, hidden_dropout=0.0, attention_dropout=0.0))
        model = parallelize(copy.deepcopy(ref), gigatron_gpt_plan(ref), group)
        ids, labels = _ids(2, ref.config.seq_length, ref.config.vocab_size), \
            _ids(2, ref.config.seq_length, ref.config.vocab_size, seed=3)
        _close(f"{style} logits", _gather_last(model(ids), group), ref(ids))
        loss, ref_loss = model(ids, labels=labels), ref(ids, labels=labels)
        _close(f"{style} loss", loss, ref_loss)
        loss.mean().backward()
        ref_loss.mean().backward()
        _check_grads(style, model, ref, group)
    return True


def test_gigatron_gpt_built_on_one_rank_then_split_tp2_matches_it():
    assert run_on_ranks(_zoo_tp, 2) == [True, True]


# ---- errors ---------------------------------------------------------------------------------

def _error(model, plan, group=None):
    with pytest.raises(ValueError) as err:
        parallelize(model, plan, group)
    return str(err.value)


def test_plan_errors_name_the_pattern_and_leave_the_model_unchanged():
    model = UserTransformer()
    plan = dict(user_plan().layers)
    assert "unknown style 'colum'" in _error(model, {**plan, "head": "colum"})
    assert "plan pattern 'blocks.*.atn.qkv' matches no module of UserTransformer" in \
        _error(model, {**plan, "blocks.*.atn.qkv": "column"})
    message = _error(model, {**plan, "blocks.*.mlp.*": "column"})
    assert "conflicting patterns: 'blocks.*.mlp.down' (row) and 'blocks.*.mlp.*' (column) " \
        "both match 'blocks.0.mlp.down' (and 1 more)" in message
    no_out = {k: v for k, v in plan.items() if k != "blocks.*.attn.out"}
    message = _error(model, no_out)
    assert message.startswith("unmatched Linear layers under a pattern: "
                              "['blocks.0.attn.out', 'blocks.1.attn.out']"), message
    assert len(message.splitlines()) == 1, "one line per pattern that opened the scope"
    assert "blocks.0.norm1: style 'column' needs a Linear, but the module is a LayerNorm" in \
        _error(model, {**plan, "blocks.*.norm1": "column"})
    assert "needs a plan with sequence_parallel=True" in \
        _error(model, {**plan, "norm": "sequence_parallel_norm"})
    no_head = {k: v for k, v in plan.items() if k != "head"}
    assert "head.weight is shared (tied) with 'tok', which the plan splits" in \
        _error(model, no_head)
    assert isinstance(model.blocks[0].attn.qkv, nn.Linear) and \
        isinstance(model.tok, nn.Embedding), "nothing changes before every check passes"


def _divisibility_errors(rank, world):
    from gigatron.parallel.tensor import LocalAttributes
    group = dist.new_group(list(range(world)))

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_heads = 3
            self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(5, 4), nn.Linear(4, 6)
            self.emb = nn.Embedding(7, 4)

    plan = {"": LocalAttributes(divide=("n_heads",)), "a": "column", "b": "row",
            "c": ColumnParallel(fused=(3, 3)), "emb": "vocab_embedding"}
    lines = _error(Odd(), plan, group).splitlines()
    whole = parallelize(UserTransformer(), user_plan(), group)
    return lines, _error(whole, user_plan(), group)


def test_shapes_not_divisible_by_tp_are_errors_naming_module_dim_and_tp():
    lines, again = run_on_ranks(_divisibility_errors, 2)[0]
    assert lines == [
        "Odd: attribute n_heads 3 is not divisible by tp=2",
        "a: output features 5 is not divisible by tp=2",
        "b: input features 5 is not divisible by tp=2",
        "c: fused block 0 of output 3 is not divisible by tp=2",
        "c: fused block 1 of output 3 is not divisible by tp=2",
        "emb: vocab size (embedding rows) 7 is not divisible by tp=2: pad it (Hugging Face: "
        "resize_token_embeddings(pad_to_multiple_of=2))"], lines
    assert "blocks.0.attn.qkv: style 'column' needs a Linear, but the module is already " \
        "split across tp" in again


def _pipeline_stages(rank, world):
    from gigatron.parallel.topology import ProcessGroups, Topology
    groups = ProcessGroups(Topology(pp=2), rank)
    stage = nn.Module()  # the first stage holds the embedding, the last the output layer
    if rank == 0:
        stage.emb = nn.Embedding(8, 4)
    else:
        stage.head = nn.Linear(4, 8)
    plan = {"emb": "vocab_embedding", "head": "column"}
    parallelize(stage, plan, groups)
    return _error(stage, {**plan, "haed": "column"}, groups)


def test_on_pipeline_stages_a_pattern_must_match_on_some_stage_not_on_each():
    messages = run_on_ranks(_pipeline_stages, 2)
    assert messages == ["plan pattern 'haed' matches no module of any pipeline stage of "
                        "Module"] * 2, messages


def test_plan_for_knows_the_ready_made_plans_and_rejects_others():
    with pytest.raises(ValueError, match="no ready-made tensor-parallel plan for "
                                         "UserTransformer"):
        plan_for(UserTransformer())
    assert "transformer.h.*.attn.c_attn" in gpt2_plan().layers
    assert "model.layers.*.self_attn.k_proj" in llama_plan().layers
    assert isinstance(gpt2_plan(sequence_parallel=True), TensorParallelPlan)


# ---- training: tp=2 x dp=2 with ZeRO equals one device ----------------------------------------

STEPS, BATCH, LR = 3, 4, 1e-3


def _whole(kind, sequence_parallel=False):
    """A freshly seeded whole model and its plan."""
    if kind == "user":
        return UserTransformer(), user_plan(sequence_parallel)
    cls, config = _hf_models()[kind]
    torch.manual_seed(0)
    model = cls(config)
    return model, plan_for(model, **({"sequence_parallel": True} if sequence_parallel else {}))


def _train_loss(kind, model, ids):
    if kind == "user":
        return F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return model(ids, labels=ids).loss


def _train_batches(kind):
    vocab = VOCAB if kind == "user" else 128
    return [_ids(BATCH, SEQ, vocab, seed=10 + i) for i in range(STEPS)]


def _single_device(kind, optimizer):
    model, _ = _whole(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0) if optimizer == "adamw" \
        else torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for ids in _train_batches(kind):
        opt.zero_grad()
        _train_loss(kind, model, ids).backward()
        opt.step()
    start = dict(_whole(kind)[0].named_parameters())
    with torch.no_grad():
        moved = max(float((p - start[n]).norm() / p.norm()) for n, p in model.named_parameters())
    assert moved > 100 * TRAIN_RTOL, f"{kind}: training barely moved the weights ({moved:.1e})"
    modules = dict(model.named_modules())
    return {n: p.detach().t() if is_conv1d(modules[n.rpartition(".")[0]]) and
            n.endswith(".weight") else p.detach() for n, p in model.named_parameters()}


def _tp2_dp2(rank, world, cases):
    from gigatron.parallel.topology import ProcessGroups, Topology
    from gigatron.parallel.zero import ZeroConfig, build_zero
    groups = ProcessGroups(Topology(tp=2, dp=2), rank)
    per, dp_rank, out = BATCH // 2, groups.index("dp"), {}
    for kind, sp, stage, optimizer in cases:
        whole, plan = _whole(kind, sp)
        model = parallelize(whole, plan, groups)
        zero = build_zero(model, ZeroConfig(zero_stage=stage, optimizer=optimizer, lr=LR,
                                            weight_decay=0.0, sgd_momentum=0.9), groups)
        for ids in _train_batches(kind):
            zero.zero_grad()
            zero.backward(_train_loss(kind, model, ids[dp_rank * per:(dp_rank + 1) * per]))
            assert zero.step().success
        with zero.gathered_parameters():
            out[kind] = {n: gather_full_parameter(p, groups.tp)
                         for n, p in model.named_parameters()}
    return out


def _check_training(cases):
    results = run_on_ranks(_tp2_dp2, 4, cases)
    for kind, _, stage, optimizer in cases:
        ref = _single_device(kind, optimizer)
        for rank, got in enumerate(results):
            assert set(got[kind]) == set(ref), kind
            for name, full in got[kind].items():
                diff = (full - ref[name]).norm() / ref[name].norm()
                assert diff <= TRAIN_RTOL, f"{kind} zero {stage} rank {rank} {name}: {diff:.2e}"


def test_tp2_dp2_zero_training_of_the_split_user_model_with_sp_equals_one_device():
    _check_training([("user", True, 1, "adamw")])


def test_tp2_dp2_zero_training_of_split_hf_gpt2_and_llama_equals_one_device():
    _hf_models()
    _check_training([("gpt2", False, 2, "sgd"), ("llama", False, 1, "adamw")])
