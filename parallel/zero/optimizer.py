"""ZeroOptimizer: the data-parallel optimizer of the training loop (and grad sync of the executor).

    zero = build_zero(model_chunks, ZeroConfig(zero_stage=1, clip_grad=1.0), groups)
    zero.zero_grad()
    for i, batch in enumerate(micro_batches):            # gradient accumulation
        with zero.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            zero.backward(loss_fn(model, batch) / len(micro_batches))
    result = zero.step()                                  # StepResult(success, skipped, ...)

Under a pipeline schedule pass `zero` as the executor's `grad_sync` (it implements the
`GradSync` protocol), run the schedule with `loss_scale=zero.loss_scale`, then
`zero.finish_sync()` and `zero.step()`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import (TYPE_CHECKING, ContextManager, Dict, Iterator, List, Optional, Sequence,
                    Tuple, Union)

import torch
from torch import nn

from gigatron.parallel import comm
from gigatron.parallel.zero.config import ZeroConfig
from gigatron.parallel.zero.flat_group import FlatGroup
from gigatron.parallel.zero.grad_norm import (clip_coefficient, counts_in_norm,
                                             global_norm_and_nonfinite)
from gigatron.parallel.zero.grad_sync import BucketedGradSync
from gigatron.parallel.zero.loss_scaler import DynamicLossScaler, LossScaler
from gigatron.parallel.zero.stage3 import ParamGatherer, find_units
from gigatron.parallel.comm import Group

if TYPE_CHECKING:
    from gigatron.parallel.topology import ProcessGroups

STATE_FORMAT = "gigatron-zero-v1"


@dataclass
class StepResult:
    """What one optimizer step did, for logging."""

    success: bool
    skipped: bool  # known on the host: fp16 reads its overflow flag, bf16/fp32 never skip
    grad_norm: Optional[torch.Tensor]  # 0-dim, on the device (read it at log time); None if skipped
    loss_scale: float


@dataclass
class ZeroGroups:
    """The process groups and coordinates ZeRO needs (from ProcessGroups or given directly)."""

    dp: object = None
    tp: object = None
    embedding: object = None
    tp_rank: int = 0
    pp_rank: int = 0
    pp_size: int = 1


def zero_groups_from(groups: "ProcessGroups") -> ZeroGroups:
    """Pick ZeRO's groups out of a `gigatron.parallel.topology.ProcessGroups`."""
    try:
        embedding = groups["embedding"]
    except KeyError:  # middle pipeline stages hold no tied embedding
        embedding = None
    return ZeroGroups(dp=groups.dp, tp=groups.tp, embedding=embedding, tp_rank=groups.index("tp"),
                      pp_rank=groups.index("pp"), pp_size=groups.size("pp"))


def build_zero(model_chunks: Union[nn.Module, Sequence[nn.Module]], config: ZeroConfig,
               groups: Union["ProcessGroups", ZeroGroups, None] = None,
               dp_group: Group = None) -> "ZeroOptimizer":
    """Wrap the model chunks' parameters in ZeRO buffers; `groups` is a ProcessGroups (or a
    ZeroGroups); with neither, `dp_group` alone (None = the whole world) is used."""
    if isinstance(model_chunks, nn.Module):
        model_chunks = [model_chunks]
    if groups is None:
        zg = ZeroGroups(dp=dp_group)
    elif isinstance(groups, ZeroGroups):
        zg = groups
    else:
        zg = zero_groups_from(groups)
    return ZeroOptimizer(list(model_chunks), config, zg)


