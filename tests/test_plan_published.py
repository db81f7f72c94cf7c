"""gigatron plan against published H100/H200 runs (training/plan/published.py, issue 32):
every compared row within 25% of its tokens/s per GPU and 20% of its memory, held-out rows
included; the rows the model misses are named in KNOWN_MISSES and checked to still miss
(so a fix shows up here); a plan needs no training flags; --search tries pipeline
parallelism from a zoo model's layer count."""
import pytest

from gigatron.cli import plan as plan_cli
from gigatron.training.plan import published
from gigatron.training.plan.published import (MEMORY_TOLERANCE, ROWS, TOKENS_TOLERANCE,
                                              errors, predict)

# (label, note) of compared rows the model misses today, with the error measured when this
# list was written: docs/PERFORMANCE.md ("gigatron plan vs published H100 runs") says why
KNOWN_MISSES: dict = {}  # GPT 7.1B (+28.3%) came within once attention dropout was priced


@pytest.fixture(scope="module")
def plans():
    return {row: predict(row) for row in ROWS}


def _within(row, plan):
    tokens, memory = errors(row, plan)
    return abs(tokens) <= TOKENS_TOLERANCE and (memory is None or
                                                abs(memory) <= MEMORY_TOLERANCE)


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.label} ({r.note})" for r in ROWS])
def test_published_row_beside_its_prediction(row, plans):
    plan = plans[row]
    tokens, memory = errors(row, plan)
    if not row.compared:  # torchtitan eager: unfused kernels the plan does not model
        assert tokens > 0, (row.label, tokens)
    elif (row.label, row.note) in KNOWN_MISSES:
        assert not _within(row, plan), f"{row.label} now within: drop it from KNOWN_MISSES"
    else:
        assert abs(tokens) <= TOKENS_TOLERANCE, (row.label, f"{tokens:+.1%}")
        assert memory is None or abs(memory) <= MEMORY_TOLERANCE, (row.label, f"{memory:+.1%}")


def test_every_source_has_held_out_rows_and_they_are_checked():
    sources = {r.source for r in ROWS if r.compared}
    for source in sources:
        rows = [r for r in ROWS if r.source == source and r.compared]
        if len(rows) > 1:
            assert any(r.held_out for r in rows) and not all(r.held_out for r in rows)
    held = [r for r in ROWS if r.held_out and r.compared]
    assert len(held) >= 5 and published.rows_of(True) == [r for r in ROWS if r.held_out]


def test_megatron_flop_count_reproduces_the_published_mfu():
    """The table's 1.7B row: 408.8 TFLOP/s is 41% of the H100's 989.4 (MFU column)."""
    row = next(r for r in ROWS if r.label == "GPT 1.7B")
    per_token = published.megatron_flops_per_token(24, 2048, 4096, 131072)
    assert row.tokens_per_s_per_gpu * per_token / 989.4e12 == pytest.approx(0.413, abs=0.001)


def test_plan_needs_no_training_flags(capsys):
    code = plan_cli.main("--model llama3-8b --seq-length 8192 --micro-batch-size 2 "
                         "--global-batch-size 16 --bf16 --zero-stage 3 --recompute-granularity "
                         "selective --gpu h100-sxm --num-gpus 8".split())
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "tokens/s" in out.out and "max_memory_reserved" in out.out


def test_micro_batch_size_is_required_only_without_search(capsys):
    argv = "--model llama3-8b --global-batch-size 64 --bf16 --num-gpus 8".split()
    assert plan_cli.main(argv) == 2
    assert "--micro-batch-size is required" in capsys.readouterr().err
    _, _, run, _, _ = plan_cli.configure(argv + ["--search"])
    assert run.train.micro_batch_size == 1  # a stand-in; the search varies it


