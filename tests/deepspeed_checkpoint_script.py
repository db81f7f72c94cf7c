"""DeepSpeed writes checkpoints and continues; gigatron loads the same checkpoints and continues.

    deepspeed_checkpoint_script.py deepspeed OUT_DIR      (RANK, WORLD_SIZE, MASTER_* set)
    deepspeed_checkpoint_script.py gigatron OUT_DIR --sources 1,2

deepspeed: for every case of CASES (ZeRO stage, precision), real DeepSpeed trains the MLP of
tests/deepspeed_parity_script.py for SAVE_AT steps, saves to OUT_DIR/ds<world>/<case>, then
continues CONTINUE steps (the oracle). Rank 0 then writes DeepSpeed's universal checkpoint of
UNIVERSAL_CASE with deepspeed.checkpoint.ds_to_universal (one worker, in-process). The 2-rank
run also saves OUT_DIR/megatron: a model named like Megatron-DeepSpeed's GPT, with its
Megatron args in client_state (what `gigatron convert deepspeed-to-gigatron` reads), and
OUT_DIR/megatron-tp1 and OUT_DIR/megatron-tp2pp2: the same GPT weights at tp 1 and in the
pipeline engine's tp 2 x pp 2 layout (megatron_deepspeed_writer.py).
gigatron: for every case and every source world size, gigatron.initialize builds the same
engine (same config, any world size), engine.load_checkpoint reads DeepSpeed's folder and
continues CONTINUE steps; the universal folder loads with the same engine (the 1-rank save's
by its tag, the 2-rank save's as "checkpoint": {"load_universal": true} finds it).

The global batch is the same at every world size: step s is CHUNKS micro-batches of
MICRO_BATCH samples, chunk c a function of (s, c) only, and rank r's micro-batch m is chunk
m * world + r; so a step's mean loss over all chunks is the same run on 1 or 2 ranks. Each
rank writes OUT_DIR/<framework><world>.rank<r>.json: {case: {"losses": [per step: [chunk,
loss] ...]}} (gigatron's cases are named <case>@<source world>), then exits as the parity
script does (exit_before_interpreter_finalization).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_deepspeed_writer as writer  # noqa: E402
from deepspeed_parity_script import (IN, MICRO_BATCH, OUT, SmallNet, ds_config,  # noqa: E402
                                     exit_before_interpreter_finalization,
                                     leave_process_group, merge, write_results)

SAVE_AT, CONTINUE = 3, 3
CHUNKS = 2  # micro-batches per step over all ranks: accumulation 2 on one rank, 1 on two
CASES = {"z0": (0, "fp32"), "z1": (1, "fp32"), "z2": (2, "fp32"), "z3": (3, "fp32"),
         "z0-bf16": (0, "bf16"), "z1-bf16": (1, "bf16"), "z3-bf16": (3, "bf16"),
         "z2-fp16": (2, "fp16")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp16: with a window of 2 DeepSpeed doubles the scale at its 3rd step (saved: 2^9, not the
# initial one) and at its 5th, the 2nd continued step (Megatron's rule: the 2nd, 4th, 6th)
INITIAL_SCALE_POWER = 8
UNIVERSAL_CASE = "z2"
UNIVERSAL_TAG = f"global_step{SAVE_AT}_universal"


def deepspeed_supports_fp16() -> bool:
    """What DeepSpeed's engine asks before it trains in fp16 ("Type fp16 is not supported on
    your device" otherwise): on a CPU its accelerator asks oneDNN, which says no on CPUs
    without native fp16, so the fp16 case can only run where this is True."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def runnable_cases(fp16: bool) -> Dict[str, Tuple[int, str]]:
    """CASES, without the fp16 ones where DeepSpeed refuses fp16 on this machine."""
    return {case: spec for case, spec in CASES.items() if fp16 or spec[1] != "fp16"}


def config(stage: int, precision: str, world: int) -> Dict[str, Any]:
    """The parity script's DeepSpeed config (warm-up over 5 steps), with a global batch of CHUNKS
    micro-batches."""
    cfg = merge(ds_config(stage), {"train_batch_size": CHUNKS * MICRO_BATCH,
                                   "gradient_accumulation_steps": CHUNKS // world,
                                   "scheduler": {"params": {"warmup_num_steps": 5}}})
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": INITIAL_SCALE_POWER,
                       "loss_scale_window": 2}
    return cfg


def chunk_data(step: int, chunk: int, dtype: torch.dtype) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + chunk)
    x = torch.randn(MICRO_BATCH, IN, generator=g)
    y = torch.sin(3 * x[:, :OUT]) + 0.1 * torch.randn(MICRO_BATCH, OUT, generator=g)
    return [x.to(dtype), y.to(dtype)]


