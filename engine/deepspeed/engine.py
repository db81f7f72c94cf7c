"""Engine: DeepSpeed's engine API over gigatron's ZeRO, for any nn.Module.

    engine(x) -> forward;  engine.backward(loss);  engine.step()   # every micro-batch

`backward` divides the loss by gradient_accumulation_steps (DeepSpeed's scale_wrt_gas) and
defers the data-parallel reduction on all but the boundary micro-batch (`ZeroOptimizer.
no_sync`); `step` steps the optimizer only at the boundary, then the lr scheduler (not on
an fp16-skipped step, as DeepSpeed), and counts global_steps. Everything numeric is the
ZeRO optimizer's: one implementation shared with pretrain_gpt.py.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from gigatron.training.config.deepspeed.engine_config import EngineConfig
from gigatron.engine.deepspeed.distributed import DistributedContext
from gigatron.parallel import comm, timeline
from gigatron.parallel.zero import StepResult, ZeroOptimizer

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Engine(nn.Module):
    """A model trained with ZeRO, mixed precision and gradient accumulation (DeepSpeed's API)."""

    def __init__(self, module: nn.Module, zero: ZeroOptimizer, config: EngineConfig,
                 ctx: DistributedContext, lr_scheduler: Any = None,
                 training_dataloader: Any = None) -> None:
        super().__init__()
        self.module = module
        self.zero, self.config, self.ctx = zero, config, ctx
        self.optimizer = zero.optimizer  # a torch optimizer: torch's schedulers accept it
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.device, self.dtype = ctx.device, _DTYPES[config.precision]
        self.local_rank, self.global_rank, self.world_size = (ctx.local_rank, ctx.rank,
                                                              ctx.world_size)
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self._last_step: Optional[StepResult] = None
        self._backward_pending = False
        self._params = _param_signature(module)
        self._checkpoint_calls = {"save_checkpoint": 0, "load_checkpoint": 0}
        zero.zero_grad()
        # $GIGATRON_TIMELINE: every rank records (collective: all ranks build their engine)
        timeline.start_from_env(f"rank {ctx.rank} (dp {ctx.rank})")

    # -- DeepSpeed's accessors ------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the coming step() updates the weights (the last micro-batch of a step)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    def zero_optimization_stage(self) -> int:
        return self.zero.stage

    def get_lr(self) -> List[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        """The last step's gradient norm before clipping (None before the first step or
        after an fp16-skipped one); reading it waits for the device."""
        step = self._last_step
        return None if step is None or step.grad_norm is None else float(step.grad_norm)

    @property
    def loss_scale(self) -> float:
        return self.zero.loss_scale

    # -- the step -------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.zero.stage == 3:
            self._check_parameters_unchanged()
        inputs, kwargs = self._prepare_inputs(inputs, kwargs)
        if not timeline.on:
            return self.module(*inputs, **kwargs)
        start = timeline.now()
        output = self.module(*inputs, **kwargs)
        timeline.record(f"forward mb {self._microbatch()}", start)
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of this micro-batch's loss (divided by gradient_accumulation_steps);
        the gradients are reduced over data-parallel ranks on the boundary micro-batch."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward(loss) needs a scalar loss tensor, got "
                             f"{_describe(loss)}: reduce it (e.g. loss.mean()) first")
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        sync = self.is_gradient_accumulation_boundary()
        start = timeline.now() if timeline.on else 0
        with contextlib.nullcontext() if sync else self.zero.no_sync():
            self.zero.scale_loss(loss).backward(retain_graph=retain_graph)
        if timeline.on:
            timeline.record(f"backward mb {self._microbatch()}", start)
        self._backward_pending = True
        return loss

    def step(self, lr_kwargs: Optional[Dict[str, Any]] = None) -> None:
        """Call after every backward: updates the weights at the accumulation boundary."""
        if not self._backward_pending:
            raise RuntimeError("engine.step() was called before engine.backward(loss): call "
                               "engine.backward(loss) for each micro-batch, then engine.step()")
        self._backward_pending = False
        if self.is_gradient_accumulation_boundary():
            with timeline.span("optimizer step"):
                self._take_step(lr_kwargs or {})
        self.micro_steps += 1

    def _microbatch(self) -> int:
        """This micro-batch's index within the step (the timeline's span names)."""
        return self.micro_steps % self.gradient_accumulation_steps()

    def _take_step(self, lr_kwargs: Dict[str, Any]) -> None:
        result = self.zero.step()
        self._last_step = result
        if result.skipped:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**lr_kwargs)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.zero.zero_grad()
        if self.global_rank == 0 and self.global_steps % self.config.steps_per_print == 0:
            print(f"[gigatron] step={self.global_steps}, skipped={self.skipped_steps}, "
                  f"lr={self.get_lr()}, loss_scale={self.loss_scale:g}", flush=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (step() already does after each update); ZeRO's gradients
        live in flat buffers, so `set_to_none` is accepted and has no effect."""
        self.zero.zero_grad()

    # -- checkpoints (engine/deepspeed/checkpoint.py) --------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None,
                        client_state: Optional[Dict[str, Any]] = None,
                        save_latest: bool = True, **_unused: Any) -> bool:
        """Collective: a layout-free checkpoint (module, optimizer, scheduler, loss scaler,
        counters, RNG, client_state) that any world size and ZeRO stage loads."""
        from gigatron.engine.deepspeed.checkpoint import save

        with timeline.span("checkpoint save"):
            return save(self, save_dir, tag, client_state or {}, save_latest)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        **_unused: Any) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
        """Collective: (checkpoint path, client_state), or (None, None) with no checkpoint."""
        from gigatron.engine.deepspeed.checkpoint import load

        return load(self, load_dir, tag, load_module_strict, load_optimizer_states,
                    load_lr_scheduler_states, load_module_only)

    def checkpoint_layout(self) -> Tuple[Dict[str, int], Dict[str, int]]:
        """This rank's (tp, pp, dp) coordinates and the layout's sizes, for checkpoints."""
        return ({"tp": 0, "pp": 0, "dp": self.global_rank},
                {"tp": 1, "pp": 1, "dp": self.world_size})

    def checkpoint_extra_state(self) -> Dict[str, Any]:
        """What else an engine of this kind needs to resume (a pipeline's: its stages'
        forward count), the same on every rank."""
        return {}

    def load_checkpoint_extra_state(self, state: Dict[str, Any]) -> None:
        """Restore what `checkpoint_extra_state` returned."""

    def next_checkpoint_call(self, what: str) -> int:
        """How many times `what` was called before (ranks agree per call)."""
        n = self._checkpoint_calls[what]
        self._checkpoint_calls[what] = n + 1
        return n

    # -- input checks ---------------------------------------------------------------------
    def _prepare_inputs(self, inputs: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        fix = self.config.auto_cast_inputs or self.config.fp16_auto_cast
        inputs = tuple(self._check_input(f"input {i}", x, fix) for i, x in enumerate(inputs))
        kwargs = {k: self._check_input(f"input {k!r}", v, fix) for k, v in kwargs.items()}
        return inputs, kwargs

    def _check_input(self, name: str, x: Any, fix: bool) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        wrong_device = x.device != self.device and not (
            x.device.type == self.device.type and self.device.index is None)
        wrong_dtype = x.is_floating_point() and x.dtype != self.dtype
        if not (wrong_device or wrong_dtype):
            return x
        if fix:
            return x.to(self.device, dtype=self.dtype if x.is_floating_point() else x.dtype)
        want = f"{self.device}" + (f" in {self.dtype}" if x.is_floating_point() else "")
        raise ValueError(
            f"{name} of the engine's forward is on {x.device} in {x.dtype}, the engine runs on "
            f"{want}: call x.to(engine.device{', dtype=engine.dtype' if wrong_dtype else ''}) "
            f"first, or set \"auto_cast_inputs\": true in the config (a gigatron extension)")

    def _check_parameters_unchanged(self) -> None:
        now = _param_signature(self.module)
        if now != self._params:
            raise RuntimeError(
                "ZeRO stage 3 partitioned the module's parameters at initialize, but the module "
                "now has other parameters (added, removed or replaced since): ZeRO-3 cannot "
                "follow that; build every parameter before gigatron.initialize and never "
                "replace one (use a lower zero_optimization.stage to change the model)")

    def module_state_dict(self) -> Dict[str, Any]:
        """The module's own state dict, full parameters (gathered under ZeRO-3), on the CPU."""
        with self.zero.gathered_parameters():
            return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}


def _param_signature(module: nn.Module) -> List[Tuple[str, int]]:
    return [(name, id(p)) for name, p in module.named_parameters()]


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def broadcast_module(module: nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers (DeepSpeed does the same)."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        comm.broadcast(tensor.data, src=0)
