"""The Megatron-LM SC21 paper's weak-scaling table, as data, and the plan's prediction of it.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC21, arXiv 2104.04473), Table 1: GPT models of 1.7B to 1T parameters on up
to 3072 A100 80 GB GPUs (Selene: DGX A100 nodes, 8 HDR 200 Gb/s NICs each); every model has
vocabulary 51,200 and sequence length 2,048, trains in 16-bit precision with full activation
recomputation, and the achieved TFLOP/s per GPU count FLOPs with the paper's formula
(`megatron_sc21_flops`, recomputation included).

The table does not give the micro-batch size or the schedule; the flags below use micro-batch
1 and the non-interleaved 1F1B schedule (Megatron's defaults of its GPT-3 175B example) for
every row, the unfused softmax (no flash attention in 2021), 16-bit gradient all-reduce and
no distributed optimizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

if TYPE_CHECKING:
    from gigatron.training.config.run_config import RunConfig
    from gigatron.training.plan.cost import StepCost
    from gigatron.training.plan.planner import Plan


@dataclass(frozen=True)
class SC21Row:
    """One row of Table 1."""

    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # achieved, as published

    def flags(self) -> List[str]:
        """pretrain_gpt flags of this row's run (see the module docstring)."""
        return [
            "--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
            "--num-attention-heads", str(self.heads), "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--vocab-size", "51200",
            "--micro-batch-size", "1", "--global-batch-size", str(self.batch),
            "--tensor-model-parallel-size", str(self.tp),
            "--pipeline-model-parallel-size", str(self.pp), "--bf16", "--grad-reduce-in-bf16",
            "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1", "--attention-backend", "unfused",
            "--lr", "1e-4", "--train-iters", "1", "--mock-data"]


TABLE_1: Tuple[SC21Row, ...] = (
    SC21Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    SC21Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    SC21Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    SC21Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    SC21Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    SC21Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    SC21Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    SC21Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    SC21Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    SC21Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def megatron_sc21_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration as Narayanan et al. 2021 count them (eq. 3, full activation
    recomputation included): 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))."""
    return 96.0 * batch * seq * layers * hidden ** 2 * (
        1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def sc21_tflops_per_gpu(run: "RunConfig", cost: "StepCost", vocab: Optional[int] = None
                        ) -> float:
    """Achieved TFLOP/s per GPU counted as the SC21 paper counts them."""
    c, t = run.model, run.train
    assert c is not None and t.global_batch_size is not None
    flops = megatron_sc21_flops(t.global_batch_size, c.seq_length, c.num_layers,
                                c.hidden_size, vocab or c.vocab_size)
    return flops / cost.step / run.parallel.world_size / 1e12


def predict(row: SC21Row, gpu: str = "a100-80gb") -> Tuple["Plan", float]:
    """(the plan of this row's run, its predicted TFLOP/s per GPU as the paper counts)."""
    from gigatron.training.config.arguments import build_run_config, parse_flags
    from gigatron.training.observe.devices import hardware
    from gigatron.training.plan.planner import plan_run

    run = build_run_config(parse_flags(row.flags()), row.gpus)
    plan = plan_run(run, hardware(gpu))
    return plan, sc21_tflops_per_gpu(run, plan.cost, 51200)


def comparison_table() -> str:
    """Markdown: published vs predicted per row (docs/PERFORMANCE.md)."""
    lines = ["| params | t | p | GPUs | batch | published TFLOP/s/GPU | predicted | error | "
             "bubble | fits |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in TABLE_1:
        plan, tflops = predict(row)
        lines.append(f"| {row.billions}B | {row.tp} | {row.pp} | {row.gpus} | {row.batch} | "
                     f"{row.tflops_per_gpu:.0f} | {tflops:.1f} | "
                     f"{tflops / row.tflops_per_gpu - 1:+.1%} | {plan.cost.bubble:.3f} | "
                     f"{'yes' if plan.fits else 'no'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(comparison_table())