class ZeroOptimizer:
    """Flat ZeRO buffers + gradient sync + torch optimizer on this rank's fp32 master shard."""

    def __init__(self, model_chunks: List[nn.Module], config: ZeroConfig,
                 process_groups: ZeroGroups) -> None:
        self.config, self.process_groups, self.chunks = config, process_groups, model_chunks
        self.stage = config.zero_stage
        if self.stage == 3 and (process_groups.pp_size > 1 or len(model_chunks) > 1):
            raise ValueError(
                "zero_stage 3 with pipeline parallelism is not supported: a pipeline stage "
                "runs many micro-batches' forwards before their backwards, so every layer "
                "would be re-gathered per micro-batch in both directions (num_microbatches x "
                "the communication) to save memory that pp already divides; use zero_stage "
                "<= 2 with --pipeline-model-parallel-size > 1")
        self.param_dtype = self._check_dtypes(model_chunks)
        self.scaler = self._make_scaler()
        self.flat_groups: List[FlatGroup] = []  # one per (chunk, kind, decay): flat buffers
        units = find_units(model_chunks[0]) if self.stage == 3 else None
        for chunk, model in enumerate(model_chunks):
            self._build_groups(chunk, model, units)
        self.optimizer = self._make_optimizer()
        self.gatherer = (ParamGatherer(units, self.flat_groups, process_groups.dp,
                                       config.stage3_prefetch) if self.stage == 3 else None)
        self.grad_sync = BucketedGradSync(
            self.flat_groups, len(model_chunks), self.stage, config.overlap_comm,
            process_groups.tp, process_groups.embedding,
            self.gatherer.on_param_grad if self.gatherer else None)
        self._norm_views = self._counted_views()
        self.skipped_steps = 0

    # ---- construction ---------------------------------------------------------------
    def _check_dtypes(self, chunks: List[nn.Module]) -> torch.dtype:
        dtypes = {p.dtype for m in chunks for p in m.parameters() if p.requires_grad}
        if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
            raise ValueError(f"ZeRO needs all trainable parameters in one of fp32/bf16/fp16, "
                             f"found {sorted(map(str, dtypes))}: build the model with a single "
                             f"params_dtype")
        return dtypes.pop()

    def _make_scaler(self) -> LossScaler:
        c = self.config
        if self.param_dtype != torch.float16:
            return LossScaler(1.0)
        if c.loss_scale > 0:
            return LossScaler(c.loss_scale)
        return DynamicLossScaler(c.initial_scale_power, c.loss_scale_window, c.hysteresis,
                                 c.min_loss_scale, c.consecutive_hysteresis)

    def _build_groups(self, chunk: int, model: nn.Module, units) -> None:
        """Group params by (kind, decay); reverse registration order approximates the order
        backward produces grads, so buckets fill front to back."""
        c = self.config
        if units is not None:
            unit_of = {id(p): i for i, (_, ps) in enumerate(units) for p in ps}
            params = [p for _, ps in units for p in ps]
        else:
            params = [p for p in model.parameters() if p.requires_grad][::-1]
        keyed: Dict[Tuple[str, bool], List[nn.Parameter]] = {}
        for p in params:
            kind = ("shared_embedding" if getattr(p, "shared_embedding", False) else
                    "sequence_parallel" if getattr(p, "sequence_parallel", False) else "default")
            keyed.setdefault((kind, p.dim() >= 2), []).append(p)
        master_device = torch.device("cpu") if c.offload_optimizer == "cpu" else None
        for (kind, decay), ps in sorted(keyed.items()):
            # tied embeddings: one bucket per param, so first and last stage shard alike
            bucket_size = 1 if kind == "shared_embedding" else c.reduce_bucket_size
            unit_ids = [unit_of[id(p)] for p in ps] if units is not None else None
            self.flat_groups.append(FlatGroup(
                ps, chunk=chunk, kind=kind, weight_decay=c.weight_decay if decay else 0.0,
                stage=self.stage, dp_group=self.process_groups.dp, bucket_size=bucket_size,
                unit_ids=unit_ids, master_device=master_device or ps[0].device,
                reduce_dtype=c.reduce_dtype))

    def _make_optimizer(self) -> torch.optim.Optimizer:
        c = self.config
        param_groups = [{"params": [g.master], "weight_decay": g.weight_decay}
                        for g in self.flat_groups]
        if c.optimizer == "sgd":
            return torch.optim.SGD(param_groups, lr=c.lr, momentum=c.sgd_momentum)
        cls = torch.optim.AdamW if c.optimizer == "adamw" else torch.optim.Adam
        return cls(param_groups, lr=c.lr, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps)

    def _counted_views(self) -> List[torch.Tensor]:
        pg = self.process_groups
        if self.stage == 0 and comm.group_rank(pg.dp) != 0:
            return []  # stage-0 grads are identical on every dp rank: dp rank 0 counts them
        views = []
        for g in self.flat_groups:
            counts = [counts_in_norm(p, pg.tp_rank, pg.pp_rank) for p in g.params]
            views += g.counted_views(counts)
        return views

    # ---- per-step API -----------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (multiplied by the fp16 loss scale)."""
        return loss * self.scaler.scale if self.scaler.scale != 1.0 else loss

    def backward(self, loss: torch.Tensor) -> None:
        self.scale_loss(loss).backward()

    def enable_sync(self, chunk: int, enabled: bool) -> None:
        """Pipeline-executor contract: reduce chunk's grads in the coming backward?"""
        self.grad_sync.enable_sync(chunk, enabled)

    def no_sync(self) -> ContextManager[None]:
        """Context for all but the last micro-batch of gradient accumulation."""
        return self.grad_sync.no_sync()

    def finish_sync(self) -> None:
        """Pipeline-executor contract: all dp, embedding and sequence-parallel reductions done."""
        self.grad_sync.finish_sync()
        if self.gatherer is not None:
            self.gatherer.release_all()

    def zero_grad(self) -> None:
        for g in self.flat_groups:
            g.zero_grad()
        self.grad_sync.new_step()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> StepResult:
        """Unscale, clip to the global norm, step the shard, publish updated parameters.

        Nothing here waits for the host except fp16's overflow check: the norm, the clip
        coefficient and the update stay on the device. bf16/fp32 never skip a step (as in
        Megatron, no loss scaler, no found-inf check); fp16 reads one flag per step to decide
        the skip and the loss-scale update (DeepSpeed's hysteresis runs on the host)."""
        if not self.grad_sync.synced:
            self.finish_sync()
        scale = self.scaler.scale
        fp16 = self.param_dtype == torch.float16
        check = [v for g in self.flat_groups for v in g.shard_views] if fp16 else []
        norm, nonfinite = global_norm_and_nonfinite(self._norm_views, check,
                                                    device=self._device())
        if fp16 and bool(torch.logical_or(nonfinite > 0, ~torch.isfinite(norm))):
            self.scaler.update(True)
            self.skipped_steps += 1
            return StepResult(False, True, None, scale)
        if scale != 1.0:
            norm = norm / scale
        factor = (clip_coefficient(norm, self.config.clip_grad) / scale
                  if self.config.clip_grad > 0 else 1.0 / scale)
        for g in self.flat_groups:
            if not (isinstance(factor, float) and factor == 1.0):
                for view in g.shard_views:
                    view.mul_(factor)
            flat = g.flat_grad_shard()
            g.master.grad = flat.to(g.master.device) if flat.device != g.master.device else flat
        self.optimizer.step()
        for g in self.flat_groups:
            g.master.grad = None
        self._publish_params()
        self.scaler.update(False)
        return StepResult(True, False, norm, scale)

    def _device(self) -> Optional[torch.device]:
        return self.flat_groups[0].device if self.flat_groups else None

    def _publish_params(self) -> None:
        handles = [h for g in self.flat_groups for h in g.write_back()]
        for h in handles:
            h.wait()

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Full parameters readable inside (stage 3 gathers them; other stages have them)."""
        if self.gatherer is None:
            yield
        else:
            with self.gatherer.gathered():
                yield

    # ---- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard: master weights, optimizer state, loss scaler."""
        return {"format": STATE_FORMAT, "zero_stage": self.stage,
                "dp_size": comm.group_size(self.process_groups.dp),
                "dp_rank": comm.group_rank(self.process_groups.dp),
                "layout": [(g.chunk, g.kind, g.full_numel, g.shard_numel)
                           for g in self.flat_groups],
                "master": [g.master.detach().cpu().clone() for g in self.flat_groups],
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore this rank's shard and refresh the model parameters from it."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a ZeRO optimizer checkpoint (format {state.get('format')!r})")
        here = [(g.chunk, g.kind, g.full_numel, g.shard_numel) for g in self.flat_groups]
        dp = comm.group_size(self.process_groups.dp)
        if state["dp_size"] != dp or [tuple(x) for x in state["layout"]] != here:
            raise ValueError(
                f"the ZeRO checkpoint was saved with dp size {state['dp_size']} and layout "
                f"{state['layout']}; this run has dp size {dp} and layout {here}: resume with "
                f"the same parallel sizes, zero_stage and reduce_bucket_size")
        for g, master in zip(self.flat_groups, state["master"]):
            g.load_master(master)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._publish_params()
