"""Converted checkpoints are layout-free: a Hugging Face Llama converted to a gigatron checkpoint
loads with `--load` at tp=2 x pp=2 (forked gloo ranks) and gives Hugging Face's logits
(fp32, 1e-5); a tp=2 x pp=2 run that trains on from it (lr 0: the weights stay) saves a
checkpoint that converts back to a Hugging Face folder with the same logits again. A
Megatron-LM checkpoint (tp=4, GPT-style: tied embeddings, learned positions) imported to a
gigatron checkpoint gives the single-device model's logits at tp=2 x pp=2 too."""
import contextlib
import io

import pytest
import torch
import torch.distributed as dist

from megatron_layout import megatron_args
from multirank import run_on_ranks
from test_megatron_import import GPT_LIKE, _gigatron_logits, _reference, _write_layout

transformers = pytest.importorskip("transformers")

from gigatron.training.checkpoint.convert import (  # noqa: E402
    gigatron_to_hf,
    hf_to_gigatron,
    megatron_to_gigatron,
    model_flags,
)

VOCAB, SEQ = 101, 16
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
RUN = ["--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data", "--seq-length",
       str(SEQ), "--lr", "0.0", "--min-lr", "0.0", "--weight-decay", "0.0",
       "--eval-iters", "0", "--train-iters", "1", "--log-interval", "1", "--no-progress", "--num-workers", "0"]


def _hf_llama(folder):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, rope_theta=50000.0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at ones: random values make a swapped norm visible
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _logits_at_layout(rank, world, argv, tokens):
    """pretrain_gpt's model at the flags' layout, --load weights; full logits on the last
    stage's tp rank 0 (stage 0 sends its hidden states on, the last stage gathers tp)."""
    from gigatron.parallel.topology import ProcessGroups, Topology
    from gigatron.training.run import builders
    from gigatron.training.checkpoint import orchestrator as state
    from gigatron.training.config.arguments import build_run_config, parse_flags

    run = build_run_config(parse_flags(argv), world, None)
    p = run.parallel
    groups = ProcessGroups(Topology(tp=p.tp, dp=p.dp, pp=p.pp), rank)
    chunks = builders.build_model_chunks(run, groups, torch.device("cpu"))
    assert state.load_model_weights(run, groups, chunks) is not None
    model = chunks[0].eval()
    pp_ranks, pp_rank = groups.ranks("pp"), groups.index("pp")
    with torch.no_grad():
        if pp_rank == 0:
            dist.send(model(input_ids=tokens), pp_ranks[1])
            return None
        hidden = torch.empty(SEQ, tokens.shape[0], run.model.hidden_size)
        dist.recv(hidden, pp_ranks[0])
        local = model(hidden_states=hidden)
        parts = [torch.empty_like(local) for _ in range(groups.size("tp"))]
        dist.all_gather(parts, local, group=groups.tp)
    return torch.cat(parts, dim=-1) if groups.index("tp") == 0 else None


def _pretrain(rank, world, argv):
    from gigatron.training.run import pretrain

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = pretrain.main(argv)
    return code, err.getvalue()


def test_hf_checkpoint_loads_at_tp2_pp2_and_trains_back_to_hf_logits(tmp_path):
    hf = _hf_llama(tmp_path / "hf")
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(tokens).logits
    config = hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    flags = model_flags(config) + LAYOUT + RUN

    results = run_on_ranks(_logits_at_layout, 4,
                           flags + ["--load", str(tmp_path / "gig"), "--finetune"], tokens)
    logits = next(r for r in results if r is not None)
    torch.testing.assert_close(logits[..., :VOCAB], expected, rtol=0, atol=1e-5)

    trained = str(tmp_path / "trained")
    results = run_on_ranks(_pretrain, 4, flags + [
        "--load", str(tmp_path / "gig"), "--finetune", "--save", trained, "--save-interval", "1"], timeout=240)
    assert all(code == 0 for code, _ in results), results[0][1][-2000:]
    gigatron_to_hf(trained, str(tmp_path / "back"))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, expected, rtol=0, atol=1e-5)


def test_megatron_import_loads_at_tp2_pp2_with_the_single_device_logits(tmp_path):
    args = megatron_args(tp=4, vocab_size=VOCAB, seq_length=SEQ, **GPT_LIKE)
    config, state = _reference(args)
    _write_layout(str(tmp_path / "meg"), args, state, config)
    imported = megatron_to_gigatron(str(tmp_path / "meg"), str(tmp_path / "gig"))
    assert imported == config
    tokens = _tokens()
    expected = _gigatron_logits(config, state, tokens)[..., :VOCAB]
    results = run_on_ranks(_logits_at_layout, 4, model_flags(config) + LAYOUT + RUN + [
        "--load", str(tmp_path / "gig"), "--finetune"], tokens)
    logits = next(r for r in results if r is not None)
    torch.testing.assert_close(logits[..., :VOCAB], expected, rtol=0, atol=1e-5)
