"""Published H100 training runs, as data, and the plan's prediction of each (issue 32).

Every row is a run as its authors state it (layout, batch, sequence, recomputation, ZeRO),
with the published tokens/s per GPU and, where given, memory. The plan predicts each from
the hardware table and cost.py's constants alone; nothing here is fitted per row.

Sources (read from the repositories at the commits named):
  TORCHTITAN  pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md at 820504e2
              (2025-06-13; the runs: torchtitan 9dec370, torch 1963fc8, 2024-12): Llama 3.1
              8B on H100 96 GB HBM2e at 500 W (Grand Teton), FSDP, bf16, selective
              activation checkpointing (torchtitan's "op" policy: --selective-ac-option op,
              whose memory the plan counts (training/plan/recompute.py) and whose recompute
              time `sac_recompute_seconds` adds), local
              batch 2, sequence 8192. Tables 1 (8 GPUs) and 3 (128 GPUs), eager and
              torch.compile rows; memory is torchtitan's logged `max_reserved` (GiB). The
              eager rows are shown, not compared (`compared`): eager PyTorch's unfused
              norms, RoPE and SwiGLU are not modelled. The Float8 rows and Tables 2, 4-6
              (all Float8, most AsyncTP) are not used: the plan does not model Float8 GEMMs.
  MEGATRON    NVIDIA/Megatron-LM README.md "Weak Scaling Results" and images/model_table.png
              at d98e8a64 (table added in f2e5db40, 2024-07; Megatron-Core r0.8.0): GPT
              models of 1.7B-462B on 48-6144 H100 SXM 80 GB (DGX H100), vocabulary 131,072,
              sequence 4,096, data-parallel 48, the overlaps of grad reduce, param gather,
              tp communication and p2p. Published: model TFLOP/s per GPU (Megatron's count,
              `megatron_flops_per_token`), converted here to tokens/s per GPU. The README
              does not state micro-batch (1 here), recomputation (none), the pipeline
              schedule (1F1B here) or position embedding (Megatron's default, learned);
              the grad buckets are Megatron-Core's default for the distributed optimizer,
              max(40M, 1M x dp) elements.
              The rows give the overlaps' flags (--overlap-grad-reduce,
              --overlap-param-gather, --tp-comm-overlap where tp > 1), which gigatron runs
              and the plan reads.
  H200_SESSION  gigatron itself, measured on one H200 (docs/PERFORMANCE.md, "One H200":
              GPT 1.3B, micro-batch 8, seq 2048, dropout 0; max_memory_allocated), before
              the fused Adam and q/k/v-split fixes listed there.
  H100_SESSION  the same run on one H100 SXM, after those fixes (docs/PERFORMANCE.md, "One
              H100"); held out: measured after every constant here was set.
  Megatron-Bridge's performance summary (NVIDIA-NeMo/Megatron-Bridge docs/performance-
  summary*.md at 067f987d) has no dense bf16 H100 row (its H100 Llama rows are FP8 through
  Transformer Engine, which gigatron emulates on bf16 GEMMs: not comparable), and its one
  bf16 H100 row is GPT-OSS 120B, a model the zoo lacks: none of it is used.

Held out: rows with `held_out=True` (every other Megatron-Core row, and torchtitan's 128-GPU
Table 3) are checked in the same test with the same tolerances. No constant was fitted to
a row, but the held-out rows were visible while the model's structure changed, the 7.1B
one named as a miss before the GEMM-shape pass began (docs/PERFORMANCE.md, "gigatron plan vs
published H100/H200 runs", says what that is worth).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

from gigatron.training.plan.allocator import reserved_bytes

if TYPE_CHECKING:
    from gigatron.training.plan.planner import Plan

TORCHTITAN = ("pytorch/torchtitan", "benchmarks/llama3_h100_202412_torchtitan.md",
              "820504e20d1149fbf0b98c567af24c4b0433b22d")
MEGATRON = ("NVIDIA/Megatron-LM", "README.md, images/model_table.png",
            "d98e8a64ddf34856e74b24714e3bedb2f5a39553")
H200_SESSION = ("this repository", "bench/results/2026-11-26-h200/train_gpt3-1.3b_mb8.json",
                "docs/PERFORMANCE.md, One H200")
H100_SESSION = ("this repository", "bench/results/2026-11-26-h100/gpt/results.json",
                "docs/PERFORMANCE.md, One H100")
TOKENS_TOLERANCE = 0.25
MEMORY_TOLERANCE = 0.20


@dataclass(frozen=True)
class PublishedRun:
    """One published run: its flags as pretrain_gpt.py flags, and what it reached."""

    source: Tuple[str, str, str]  # (repository, path, commit)
    label: str
    gpu: str  # the hardware table's key
    gpus: int
    flags: Tuple[str, ...]
    tokens_per_s_per_gpu: float
    memory_gib: Optional[float] = None  # as published
    held_out: bool = False
    note: str = ""
    assume: Tuple[str, ...] = ()  # Megatron-Core overlaps the run used (cost.OVERLAPS)
    torchtitan_sac: bool = False  # --selective-ac-option op: its recompute time (memory: the plan's)
    compared: bool = True  # False: shown beside its prediction, not held to the tolerances
    memory_kind: str = "reserved"  # which: max_memory_reserved or max_memory_allocated


def megatron_flops_per_token(layers: int, hidden: int, seq: int, vocab: int) -> float:
    """Megatron-LM's `num_floating_point_operations` per token for a GPT model (ffn 4h, no
    GQA): 72 l h^2 (1 + s/(6h) + V/(12 l h)), forward and backward, no recomputation."""
    return 72.0 * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (12 * layers *
                                                                            hidden))


def predicted_memory(row: PublishedRun, plan: "Plan") -> float:
    """The plan's peak as `row` reports it: reserved or allocated (allocator.py)."""
    allocated = plan.peak_bytes
    return reserved_bytes(allocated) if row.memory_kind == "reserved" else allocated


