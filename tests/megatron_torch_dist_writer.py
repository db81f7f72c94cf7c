"""Megatron-Core trains a tiny GPTModel on CPU ranks and saves a torch_dist checkpoint the way
Megatron-LM's save_checkpoint does (megatron.training is not installed: its state dict is
rebuilt here from megatron/training/checkpointing.py's generate_state_dict): args (with
consumed_train_samples), iteration, checkpoint_version, the model's and the optimizer's
sharded state dicts, opt_param_scheduler, a sharded rng_state; the tracker on rank 0.

Only imported when megatron.core is importable. Besides tests/megatron_reference.py's shims,
Megatron-Core's optimizer assumes CUDA where a CPU step reaches: it checks
`param.type() == 'torch.cuda.FloatTensor'`, allocates small buffers on device='cuda' and
creates CUDA streams. `optimizer_shims` answers those on the CPU in the forked worker. Its
checkpoint writer forks a writer process (not allowed from the test's daemonic workers
unless told) and collects results through a spawned Manager's queue (replaced by a plain
queue: a synchronous save collects in this process).
"""
from __future__ import annotations

import functools
import multiprocessing
import os
import queue
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

import megatron_reference

LR, WEIGHT_DECAY = 1e-3, 0.1


def optimizer_shims() -> None:
    """Megatron-Core's optimizer on the CPU (see the module doc); forked workers only."""
    tensor_type = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return tensor_type(self, *args, **kwargs)
        return tensor_type(self).replace("torch.", "torch.cuda.", 1)
    torch.Tensor.type = cuda_type  # type: ignore[method-assign]
    torch.cuda.Stream = lambda *a, **k: None  # type: ignore[assignment, misc]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

    def on_cpu(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)
        return wrapped
    for name in ("tensor", "zeros", "empty", "ones", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]


def _loss(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Megatron's LM loss of one micro-batch: masked token cross-entropy, averaged."""
    tokens = batch["tokens"]
    s = tokens.shape[1]
    mask = torch.triu(torch.ones(s, s), diagonal=1).bool()[None, None]
    logits = model(tokens, batch["position_ids"], mask)
    losses = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                             reduction="none")
    loss_mask = batch["loss_mask"].flatten()
    return (losses * loss_mask).sum() / loss_mask.sum()


def save(root: str, iteration: int, args: Any, model: torch.nn.Module, optimizer: Any,
         scheduler: OptimizerParamScheduler, sharding_type: Optional[str]) -> None:
    """Megatron-LM's save_checkpoint for ckpt_format torch_dist."""
    model_state = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": sharding_type} if sharding_type else None
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": model_state,
             "optimizer": optimizer.sharded_state_dict(model_state, metadata=metadata),
             "opt_param_scheduler": scheduler.state_dict(),
             "rng_state": ShardedObject(
                 "rng_state", [{"random_rng_state": torch.get_rng_state()}],
                 (args.pipeline_model_parallel_size, args.tensor_model_parallel_size),
                 (pp_rank, tp_rank), replica_id=parallel_state.get_data_parallel_rank()),
             "num_floating_point_operations_so_far": 0}
    folder = os.path.join(root, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, folder)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def train_and_save(rank: int, world_size: int, args: Any, batches: List[Dict[str, torch.Tensor]],
                   saves: Dict[str, Optional[str]], save_after: int, distributed: bool
                   ) -> Optional[Dict[str, Any]]:
    """On one forked rank: train on `batches` with Megatron-Core's optimizer (distributed or
    not) and scheduler, save after `save_after` iterations (one checkpoint per root in
    `saves`, each with its optimizer sharding type), train on. Returns on rank 0 every
    iteration's loss and the logits of batch 0's tokens at the save."""
    megatron_reference.init_parallel(args)
    optimizer_shims()
    chunk = megatron_reference.build_chunk(args, None)
    megatron_reference.randomize([chunk], seed=7)
    model = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, grad_reduce_in_fp32=True), chunk)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, min_lr=0.0, weight_decay=WEIGHT_DECAY, clip_grad=1.0,
        use_distributed_optimizer=distributed, params_dtype=torch.float32), [model])
    gbs = batches[0]["tokens"].shape[0]
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=0.0, lr_warmup_steps=0,
        lr_decay_steps=len(batches) * gbs, lr_decay_style="constant", start_wd=WEIGHT_DECAY,
        end_wd=WEIGHT_DECAY, wd_incr_steps=len(batches) * gbs, wd_incr_style="constant")
    losses, logits = [], None
    for i, batch in enumerate(batches):
        if i == save_after:
            args.consumed_train_samples, args.consumed_valid_samples = i * gbs, 0
            for root, sharding_type in saves.items():
                save(root, i, args, chunk, optimizer, scheduler, sharding_type)
            with torch.no_grad():
                s = batches[0]["tokens"].shape[1]
                logits = chunk(batches[0]["tokens"], batches[0]["position_ids"],
                               torch.triu(torch.ones(s, s), diagonal=1).bool()[None, None])
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = _loss(model, batch)
        loss.backward()
        model.finish_grad_sync()
        assert optimizer.step()[0], "Megatron-Core's optimizer skipped a step"
        scheduler.step(increment=gbs)
        losses.append(loss.item())
    parallel_state.destroy_model_parallel()
    return {"losses": losses, "logits": logits} if rank == 0 else None


def save_weights(rank: int, world_size: int, args: Any, root: str, tokens: torch.Tensor
                 ) -> Optional[torch.Tensor]:
    """On one forked rank: this rank's random chunk saved as Megatron-LM saves torch_dist,
    with its distributed optimizer's state (dp_reshardable) after a step of zero gradients
    (no weight decay: the fp32 mains stay the weights); the full logits on the last stage's
    tp rank 0."""
    megatron_reference.init_parallel(args)
    optimizer_shims()
    chunk = megatron_reference.build_chunk(args, None)
    chunk.eval()
    megatron_reference.randomize([chunk], seed=7)
    folder = os.path.join(root, "iter_0000005")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    model = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), chunk)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, weight_decay=0.0, use_distributed_optimizer=True,
        bf16=args.bf16, params_dtype=args.params_dtype), [model])
    for inner in optimizer.chained_optimizers:  # a step of zero gradients: states exist
        inner._init_optimizer_states_with_dummy_values()
    model_state = chunk.sharded_state_dict()
    dist_checkpointing.save({"args": args, "checkpoint_version": 3.0, "iteration": 5,
                             "model": model_state,
                             "optimizer": optimizer.sharded_state_dict(
                                 model_state, metadata={"distrib_optim_sharding_type":
                                                        "dp_reshardable"})}, folder)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("5")
    logits = megatron_reference.forward_logits([chunk], tokens, args)
    keep = logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0
    parallel_state.destroy_model_parallel()
    return logits if keep else None
