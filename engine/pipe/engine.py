"""PipelineEngine: DeepSpeed's pipeline engine API over gigatron's one executor.

    engine, _, _, _ = gigatron.initialize(model=pipeline_module, config=ds_config)
    for step in range(steps):
        loss = engine.train_batch(data_iter)   # gradient_accumulation_steps micro-batches
    loss = engine.eval_batch(eval_iter)

`train_batch` reads gradient_accumulation_steps micro-batches, each an (inputs, labels)
pair as DeepSpeed's: inputs feed the first stage, labels the loss on the last (middle
stages read nothing); without `data_iter` they come from the loader built over
`training_data` (each data-parallel replica its share, repeated pass after pass). It runs
the schedule pretrain_gpt runs (1F1B, interleaved 1F1B with virtual_stages > 1, or zb-h1 or
zbv with PipelineModule(schedule=...); under zbv's V the loss is on the first stage) through
`gigatron.parallel.pipeline.PipelineExecutor`, with ZeRO (stages 0-2) as its grad sync,
then the optimizer and lr scheduler step; it returns the step's mean loss over its
micro-batches and data-parallel replicas on every rank, as DeepSpeed's does.

Shapes: before the first batch, one micro-batch walks through the stages to learn the shape
of every activation (`gigatron.parallel.pipeline.shaped_p2p`); they must not change after.
Float inputs are cast to the model's dtype (fp16/bf16); labels only move to the device.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch

from gigatron.training.config.deepspeed.engine_config import EngineConfig
from gigatron.engine.deepspeed.distributed import DistributedContext
from gigatron.engine.deepspeed.engine import Engine
from gigatron.engine.pipe.micro_batch_step import PipeModuleStep
from gigatron.engine.pipe.specs import preserved_rng
from gigatron.parallel import comm, timeline
from gigatron.parallel.pipeline.executor import Payload, PipelineExecutor
from gigatron.parallel.pipeline.schedules import (Instruction, ScheduleNames, build_schedule,
                                                  check_num_microbatches, placement_of,
                                                  stage_position)
from gigatron.parallel.pipeline.shaped_p2p import ShapedP2P, discover_shapes
from gigatron.parallel.zero import ZeroOptimizer

if TYPE_CHECKING:
    from gigatron.engine.pipe.module import PipelineModule

_ONLY_BATCHES = ("{} is not available in pipeline mode: a PipelineModule trains through "
                 "engine.train_batch(data_iter) (DeepSpeed's rule); evaluate with "
                 "engine.eval_batch(data_iter)")


class PipelineEngine(Engine):
    """A PipelineModule trained with pipeline, data parallelism and ZeRO (DeepSpeed's API)."""

    def __init__(self, module: "PipelineModule", zero: ZeroOptimizer, config: EngineConfig,
                 ctx: DistributedContext, lr_scheduler: Any = None,
                 training_dataloader: Any = None) -> None:
        super().__init__(module, zero, config, ctx, lr_scheduler, training_dataloader)
        self.pipe = module
        self.num_stages, self.stage_id = module.num_stages, module.stage_id
        last = module.num_stages * module.virtual_stages - 1  # the virtual stage with the loss
        self._holds_loss = stage_position(last, self.num_stages,
                                          module.placement)[0] == self.stage_id
        self.micro_batches = config.gradient_accumulation_steps
        _check_microbatches(self.micro_batches, module, "gradient_accumulation_steps")
        groups = module.groups
        self.p2p = ShapedP2P(ctx.device, groups.pp if groups is not None else None, ctx.rank)
        if module.schedule != "1f1b" and zero.stage == 3:
            raise ValueError(f"PipelineModule(schedule={module.schedule!r}) defers weight "
                             f"gradients past the backward that ZeRO stage 3 gathers "
                             f"parameters for: use zero_optimization.stage 0, 1 or 2")
        self.executor = PipelineExecutor(module.chunks, self.p2p, self.stage_id,
                                         module.pp_ranks, grad_sync=zero,
                                         micro_batch_step=PipeModuleStep(module),
                                         placement=placement_of(module.schedule))
        self._schedules: Dict[Tuple[int, bool], List[Instruction]] = {}
        self._shapes_known = module.num_stages * module.virtual_stages == 1
        self.data_iterator: Optional[Iterator[Any]] = None

    # -- DeepSpeed's pipeline accessors -------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator train_batch() reads when called without one."""
        self.data_iterator = iterator

    def reset_activation_shape(self) -> None:
        """Learn the activation shapes again at the next batch (after the inputs changed
        shape); every rank must call it."""
        self._shapes_known = self.num_stages * self.pipe.virtual_stages == 1
        self.p2p.specs.clear()

    # -- the steps ------------------------------------------------------------------------------
    def train_batch(self, data_iter: Optional[Iterator[Any]] = None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches; the step's
        mean loss (every rank)."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() needs gradients enabled (it was called under "
                               "torch.no_grad()): use eval_batch() to evaluate")
        self.module.train()
        batches = self._read(data_iter, self.micro_batches, "train_batch")
        self._learn_shapes(batches)
        losses = self.executor.run(self._schedule(self.micro_batches, False), batches,
                                   loss_scale=self.zero.loss_scale)
        self.zero.finish_sync()
        with timeline.span("optimizer step"):
            self._take_step({})
        self.micro_steps += self.micro_batches
        return self._mean_over_ranks(losses)

    def eval_batch(self, data_iter: Optional[Iterator[Any]], return_logits: bool = False,
                   compute_loss: bool = True, reduce_output: Optional[str] = "avg",
                   bcast_loss: bool = True,
                   num_micro_batches: Optional[int] = None) -> Optional[torch.Tensor]:
        """Forward only over num_micro_batches (default gradient_accumulation_steps)
        micro-batches: their mean loss, on every rank (`bcast_loss=False`: on the stage with
        the loss only, the last, or the first under zbv; None elsewhere)."""
        if return_logits or not compute_loss or reduce_output != "avg":
            raise ValueError("eval_batch returns the mean loss only: return_logits=True, "
                             "compute_loss=False and reduce_output other than 'avg' are not "
                             "supported")
        n = self.micro_batches if num_micro_batches is None else num_micro_batches
        _check_microbatches(n, self.pipe, "num_micro_batches")
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                batches = self._read(data_iter, n, "eval_batch", default=False)
                self._learn_shapes(batches)
                losses = self.executor.run(self._schedule(n, True), batches)
        finally:
            self.module.train(was_training)
        if bcast_loss:
            return self._mean_over_ranks(losses)
        return self._mean_over_replicas(losses) if self._holds_loss else None

    def _schedule(self, num_microbatches: int, forward_only: bool) -> List[Instruction]:
        key = (num_microbatches, forward_only)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(self.stage_id, self.num_stages,
                                                  num_microbatches, self.pipe.virtual_stages,
                                                  forward_only, self.pipe.schedule,
                                                  _names(self.pipe, "gradient_accumulation_"
                                                                    "steps"))
        return self._schedules[key]

    # -- data -------------------------------------------------------------------------------------
    def _read(self, data_iter: Optional[Iterator[Any]], n: int, caller: str,
              default: bool = True) -> List[Dict[str, Any]]:
        """n micro-batches in the executor's keys; middle stages read nothing."""
        if not (self.is_first_stage() or self._holds_loss):
            return [{} for _ in range(n)]
        if data_iter is None and default:
            data_iter = self._default_iterator()
        if data_iter is None:
            raise ValueError(f"{caller}(data_iter) needs an iterator of (inputs, labels) "
                             f"micro-batches" + (", or training_data= at gigatron.initialize"
                                                 if default else ""))
        batches = []
        for i in range(n):
            try:
                item = next(data_iter)
            except StopIteration:
                raise RuntimeError(f"{caller}: the data iterator ran out after {i} of the "
                                   f"step's {n} micro-batches") from None
            batches.append(self._to_executor(item, caller))
        return batches

    def _default_iterator(self) -> Optional[Iterator[Any]]:
        if self.data_iterator is None and self.training_dataloader is not None:
            self.data_iterator = _repeating(self.training_dataloader)
        return self.data_iterator

    def _to_executor(self, item: Any, caller: str) -> Dict[str, Any]:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"{caller}: each micro-batch must be an (inputs, labels) pair, as "
                             f"DeepSpeed's pipeline engine reads them; got "
                             f"{type(item).__name__}" + (f" of {len(item)}" if isinstance(
                                 item, (tuple, list)) else ""))
        inputs, labels = item
        batch: Dict[str, Any] = {}
        if self.is_first_stage():
            batch["input_ids"] = _to_device(inputs, self.device, self.dtype)
        if self._holds_loss:
            batch["labels"] = _to_device(labels, self.device, None)
        return batch

    def _learn_shapes(self, batches: List[Dict[str, Any]]) -> None:
        """The shape handshake, once: stage outputs for the first micro-batch."""
        if self._shapes_known:
            return
        first = batches[0].get("input_ids") if self.is_first_stage() else None
        discover_shapes(self.p2p, self._dry_forward, first, self.stage_id, self.pipe.pp_ranks,
                        self.pipe.virtual_stages, self.pipe.placement)
        self._shapes_known = True

    def _dry_forward(self, chunk: int, inputs: Payload) -> Payload:
        """A stage's forward that changes nothing: no grad, generators and buffers (batch
        norm statistics) restored, micro-batch count unchanged."""
        stage = self.pipe.chunks[chunk]
        buffers = [(b, b.detach().clone()) for b in stage.buffers()]
        offset = stage.micro_offset
        try:
            with torch.no_grad(), preserved_rng(self.device):
                if self.is_first_stage() and chunk == 0:
                    return stage(input_ids=inputs)
                return stage(hidden_states=inputs)
        finally:
            stage.micro_offset = offset
            for buffer, saved in buffers:
                buffer.copy_(saved)

    # -- losses --------------------------------------------------------------------------------
    def _mean_over_ranks(self, losses: List[torch.Tensor]) -> torch.Tensor:
        """The micro-batches' mean loss averaged over the last stage's ranks, on every rank."""
        dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        terms = torch.zeros(2, dtype=dtype, device=self.device)
        if losses:
            terms[0] = torch.stack(losses).mean().to(dtype)
            terms[1] = 1.0
        comm.all_reduce(terms)
        return (terms[0] / terms[1]).to(torch.float32)

    def _mean_over_replicas(self, losses: List[torch.Tensor]) -> torch.Tensor:
        mean = torch.stack(losses).mean().float()
        groups = self.pipe.groups
        if groups is not None and groups.size("dp") > 1:
            comm.all_reduce(mean, group=groups.dp)
            mean /= groups.size("dp")
        return mean

    # -- checkpoints (engine/deepspeed/checkpoint.py) ------------------------------------------
    def checkpoint_layout(self) -> Tuple[Dict[str, int], Dict[str, int]]:
        topology = self.pipe.topology()
        return (topology.coords(self.global_rank),
                {"tp": topology.tp, "pp": topology.pp, "dp": topology.dp})

    def checkpoint_extra_state(self) -> Dict[str, Any]:
        """Every stage has run each micro-batch forward once, whatever the layout: with
        seed_layers the dropout seeds follow that count, so a resumed run draws on."""
        return {"micro_offset": self.pipe.chunks[0].micro_offset}

    def load_checkpoint_extra_state(self, state: Dict[str, Any]) -> None:
        for stage in self.pipe.chunks:
            stage.micro_offset = int(state.get("micro_offset", stage.micro_offset))

    # -- DeepSpeed's engine calls that a pipeline does not take --------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        raise RuntimeError(_ONLY_BATCHES.format("engine(inputs) / forward()"))

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        raise RuntimeError(_ONLY_BATCHES.format("engine.backward()"))

    def step(self, lr_kwargs: Optional[Dict[str, Any]] = None) -> None:
        raise RuntimeError(_ONLY_BATCHES.format("engine.step()"))


def _names(module: "PipelineModule", what: str) -> ScheduleNames:
    """The schedules' settings in DeepSpeed's (and PipelineModule's) words."""
    return ScheduleNames(microbatches=what, pp="num_stages",
                         virtual=f"virtual_stages={module.virtual_stages}",
                         fix=f"change {what} or build the PipelineModule with virtual_stages=1",
                         schedule="PipelineModule(schedule=...)")


def _check_microbatches(n: int, module: "PipelineModule", what: str) -> None:
    """The schedules' rule on a step's micro-batches, in DeepSpeed's words."""
    check_num_microbatches(n, module.num_stages, module.virtual_stages, _names(module, what))


def _to_device(value: Any, device: torch.device, float_dtype: Optional[torch.dtype]) -> Any:
    if isinstance(value, torch.Tensor):
        dtype = float_dtype if float_dtype is not None and value.is_floating_point() else None
        return value.to(device, dtype=dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_to_device(v, device, float_dtype) for v in value)
    return value


def _repeating(loader: Any) -> Iterator[Any]:
    """DeepSpeed's RepeatingLoader: pass after pass (a new shuffle each)."""
    while True:
        yield from loader