def test_search_tries_pipeline_parallel_from_the_zoo_layer_count():
    from gigatron.training.plan.search import _model_sizes, layouts

    _, flags, _, _, _ = plan_cli.configure(
        "--model llama3-8b --global-batch-size 64 --bf16 --num-gpus 64 --search".split())
    layers, _, seq_length, tied = _model_sizes(flags)
    assert layers == 32
    pps = {lay.pp for lay in layouts(64, layers, 8, seq_length=seq_length,
                                     tied_embeddings=tied)}
    assert pps == {1, 2, 4, 8, 16, 32}


def test_search_recommends_pipeline_parallel_for_gpt3_175b_on_512_gpus():
    from gigatron.training.observe.devices import hardware
    from gigatron.training.plan.search import Layout, evaluate

    _, flags, _, tokenizer, _ = plan_cli.configure(
        "--model gpt3-175b --global-batch-size 1536 --bf16 --num-gpus 512 --search".split())
    hw = hardware("h100-sxm")
    flat, piped = (evaluate(flags, Layout(8, pp, 512 // (8 * pp), 1, "selective", 1), 512,
                            1536, tokenizer, hw) for pp in (1, 8))
    assert piped.plan is not None and piped.reason is None
    assert flat.reason is not None and flat.reason.startswith("out of memory")


def test_memory_is_reported_allocated_reserved_and_on_the_device():
    from gigatron.training.plan import allocator

    gib = 2 ** 30
    reserved = allocator.reserved_bytes(10 * gib)
    assert reserved == pytest.approx(10 * gib * (1 + allocator.FRAGMENTATION) + gib / 16)
    # tp 2, pp 1, dp 4: two NCCL communicators beside the context
    assert allocator.device_bytes(10 * gib, (2, 1, 4), True) == pytest.approx(
        reserved + (allocator.NON_PYTORCH_GIB + 2 * allocator.NCCL_GIB_PER_GROUP) * gib)
    assert allocator.device_bytes(10 * gib, (2, 1, 4), False) == 10 * gib  # the CPU


def test_collectives_across_nodes_use_the_nics_of_the_groups_ranks_per_node():
    from gigatron.training.observe.devices import hardware
    from gigatron.training.plan.cost import _group_link

    h100 = hardware("h100-sxm")  # NVLink 450 GB/s, one 50 GB/s NIC per GPU, 8 per node
    assert _group_link(8, 1, h100) == 450  # within a node
    assert _group_link(48, 1, h100) == 400  # 8 ranks per node: 8 NICs
    assert _group_link(48, 4, h100) == 100  # tp 4: 2 of the group's ranks per node
    assert _group_link(48, 8, h100) == 50  # tp 8: one per node


def test_attention_dropout_slows_the_fused_kernel_by_the_measured_ratios():
    """Megatron's default --attention-dropout 0.1 runs inside the fused attention, slower
    (cost.FLASH_DROPOUT_SLOWDOWN, measured on an H100); the unfused path prices its dropout
    as bytes, not here."""
    from dataclasses import replace

    from gigatron.training.plan import cost

    args = (1e12, 2e9, 1e15, 5e14, 1e12)  # flops, bytes, matmul, flash and byte rates
    plain = cost._core_seconds(args[0], args[1], True, False, *args[2:])
    dropout = cost._core_seconds(args[0], args[1], True, True, *args[2:])
    forward, backward = cost.FLASH_DROPOUT_SLOWDOWN
    compute = args[0] / args[3]
    assert dropout[0] - plain[0] == pytest.approx(compute * (forward - 1))
    assert dropout[1] - plain[1] == pytest.approx(2 * compute * (backward - 1))
    assert cost._core_seconds(args[0], args[1], False, True, *args[2:]) == \
        cost._core_seconds(args[0], args[1], False, False, *args[2:])
    row = next(r for r in ROWS if r.label == "GPT 7.1B")
    without = replace(row, flags=row.flags + ("--attention-dropout", "0"))
    assert predict(without).rates.tokens_per_s > predict(row).rates.tokens_per_s * 1.03