def train(engine: Any, first: int, steps: int, rank: int, world: int, dtype: torch.dtype
          ) -> Tuple[List[List[Tuple[int, float]]], List[Optional[float]]]:
    """Steps first..first+steps-1; per step, this rank's (chunk, loss) pairs, and the loss
    scale after each step (None without fp16's dynamic scale)."""
    losses, scales = [], []
    for step in range(first, first + steps):
        mine = []
        for m in range(CHUNKS // world):
            chunk = m * world + rank
            loss = engine(*chunk_data(step, chunk, dtype))
            engine.backward(loss)
            engine.step()
            mine.append((chunk, loss.float().item()))
        losses.append(mine)
        scales.append(loss_scale(engine))
    return losses, scales


def loss_scale(engine: Any) -> Optional[float]:
    """The engine's fp16 loss scale now (DeepSpeed's ZeRO optimizer's cur_scale, gigatron's
    engine.loss_scale); None in fp32/bf16."""
    if hasattr(engine, "zero"):  # gigatron's engine
        return float(engine.loss_scale) if engine.zero.scaler.dynamic else None
    scale = getattr(engine.optimizer, "cur_scale", None)
    return None if scale is None else float(scale)


def build(initialize: Any, stage: int, precision: str, world: int,
          extra: Optional[Dict[str, Any]] = None) -> Any:
    torch.manual_seed(1234)
    model = SmallNet()
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(),
                                 config=merge(config(stage, precision, world), extra or {}))
    return engine


def run_deepspeed(out_dir: str, rank: int, world: int) -> Dict[str, Any]:
    import deepspeed

    results = {}
    for case, (stage, precision) in runnable_cases(deepspeed_supports_fp16()).items():
        dtype = DTYPES[precision]
        engine = build(deepspeed.initialize, stage, precision, world)
        before, _ = train(engine, 0, SAVE_AT, rank, world, dtype)
        engine.save_checkpoint(os.path.join(out_dir, f"ds{world}", case),
                               client_state={"case": case, "samples_seen": 24})
        scale = loss_scale(engine)
        after, scales = train(engine, SAVE_AT, CONTINUE, rank, world, dtype)
        results[case] = {"before": before, "losses": after, "loss_scale": scale,
                         "scales": scales}
        engine.destroy()
    if world == 2:
        save_megatron_deepspeed_gpt(deepspeed.initialize, os.path.join(out_dir, "megatron"))
        torch.manual_seed(6)
        full = {k: torch.randn(*v) * 0.3 for k, v in megatron_deepspeed_shapes().items()}
        writer.write_both(deepspeed.initialize, out_dir, full, MEGATRON_ARGS, 2)
    if rank == 0:
        write_universal(os.path.join(out_dir, f"ds{world}", UNIVERSAL_CASE))
    dist.barrier()
    return results


MEGATRON_ARGS = dict(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=16,
                     max_position_embeddings=16, padded_vocab_size=64, vocab_size=60,
                     make_vocab_size_divisible_by=8, normalization="layernorm",
                     layernorm_epsilon=1e-5, add_bias_linear=True, bias_gelu_fusion=True,
                     ffn_hidden_size=32, kv_channels=4, hidden_dropout=0.0,
                     attention_dropout=0.0, position_embedding_type="learned_absolute")
MEGATRON_LAYER = {"input_layernorm.weight": (8,), "input_layernorm.bias": (8,),
                  "self_attention.query_key_value.weight": (24, 8),
                  "self_attention.query_key_value.bias": (24,),
                  "self_attention.dense.weight": (8, 8), "self_attention.dense.bias": (8,),
                  "post_attention_layernorm.weight": (8,), "post_attention_layernorm.bias": (8,),
                  "mlp.dense_h_to_4h.weight": (32, 8), "mlp.dense_h_to_4h.bias": (32,),
                  "mlp.dense_4h_to_h.weight": (8, 32), "mlp.dense_4h_to_h.bias": (8,)}


def megatron_deepspeed_shapes() -> Dict[str, Tuple[int, ...]]:
    """Megatron-DeepSpeed's GPTModel parameter names (megatron/model/language_model.py,
    transformer.py) for MEGATRON_ARGS."""
    shapes = {"language_model.embedding.word_embeddings.weight": (64, 8),
              "language_model.embedding.position_embeddings.weight": (16, 8)}
    for layer in range(2):
        shapes.update({f"language_model.encoder.layers.{layer}.{k}": v
                       for k, v in MEGATRON_LAYER.items()})
    shapes.update({"language_model.encoder.final_layernorm.weight": (8,),
                   "language_model.encoder.final_layernorm.bias": (8,)})
    return shapes