def _torchtitan(label: str, gpus: int, tokens: float, memory: float, held_out: bool,
                note: str) -> PublishedRun:
    flags = ("--model", "llama3-8b", "--seq-length", "8192", "--micro-batch-size", "2",
             "--global-batch-size", str(2 * gpus), "--bf16", "--zero-stage", "3",
             "--recompute-granularity", "selective", "--selective-ac-option", "op")
    return PublishedRun(TORCHTITAN, label, "h100-hbm2e", gpus, flags, tokens, memory,
                        held_out, note, torchtitan_sac=True, compared=note != "eager")


def _megatron(billions: float, heads: int, hidden: int, layers: int, tp: int, pp: int,
              batch: int, tflops: float, held_out: bool) -> PublishedRun:
    gpus = tp * pp * 48
    flags = ("--num-layers", str(layers), "--hidden-size", str(hidden),
             "--num-attention-heads", str(heads), "--seq-length", "4096",
             "--max-position-embeddings", "4096", "--vocab-size", "131072",
             "--micro-batch-size", "1", "--global-batch-size", str(batch), "--bf16",
             "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
             str(pp), "--use-distributed-optimizer", "--overlap-grad-reduce",
             "--ddp-bucket-size", str(max(40_000_000, 1_000_000 * 48)),
             "--overlap-param-gather") + (("--sequence-parallel", "--tp-comm-overlap")
                                          if tp > 1 else ())
    tokens = tflops * 1e12 / megatron_flops_per_token(layers, hidden, 4096, 131072)
    return PublishedRun(MEGATRON, f"GPT {billions}B", "h100-sxm", gpus, flags, tokens,
                        None, held_out, f"{tflops} TFLOP/s/GPU published")


ROWS: Tuple[PublishedRun, ...] = (
    PublishedRun(H200_SESSION, "GPT 1.3B, one GPU", "h200", 1, (
        "--model", "gpt3-1.3b", "--seq-length", "2048", "--micro-batch-size", "8",
        "--global-batch-size", "8", "--bf16", "--hidden-dropout", "0", "--attention-dropout",
        "0", "--attention-backend", "flash", "--clip-grad", "1.0"), 50530, 57.03,
        note="gigatron, measured", memory_kind="allocated"),
    PublishedRun(H100_SESSION, "GPT 1.3B, one GPU", "h100-sxm", 1, (
        "--model", "gpt3-1.3b", "--seq-length", "2048", "--micro-batch-size", "8",
        "--global-batch-size", "8", "--bf16", "--hidden-dropout", "0", "--attention-dropout",
        "0", "--attention-backend", "flash", "--clip-grad", "1.0"), 53699, 50.89, True,
        note="gigatron, measured", memory_kind="allocated"),
    _torchtitan("Llama 3.1 8B, FSDP (Table 1)", 8, 5762, 82.4, False, "eager"),
    _torchtitan("Llama 3.1 8B, FSDP + compile (Table 1)", 8, 6667, 77.0, False,
                "torch.compile"),
    _torchtitan("Llama 3.1 8B, FSDP (Table 3)", 128, 5605, 67.0, True, "eager"),
    _torchtitan("Llama 3.1 8B, FSDP + compile (Table 3)", 128, 6514, 62.0, True,
                "torch.compile"),
    _megatron(1.7, 16, 2048, 24, 1, 1, 192, 408.8, False),
    _megatron(7.1, 32, 4096, 30, 2, 1, 192, 465.9, True),
    _megatron(16, 48, 6144, 32, 4, 1, 192, 489.1, False),
    _megatron(32, 56, 7168, 48, 8, 1, 192, 459.6, True),
    _megatron(70, 64, 8192, 84, 8, 2, 384, 419.7, False),
    _megatron(119, 80, 10240, 92, 8, 4, 768, 420.5, True),
    _megatron(177, 96, 12288, 96, 8, 6, 1152, 432.8, False),
    _megatron(314, 128, 16384, 96, 8, 8, 1536, 474.4, True),
    _megatron(462, 144, 18432, 112, 8, 16, 3072, 459.9, False),
)


