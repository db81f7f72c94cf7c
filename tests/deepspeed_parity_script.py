"""One small training run per ZeRO stage, by real DeepSpeed or by gigatron, same numbers in.

    torchrun --standalone --nproc-per-node 2 deepspeed_parity_script.py deepspeed OUT_DIR
    torchrun --standalone --nproc-per-node 2 deepspeed_parity_script.py gigatron OUT_DIR

(or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the test starts
the ranks itself)
Both runs see the same model (fixed seed, fp32), the same per-rank micro-batches and the same
DeepSpeed JSON config; each rank writes OUT_DIR/rank{r}.json with, per stage, every
micro-batch's loss, each step's lr and the final (gathered) parameters, then leaves the
process group and exits before interpreter finalization (see
exit_before_interpreter_finalization).
The same launch then trains DeepSpeed's Muon at every stage (results "muon/<stage>",
muon_config). DeepSpeed torch.compiles its muon_update; the script runs it eagerly (dynamo
disabled: the same operations, without minutes of C++ compilation on 2 cores).
tests/test_deepspeed_parity.py compares the two. gigatron is reached only through its
top-level API, so the script keeps working while its modules move.
Extra config keys (e.g. '{"optimizer": {"params": {"lr": 0.02}}}') may be merged in with
--override, which the test uses to check that a different run is told apart.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

STAGES = (0, 1, 2, 3)
STEPS = 6
ACCUMULATION = 2
MICRO_BATCH = 4
IN, HIDDEN, OUT = 8, 32, 4


class SmallNet(nn.Module):
    """An MLP with a LayerNorm that returns its own MSE loss, as DeepSpeed examples do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN),
                                 nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


def ds_config(stage: int) -> Dict[str, Any]:
    """Adam with decoupled weight decay (torch's), log warm-up, clipping that bites."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": 0.5,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": 0.1,
                                                  "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001,
                                                     "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 4}},
        "zero_optimization": {"stage": stage},
    }


def muon_config(stage: int) -> Dict[str, Any]:
    """DeepSpeed's Muon with an lr per half (the warm-up without a max lr keeps each group's
    own), torch's AdamW for the other half; DeepSpeed refuses Muon with ZeRO-3's
    reduce_scatter (its default), so it is off (gigatron accepts either)."""
    config = ds_config(stage)
    config["optimizer"] = {"type": "Muon", "params": {
        "lr": 0.01, "muon_lr": 0.02, "adam_lr": 0.005, "momentum": 0.9, "weight_decay": 0.1,
        "betas": [0.9, 0.95], "eps": 1e-8, "torch_adam": True}}
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001,
                                                         "warmup_num_steps": 4}}
    config["zero_optimization"]["reduce_scatter"] = False
    return config


def merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    for key, value in extra.items():
        base[key] = merge(dict(base.get(key, {})), value) if isinstance(value, dict) else value
    return base


def micro_batch(rank: int, index: int) -> List[torch.Tensor]:
    """The same data for both frameworks: a function of (rank, micro-batch index) only."""
    g = torch.Generator().manual_seed(1000 * rank + index)
    x = torch.randn(MICRO_BATCH, IN, generator=g)
    return [x, torch.sin(3 * x[:, :OUT]) + 0.1 * torch.randn(MICRO_BATCH, OUT, generator=g)]


def full_parameters(framework: str, engine: Any, stage: int) -> Dict[str, List[float]]:
    """Every parameter, whole on every rank (ZeRO-3 gathers them first)."""
    if framework == "gigatron":
        state = engine.module_state_dict()
    else:
        import deepspeed

        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {k: v.float().flatten().tolist() for k, v in state.items()}


def train(framework: str, initialize: Any, stage: int, rank: int,
          override: Dict[str, Any], config: Any = ds_config) -> Dict[str, Any]:
    torch.manual_seed(1234)
    model = SmallNet()
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(),
                                 config=merge(config(stage), override))
    losses, lrs, norms = [], [], []
    for index in range(STEPS * ACCUMULATION):
        loss = engine(*micro_batch(rank, index))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if (index + 1) % ACCUMULATION == 0:
            lrs.append(engine.get_lr()[0])
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
    result = {"losses": losses, "lrs": lrs, "grad_norms": norms,
              "parameters": full_parameters(framework, engine, stage)}
    if hasattr(engine, "destroy"):
        engine.destroy()  # DeepSpeed: drop ZeRO-3's hooks before the next stage's engine
    return result


def write_results(path: str, results: Dict[str, Any]) -> None:
    """Whole or absent: a rank that dies while writing leaves no JSON to be read as complete."""
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump(results, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def leave_process_group() -> None:
    """Every peer is done with its collectives before any rank lets its groups go."""
    dist.barrier()
    dist.destroy_process_group()


def exit_before_interpreter_finalization() -> None:
    """Exit 0 without interpreter finalization, which a live gloo worker thread can abort.

    A gloo worker that finishes a collective frees the op's tensors, and a tensor with a
    Python object takes the GIL to drop it (TensorImpl::decref_pyobject, torch 2.13). Once
    finalization has begun, Python 3.11 ends such a thread with pthread_exit, whose unwinding
    through the noexcept work destructor calls std::terminate: "terminate called without an
    active exception", SIGABRT after complete results (CI: DeepSpeed's rank 0 exited -6).
    destroy_process_group does not stop those threads: they live until the C++ group is
    freed, and here groups outlive it (DeepSpeed keeps them in deepspeed.utils.groups.
    _WORLD_GROUP, its engines and ZeRO-3 parameters' ds_process_group; a gigatron run's
    workers outlived it too). So with the results on disk, the groups left and the output
    flushed, the process ends here; atexit handlers are skipped (gigatron's would leave the
    group again and send its watchdog's last beat).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=["deepspeed", "gigatron"])
    parser.add_argument("out_dir")
    parser.add_argument("--override", default="{}", help="JSON merged into every config")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.framework == "deepspeed":
        import deepspeed

        # Its CPU accelerator JIT-compiles a shared-memory all-reduce (~75 s on 2 cores) at
        # init_distributed; only inference and tensor-parallel layers call it, never training,
        # so mark it unavailable, as DeepSpeed does itself where it cannot be built.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        from torch._dynamo import config as dynamo_config

        dynamo_config.disable = True  # Muon's torch.compile: see the docstring
        deepspeed.init_distributed(dist_backend="gloo")
        initialize = deepspeed.initialize
    else:
        import gigatron

        gigatron.init_distributed(dist_backend="gloo")
        initialize = gigatron.initialize
    rank = int(os.environ["RANK"])
    override = json.loads(args.override)
    results = {str(stage): train(args.framework, initialize, stage, rank, override)
               for stage in STAGES}
    results.update({f"muon/{stage}": train(args.framework, initialize, stage, rank, override,
                                           muon_config) for stage in STAGES})
    write_results(os.path.join(args.out_dir, f"rank{rank}.json"), results)
    print(f"rank {rank}: results written", flush=True)
    leave_process_group()
    print(f"rank {rank}: process group left", flush=True)
    exit_before_interpreter_finalization()


if __name__ == "__main__":
    main()