class NamedLikeMegatronDeepSpeed(torch.nn.Module):
    """Parameters named and shaped as Megatron-DeepSpeed's GPT's (its forward is only a
    differentiable function of them): what `gigatron convert deepspeed-to-gigatron` reads."""

    def __init__(self) -> None:
        super().__init__()
        for name, shape in megatron_deepspeed_shapes().items():
            owner: torch.nn.Module = self
            for part in name.split(".")[:-1]:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(name.split(".")[-1],
                                     torch.nn.Parameter(torch.randn(*shape) * 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(((p - x.mean()) ** 2).mean() for p in self.parameters())


def save_megatron_deepspeed_gpt(initialize: Any, folder: str) -> None:
    """One ZeRO 2 step of the Megatron-DeepSpeed-named model, saved with its Megatron args."""
    torch.manual_seed(5)
    model = NamedLikeMegatronDeepSpeed()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": 2}}
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.backward(engine(torch.ones(2)))
    engine.step()
    engine.save_checkpoint(folder, client_state={"args": argparse.Namespace(**MEGATRON_ARGS),
                                                 "iteration": 1})
    engine.destroy()


def write_universal(folder: str) -> None:
    """DeepSpeed's own converter, as `python -m deepspeed.checkpoint.ds_to_universal` runs it."""
    from deepspeed.checkpoint import ds_to_universal

    argv = ["--input_folder", os.path.join(folder, f"global_step{SAVE_AT}"), "--output_folder",
            os.path.join(folder, UNIVERSAL_TAG), "--num_extract_workers", "1",
            "--num_merge_workers", "1", "--inject_missing_state"]
    saved, sys.argv = sys.argv, ["ds_to_universal"] + argv
    try:
        ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = saved


def run_gigatron(out_dir: str, rank: int, world: int, sources: List[int],
                 fp16: bool) -> Dict[str, Any]:
    """Every case (fp16 only when `fp16`: DeepSpeed wrote it) from every source world size; for
    z1 from one rank, also without the optimizer states and not loaded at all (what the test's
    tolerance must tell apart)."""
    import gigatron

    results = {}
    for source in sources:
        for case in runnable_cases(fp16):
            results[f"{case}@{source}"] = continue_from(gigatron.initialize, out_dir, case,
                                                        source, world, rank)
        # the universal folder: by its tag, and as "load_universal" finds it (latest_universal)
        results[f"{UNIVERSAL_CASE}@{source}-universal"] = continue_from(
            gigatron.initialize, out_dir, UNIVERSAL_CASE, source, world, rank,
            **({"tag": UNIVERSAL_TAG} if source == 1 else {"load_universal": True}))
    folder_case, source = "z1", sources[0]
    results["z1-no-optimizer"] = continue_from(gigatron.initialize, out_dir, folder_case,
                                               source, world, rank, load_optimizer=False)
    results["z1-not-loaded"] = continue_from(gigatron.initialize, out_dir, folder_case, source,
                                             world, rank, load=False)
    return results


def continue_from(initialize: Any, out_dir: str, case: str, source: int, world: int,
                  rank: int, tag: Any = None, load_optimizer: bool = True, load: bool = True,
                  load_universal: bool = False) -> Dict[str, Any]:
    """Load DeepSpeed's checkpoint of `case` saved on `source` ranks; train CONTINUE steps."""
    stage, precision = CASES[case]
    extra = {"checkpoint": {"load_universal": True}} if load_universal else {}
    engine = build(initialize, stage, precision, world, extra)
    if load:
        path, client = engine.load_checkpoint(os.path.join(out_dir, f"ds{source}", case),
                                              tag=tag, load_optimizer_states=load_optimizer)
        assert path is not None and client.get("case") == case, (path, client)
        assert client.get("samples_seen") == 24 and engine.global_steps == SAVE_AT
        assert path.endswith(UNIVERSAL_TAG) == bool(tag or load_universal), path
    scale = float(engine.loss_scale)
    losses, scales = train(engine, SAVE_AT, CONTINUE, rank, world, DTYPES[precision])
    return {"losses": losses, "loss_scale": scale, "scales": scales}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=["deepspeed", "gigatron"])
    parser.add_argument("out_dir")
    parser.add_argument("--sources", default="1,2", help="world sizes whose checkpoints to load")
    parser.add_argument("--no-fp16", action="store_true",
                        help="skip the fp16 case (DeepSpeed refused fp16 on this machine)")
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
                               [int(s) for s in args.sources.split(",")], not args.no_fp16)
    write_results(os.path.join(args.out_dir, f"{args.framework}{world}.rank{rank}.json"),
                  results)
    if dist.is_initialized():  # gigatron runs a world of one without a process group
        leave_process_group()
    exit_before_interpreter_finalization()


if __name__ == "__main__":
    main()
