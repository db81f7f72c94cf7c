"""DeepSpeed writes checkpoints and continues; gigatron loads the same checkpoints and continues.

    deepspeed_checkpoint_script.py deepspeed OUT_DIR      (RANK, WORLD_SIZE, MASTER_* set)
    deepspeed_checkpoint_script.py gigatron OUT_DIR --sources 1,2

deepspeed: for every case of CASES (ZeRO stage, precision), real DeepSpeed trains the MLP of
tests/deepspeed_parity_script.py for SAVE_AT steps, saves to OUT_DIR/ds<world>/<case>, then
continues CONTINUE steps (the oracle). Rank 0 then writes DeepSpeed's universal checkpoint of
UNIVERSAL_CASE with deepspeed.checkpoint.ds_to_universal (one worker, in-process).
gigatron: for every case and every source world size, gigatron.initialize builds the same
engine (same config, any world size), engine.load_checkpoint reads DeepSpeed's folder and
continues CONTINUE steps; the universal folder loads with the same engine.

The global batch is the same at every world size: step s is CHUNKS micro-batches of
MICRO_BATCH samples, chunk c a function of (s, c) only, and rank r's micro-batch m is chunk
m * world + r; so a step's mean loss over all chunks is the same run on 1 or 2 ranks. Each
rank writes OUT_DIR/rank<r>.json: {case: {"losses": [per step: [chunk, loss] ...]}}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepspeed_parity_script import (IN, MICRO_BATCH, OUT, SmallNet,  # noqa: E402
                                     exit_before_interpreter_finalization,
                                     leave_process_group, merge, write_results)

SAVE_AT, CONTINUE = 3, 3
CHUNKS = 2  # micro-batches per step over all ranks: accumulation 2 on one rank, 1 on two
CASES = {"z0": (0, "fp32"), "z1": (1, "fp32"), "z2": (2, "fp32"), "z3": (3, "fp32"),
         "z0-bf16": (0, "bf16"), "z1-bf16": (1, "bf16"), "z3-bf16": (3, "bf16")}
UNIVERSAL_CASE = "z2"


def config(stage: int, precision: str, world: int) -> Dict[str, Any]:
    """The parity script's optimizer and schedule, with a global batch of CHUNKS micro-batches."""
    cfg = {"train_batch_size": CHUNKS * MICRO_BATCH, "train_micro_batch_size_per_gpu": MICRO_BATCH,
           "gradient_accumulation_steps": CHUNKS // world, "gradient_clipping": 0.5,
           "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95],
                                                     "eps": 1e-8, "weight_decay": 0.1,
                                                     "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001,
                                                        "warmup_max_lr": 0.01,
                                                        "warmup_num_steps": 5}},
           "zero_optimization": {"stage": stage}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def chunk_data(step: int, chunk: int, dtype: torch.dtype) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + chunk)
    x = torch.randn(MICRO_BATCH, IN, generator=g)
    y = torch.sin(3 * x[:, :OUT]) + 0.1 * torch.randn(MICRO_BATCH, OUT, generator=g)
    return [x.to(dtype), y.to(dtype)]


def train(engine: Any, first: int, steps: int, rank: int, world: int, dtype: torch.dtype
          ) -> List[List[Tuple[int, float]]]:
    """Steps first..first+steps-1; per step, this rank's (chunk, loss) pairs."""
    losses = []
    for step in range(first, first + steps):
        mine = []
        for m in range(CHUNKS // world):
            chunk = m * world + rank
            loss = engine(*chunk_data(step, chunk, dtype))
            engine.backward(loss)
            engine.step()
            mine.append((chunk, loss.float().item()))
        losses.append(mine)
    return losses


def build(initialize: Any, stage: int, precision: str, world: int) -> Any:
    torch.manual_seed(1234)
    model = SmallNet()
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(),
                                 config=config(stage, precision, world))
    return engine


def run_deepspeed(out_dir: str, rank: int, world: int) -> Dict[str, Any]:
    import deepspeed

    results = {}
    for case, (stage, precision) in CASES.items():
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        engine = build(deepspeed.initialize, stage, precision, world)
        before = train(engine, 0, SAVE_AT, rank, world, dtype)
        engine.save_checkpoint(os.path.join(out_dir, f"ds{world}", case),
                               client_state={"case": case, "samples_seen": 24})
        after = train(engine, SAVE_AT, CONTINUE, rank, world, dtype)
        results[case] = {"before": before, "losses": after}
        engine.destroy()
    if rank == 0:
        write_universal(os.path.join(out_dir, f"ds{world}", UNIVERSAL_CASE))
    dist.barrier()
    return results


def write_universal(folder: str) -> None:
    """DeepSpeed's own converter, as `python -m deepspeed.checkpoint.ds_to_universal` runs it."""
    from deepspeed.checkpoint import ds_to_universal

    tag = open(os.path.join(folder, "latest")).read().strip()
    argv = ["--input_folder", os.path.join(folder, tag), "--output_folder",
            os.path.join(folder, tag + "_universal"), "--num_extract_workers", "1",
            "--num_merge_workers", "1", "--inject_missing_state"]
    saved, sys.argv = sys.argv, ["ds_to_universal"] + argv
    try:
        ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = saved


def run_gigatron(out_dir: str, rank: int, world: int, sources: List[int]) -> Dict[str, Any]:
    import gigatron

    results = {}
    for source in sources:
        for case, (stage, precision) in CASES.items():
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            folder = os.path.join(out_dir, f"ds{source}", case)
            tags = [None] + (["global_step3_universal"] if case == UNIVERSAL_CASE else [])
            for tag in tags:
                engine = build(gigatron.initialize, stage, precision, world)
                path, client = engine.load_checkpoint(folder, tag=tag)
                assert path is not None and client.get("case") == case, (path, client)
                assert engine.global_steps == SAVE_AT, engine.global_steps
                name = f"{case}@{source}" + ("-universal" if tag else "")
                results[name] = {"losses": train(engine, SAVE_AT, CONTINUE, rank, world, dtype)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=["deepspeed", "gigatron"])
    parser.add_argument("out_dir")
    parser.add_argument("--sources", default="1,2", help="world sizes whose checkpoints to load")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.framework == "deepspeed":
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see the parity script
        deepspeed.init_distributed(dist_backend="gloo")
        results = run_deepspeed(args.out_dir, rank, world)
    else:
        import gigatron

        gigatron.init_distributed(dist_backend="gloo")
        results = run_gigatron(args.out_dir, rank, world,
                               [int(s) for s in args.sources.split(",")])
    write_results(os.path.join(args.out_dir, f"{args.framework}{world}.rank{rank}.json"),
                  results)
    leave_process_group()
    exit_before_interpreter_finalization()


if __name__ == "__main__":
    main()