def predict(row: PublishedRun) -> "Plan":
    """The plan of `row`'s run on its published hardware (no training flags needed)."""
    from gigatron.training.config.arguments import build_run, parse_flags
    from gigatron.training.config.table import build_settings
    from gigatron.training.observe.devices import hardware
    from gigatron.training.plan.planner import fill_plan_flags, plan_run

    flags = parse_flags(list(row.flags), "gigatron plan")
    fill_plan_flags(flags, search=False)
    run, _ = build_run(build_settings(flags), row.gpus)
    return plan_run(run, hardware(row.gpu), frozenset(row.assume))


def sac_recompute_seconds(plan: "Plan") -> float:
    """What torchtitan's SAC recomputes beyond gigatron's op rule (the plan's own, `--
    selective-ac-option op`: linear_proj and linear_fc2 run again), per step: torchtitan's
    Llama runs wq, wk, wv and w1, w3 as separate matmuls, so its every second matmul is
    wk, wo and w3: wk's GEMM more (wo and w3 do linear_proj's and linear_fc2's FLOPs)."""
    from gigatron.training.plan import gemm

    c, p, t = plan.run.model, plan.run.parallel, plan.run.train
    assert c is not None and t.micro_batch_size is not None
    tokens = c.seq_length * t.micro_batch_size
    wk = 2.0 * tokens * c.hidden_size * c.num_query_groups * c.head_dim / gemm.gemm_rate(
        plan.hardware, "bf16")
    return t.num_microbatches * c.num_layers // p.pp * wk


def predicted_tokens_per_gpu(row: PublishedRun, plan: "Plan") -> float:
    """The plan's tokens/s per GPU for `row`'s run (torchtitan's SAC: its own recompute)."""
    if not row.torchtitan_sac:
        return plan.rates.tokens_per_s / row.gpus
    step = plan.cost.step + sac_recompute_seconds(plan)
    return plan.rates.tokens_per_s * plan.cost.step / step / row.gpus


def errors(row: PublishedRun, plan: "Plan") -> Tuple[float, Optional[float]]:
    """(relative error of tokens/s per GPU, of memory or None) of `plan` against `row`."""
    tokens = predicted_tokens_per_gpu(row, plan)
    memory = None if row.memory_gib is None else \
        predicted_memory(row, plan) / 2 ** 30 / row.memory_gib - 1
    return tokens / row.tokens_per_s_per_gpu - 1, memory


def comparison_table(rows: Tuple[PublishedRun, ...] = ROWS) -> str:
    """Markdown: every published row beside its prediction (docs/PERFORMANCE.md)."""
    lines = ["| run | GPUs | layout | published tokens/s/GPU | predicted | error | "
             "published GiB | predicted GiB | error | held out |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        plan = predict(row)
        p = plan.run.parallel
        tokens_error, memory_error = errors(row, plan)
        memory = "-" if row.memory_gib is None else f"{row.memory_gib}"
        lines.append(
            f"| {row.label} ({row.note}) | {row.gpus} {row.gpu} | tp{p.tp} pp{p.pp} dp{p.dp} "
            f"| {row.tokens_per_s_per_gpu:,.0f} | {predicted_tokens_per_gpu(row, plan):,.0f} "
            f"| {tokens_error:+.1%} | {memory} | "
            f"{predicted_memory(row, plan) / 2 ** 30:.1f} | "
            f"{'-' if memory_error is None else f'{memory_error:+.1%}'} | "
            f"{'yes' if row.held_out else 'no'} |")
    return "\n".join(lines)


def rows_of(held_out: bool) -> List[PublishedRun]:
    """The calibration rows (False) or the held-out ones (True)."""
    return [r for r in ROWS if r.held_out == held_out]


if __name__ == "__main__":
    print(comparison_table())
