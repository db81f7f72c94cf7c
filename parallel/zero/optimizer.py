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

DeepSpeed's way (gigatron.initialize): the user's groups and optimizer,

    zero = build_zero(model, config, param_groups=[{"params": [...], "lr": 1e-3}, ...],
                      optimizer=OptimizerSpec("lamb") or torch_optimizer or factory)

see param_groups.py for what is trained and optimizers.py for what is built.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Callable, ContextManager, Iterator, List, Optional,
                    Sequence, Tuple, Union)

import torch
from torch import nn

from gigatron.parallel import comm
from gigatron.parallel.zero.config import ZeroConfig, zero3_pipeline_problem
from gigatron.parallel.zero.flat_group import FlatGroup
from gigatron.parallel.zero.fp8_gather import FP8ParamGather
from gigatron.parallel.zero.grad_norm import (clip_coefficient, count_zeros, counts_in_norm,
                                             global_norm_and_nonfinite)
from gigatron.parallel.zero.bucketed_grad_sync import BucketedGradSync
from gigatron.parallel.zero.lamb import Lamb, TrustRatioLayout
from gigatron.parallel.zero.layout import shard_pieces
from gigatron.parallel.zero.loss_scaler import DynamicLossScaler, LossScaler
from gigatron.parallel.zero.offload import OffloadStep
from gigatron.parallel.zero.muon.build import (build_deepspeed_muon, build_muon, rule_of,
                                              tagged_rule_of, updates_into_grads)
from gigatron.parallel.zero.param_gather import OverlappedParamGather
from gigatron.parallel.zero.optimizers import (OptimizerArg, OptimizerSpec, build_optimizer,
                                              make_optimizer, spec_from_zero_config)
from gigatron.parallel.zero.param_groups import (FlatGroupPlan, ModelParameters, UserGroup,
                                                 check_in_model, groups_of_optimizer,
                                                 plan_flat_groups,
                                                 same_parameters, trainable_in, user_groups)
from gigatron.parallel.zero.stage3 import ParamGatherer, find_units
from gigatron.parallel.zero.zero_state import ZeroCheckpointing
from gigatron.parallel.comm import Group

if TYPE_CHECKING:
    from gigatron.parallel.topology import ProcessGroups



@dataclass
class StepResult:
    """What one optimizer step did, for logging."""

    success: bool
    skipped: bool  # known on the host: fp16 reads its overflow flag, bf16/fp32 never skip
    grad_norm: Optional[torch.Tensor]  # 0-dim, on the device (read it at log time); None if skipped
    loss_scale: float
    num_zeros: Optional[torch.Tensor] = None  # 0-dim, with count_zeros_in_grad (not skipped)


@dataclass
class ZeroGroups:
    """The process groups and coordinates ZeRO needs (from ProcessGroups or given directly)."""

    dp: object = None
    tp: object = None
    expert_dp: Group = None  # the expert-data-parallel group ("edp"); None: no experts
    expert_tp: Group = None  # the expert-tensor-parallel group ("etp"; Muon gathers over it)
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
    expert_dp = groups["edp"] if groups.expert is not None else None
    expert_tp = groups["etp"] if groups.expert is not None else None
    # context-parallel ranks share the model too: dense grads are reduced over dp x cp
    return ZeroGroups(dp=groups["dp-cp"], tp=groups.tp, embedding=embedding,
                      expert_dp=expert_dp, expert_tp=expert_tp, tp_rank=groups.index("tp"),
                      pp_rank=groups.index("pp"), pp_size=groups.size("pp"))


def build_zero(model_chunks: Union[nn.Module, Sequence[nn.Module]], config: ZeroConfig,
               groups: Union["ProcessGroups", ZeroGroups, None] = None,
               dp_group: Group = None, *, param_groups: Optional[ModelParameters] = None,
               optimizer: Optional[OptimizerArg] = None) -> "ZeroOptimizer":
    """Wrap the model chunks' parameters in ZeRO buffers; `groups` is a ProcessGroups (or a
    ZeroGroups); with neither, `dp_group` alone (None = the whole world) is used.

    With neither `param_groups` nor `optimizer`, Megatron's way: every trainable parameter,
    decay on 2+-dim weights, the optimizer from config's fields. Otherwise DeepSpeed's:
    `param_groups` is initialize's `model_parameters` (default: all trainable parameters in
    one group), `optimizer` an OptimizerSpec, a torch optimizer to adopt (its own groups
    decide membership; `param_groups`, if given, must hold the same parameters) or a callable
    param_groups -> optimizer (default: config's fields, as a spec)."""
    if isinstance(model_chunks, nn.Module):
        model_chunks = [model_chunks]
    if groups is None:
        zg = ZeroGroups(dp=dp_group)
    elif isinstance(groups, ZeroGroups):
        zg = groups
    else:
        zg = zero_groups_from(groups)
    chosen = _chosen_groups(list(model_chunks), param_groups, optimizer)
    return ZeroOptimizer(list(model_chunks), config, zg, chosen, optimizer)


def _chosen_groups(chunks: List[nn.Module], param_groups: Optional[ModelParameters],
                   optimizer: Optional[OptimizerArg]) -> Optional[List[UserGroup]]:
    """The user's groups (DeepSpeed's way), or None for Megatron's."""
    given = None if param_groups is None else user_groups(param_groups)
    if isinstance(optimizer, torch.optim.Optimizer):
        own = groups_of_optimizer(optimizer)
        if given is not None and not same_parameters(given, own):
            raise ValueError("param_groups (model_parameters) and the optimizer passed hold "
                             "different parameters: the optimizer's groups decide what is "
                             "trained, so pass the same parameters or leave param_groups out")
        return own
    if given is None and optimizer is not None:
        return [UserGroup(list({id(p): p for m in chunks for p in m.parameters()}.values()))]
    return given


class ZeroOptimizer(ZeroCheckpointing):
    """Flat ZeRO buffers + gradient sync + torch optimizer on this rank's fp32 master shard."""

    def __init__(self, model_chunks: List[nn.Module], config: ZeroConfig,
                 process_groups: ZeroGroups, user_groups: Optional[List[UserGroup]] = None,
                 optimizer: Optional[OptimizerArg] = None) -> None:
        self.config, self.process_groups, self.chunks = config, process_groups, model_chunks
        self.user_groups = user_groups  # None: Megatron's groups (param_groups.py)
        check_in_model(model_chunks, user_groups)
        self.stage = config.zero_stage
        stages = process_groups.pp_size * len(model_chunks)
        pipelined = zero3_pipeline_problem(self.stage, stages, "zero_stage",
                                           "pp_size x model chunks")
        if pipelined:
            raise ValueError(pipelined)
        self.param_dtype = self._check_dtypes(model_chunks)
        self.scaler = self._make_scaler()
        units = self._units(model_chunks[0]) if self.stage == 3 else None
        # DeepSpeed's "type": "Muon": the engine tagged use_muon and split the user groups
        self._tagged_muon = isinstance(optimizer, OptimizerSpec) and optimizer.type == "muon"
        # one per (chunk, kind, decay) or (chunk, user group, kind): flat buffers
        self.flat_groups: List[FlatGroup] = self._build_groups(model_chunks, units)
        self.optimizer = self._make_optimizer(optimizer)
        if isinstance(self.optimizer, Lamb):
            self.optimizer.set_layout(self._trust_ratio_layout())
        self.gatherer = (ParamGatherer(units, self.flat_groups, process_groups.dp,
                                       config.stage3_prefetch) if self.stage == 3 else None)
        self.grad_sync = BucketedGradSync(
            self.flat_groups, len(model_chunks), self.stage, config.overlap_comm,
            process_groups.tp, process_groups.embedding,
            self.gatherer.on_param_grad if self.gatherer else None)
        self.param_gather = (OverlappedParamGather(self.flat_groups, model_chunks)
                             if config.overlap_param_gather and self.stage in (1, 2) else None)
        self._norm_views = self._counted_views()
        self.count_zeros_in_grad = False  # --log-num-zeros-in-grad: StepResult.num_zeros
        self.offload = (OffloadStep(self.flat_groups, self.optimizer, config.offload_bucket_size)
                        if config.offload_optimizer == "cpu" else None)
        self.skipped_steps = 0
        self.fp8_param_gather: Optional[FP8ParamGather] = None  # set by --fp8-param-gather
        self._before_step: List[Callable[[], None]] = []  # see hold_step

    # ---- construction ---------------------------------------------------------------
    def _check_dtypes(self, chunks: List[nn.Module]) -> torch.dtype:
        dtypes = {p.dtype for m in chunks for p in trainable_in(self.user_groups, m.parameters())}
        if not dtypes:
            raise ValueError("nothing to train: no parameter of the model (or of the param "
                             "groups given) has requires_grad=True")
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
                                 c.min_loss_scale, c.consecutive_hysteresis,
                                 rule=c.loss_scale_rule)

    def _units(self, model: nn.Module) -> List[Tuple[nn.Module, List[nn.Parameter]]]:
        """Stage-3 gather units holding only the parameters ZeRO manages."""
        units = [(m, trainable_in(self.user_groups, ps)) for m, ps in find_units(model)]
        return [(m, ps) for m, ps in units if ps]

    def _build_groups(self, chunks: List[nn.Module], units) -> List[FlatGroup]:
        """Reverse registration order approximates the order backward produces grads, so
        buckets fill front to back (stage 3: the units' order, one bucket run per unit)."""
        if units is not None:
            ordered = [[p for _, ps in units for p in ps]]
            unit_of = {id(p): i for i, (_, ps) in enumerate(units) for p in ps}
        else:
            ordered = [trainable_in(self.user_groups, m.parameters())[::-1] for m in chunks]
        muon = self.config.optimizer == "muon"
        plans = plan_flat_groups(ordered, self.user_groups, self.config.weight_decay,
                                 tagged_rule_of if self._tagged_muon else
                                 rule_of if muon else None)
        self.flat_user_group = [plan.user_group for plan in plans]
        self.flat_rule = [plan.rule for plan in plans]
        return [self._flat_group(plan, None if units is None else
                                 [unit_of[id(p)] for p in plan.params]) for plan in plans]

    def _flat_group(self, plan: FlatGroupPlan, unit_ids: Optional[List[int]]) -> FlatGroup:
        c, ps = self.config, plan.params
        master_device = torch.device("cpu") if c.offload_optimizer == "cpu" else ps[0].device
        # tied embeddings: one bucket per param, so first and last stage shard alike
        bucket_size = 1 if plan.kind == "shared_embedding" else c.reduce_bucket_size
        dp_group, average_over = self.process_groups.dp, None
        if plan.kind == "expert":
            dp_group, average_over = self._expert_dp(), comm.group_size(dp_group)
        return FlatGroup(ps, chunk=plan.chunk, kind=plan.kind, weight_decay=plan.weight_decay,
                         stage=self.stage, dp_group=dp_group,
                         bucket_size=bucket_size, unit_ids=unit_ids,
                         master_device=master_device, reduce_dtype=c.reduce_dtype,
                         average_over=average_over, offloaded=c.offload_optimizer == "cpu")

    def _expert_dp(self) -> Group:
        """The expert-data-parallel group expert weights are reduced and sharded over."""
        if self.process_groups.expert_dp is None:
            raise ValueError("the model has expert-parallel weights but ZeRO was given no "
                             "expert-data-parallel group: build ProcessGroups with "
                             "expert=ExpertTopology(...) (or ZeroGroups(expert_dp=...))")
        return self.process_groups.expert_dp

    def _make_optimizer(self, optimizer: Optional[OptimizerArg]) -> torch.optim.Optimizer:
        """Megatron's path: one torch group per flat group, from config's fields. DeepSpeed's:
        one torch group per user group (its master shards, its options), as DeepSpeed's ZeRO
        flattens each user group, so a scheduler's per-group lists still line up. Muon
        (muon/build.py): one torch group per flat group, matrices apart."""
        if self.config.optimizer == "muon" and optimizer is None:
            return build_muon(self)
        if self._tagged_muon:
            assert isinstance(optimizer, OptimizerSpec)
            return build_deepspeed_muon(self, optimizer)
        if self.user_groups is None:
            return build_optimizer(spec_from_zero_config(self.config),
                                   [{"params": [g.master], "weight_decay": g.weight_decay}
                                    for g in self.flat_groups])
        if optimizer is None:  # user groups, config's optimizer: config's decay by default
            optimizer = dataclasses.replace(spec_from_zero_config(self.config),
                                            weight_decay=self.config.weight_decay)
        torch_groups = [{"params": [g.master for g, u in zip(self.flat_groups,
                                                             self.flat_user_group) if u == i],
                         **group.options} for i, group in enumerate(self.user_groups)]
        built = make_optimizer(optimizer, torch_groups)
        decay_of = {id(p): group.get("weight_decay", 0.0) for group in built.param_groups
                    for p in group["params"]}
        for g in self.flat_groups:  # what the optimizer applies (a factory may override)
            g.weight_decay = float(decay_of[id(g.master)])
        return built

    def _trust_ratio_layout(self) -> TrustRatioLayout:
        """Lamb's per-parameter norms over the shards: each flat group's parameters get
        consecutive slots; stage >= 1 shards are summed over dp."""
        pieces, first = {}, 0
        for g in self.flat_groups:
            pieces[id(g.master)] = [(first + i if i >= 0 else -1, n) for i, n in
                                    shard_pieces(g.buckets, g.numels, g.rank_in_shard)]
            first += len(g.params)
        sharded = any(g.ways > 1 for g in self.flat_groups)
        if sharded and any(g.kind == "expert" for g in self.flat_groups):
            raise ValueError("LAMB with expert parallelism and zero_stage >= 1 is not built "
                             "(its per-parameter norms would sum expert shards over dp, not "
                             "the expert-data-parallel group): use zero_stage 0 or Adam")
        return TrustRatioLayout(pieces, first, group=self.process_groups.dp, reduce=sharded,
                                device=self._device())

    def _counted_views(self) -> List[torch.Tensor]:
        pg = self.process_groups
        views = []
        for g in self.flat_groups:
            if self.stage == 0 and comm.group_rank(g.dp_group) != 0:
                continue  # stage-0 grads are identical over the group: its rank 0 counts them
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
        """The training loop's schedule: every param group's lr becomes lr x its "lr_mult"
        (1 unless the group sets one: Megatron-Core's convention), overriding lrs a user's
        groups started with, as DeepSpeed's schedulers do; nothing else is touched."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def step(self) -> StepResult:
        """Unscale, clip to the global norm, step the shard, publish updated parameters.

        Nothing here waits for the host except fp16's overflow check: the norm, the clip
        coefficient and the update stay on the device. bf16/fp32 never skip a step (as in
        Megatron, no loss scaler, no found-inf check); fp16 reads one flag per step to decide
        the skip and the loss-scale update (DeepSpeed's hysteresis runs on the host)."""
        while self._before_step:
            self._before_step.pop(0)()
        if not self.grad_sync.synced:
            self.finish_sync()
        self.finish_param_sync()  # the step writes the shards a gather in flight reads
        scale = self.scaler.scale
        fp16 = self.param_dtype == torch.float16
        check = [v for g in self.flat_groups for v in g.shard_views] if fp16 else []
        if getattr(self.optimizer, "updates_before_norm", False):  # DeepSpeed's Muon
            if fp16 and bool(global_norm_and_nonfinite([], check, device=self._device())[1]):
                self.scaler.update(True)  # the momentum does not see an overflowed step
                self.skipped_steps += 1
                return StepResult(False, True, None, scale)
            updates_into_grads(self, scale)
        norm, nonfinite = global_norm_and_nonfinite(self._norm_views, check,
                                                    device=self._device())
        if fp16 and bool(torch.logical_or(nonfinite > 0, ~torch.isfinite(norm))):
            self.scaler.update(True)
            self.skipped_steps += 1
            return StepResult(False, True, None, scale)
        zeros = (count_zeros(self._norm_views, device=self._device())
                 if self.count_zeros_in_grad else None)
        if scale != 1.0:
            norm = norm / scale
        factor = (clip_coefficient(norm, self.config.clip_grad) / scale
                  if self.config.clip_grad > 0 else 1.0 / scale)
        if self.offload is not None:  # grads down, weights up, bucket by bucket
            self.offload.step(factor)
        else:
            self._step_on_device(factor)
        if self.param_gather is not None:  # waited by the next forward's pre-hooks
            self.param_gather.launch(copied=self.offload is not None)
        else:
            self._publish_params(copied=self.offload is not None)
        self.scaler.update(False)
        return StepResult(True, False, norm, scale, zeros)

    def hold_step(self, until: Callable[[], None]) -> None:
        """Let the next step write the masters, the optimizer state and the parameters only
        once `until` returned (a background save reading them in place)."""
        self._before_step.append(until)

    def _step_on_device(self, factor: Union[float, torch.Tensor]) -> None:
        """Unscale and clip the grad shards in fp32 (fp16 would underflow) and step the
        masters where they live, beside the grads."""
        for g in self.flat_groups:
            pieces = _fp32(g.grad_shard_pieces())
            if not (isinstance(factor, float) and factor == 1.0):
                for piece in pieces:
                    piece.mul_(factor)
            g.master.grad = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        self.optimizer.step()
        for g in self.flat_groups:
            g.master.grad = None

    def _device(self) -> Optional[torch.device]:
        return self.flat_groups[0].device if self.flat_groups else None

    def _publish_params(self, copied: bool = False) -> None:
        """Updated masters into the parameters (`copied`: the offloaded step already wrote
        this rank's slices); stages 1-2 all-gather them."""
        if self.fp8_param_gather is not None:  # FP8 weights gathered in FP8 (fp8_gather.py)
            self.fp8_param_gather.publish(self.flat_groups)
            return
        self.finish_param_sync()
        handles = [h for g in self.flat_groups for h in g.write_back(copy_master=not copied)]
        for h in handles:
            h.wait()

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers --overlap-param-gather left in flight after the
        step (evaluation and checkpoint saving read the parameters outside a forward)."""
        if self.param_gather is not None:
            self.param_gather.finish()

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Full parameters readable inside (stage 3 gathers them; other stages have them)."""
        self.finish_param_sync()
        if self.gatherer is None:
            yield
        else:
            with self.gatherer.gathered():
                yield


def _fp32(pieces: List[torch.Tensor]) -> List[torch.Tensor]:
    """The grad shard's pieces themselves when fp32, else fp32 copies (as Megatron copies its
    fp16/bf16 main grads into the fp32 main parameters' grads before unscaling)."""
    return pieces if pieces[0].dtype == torch.float32 else [p.float() for p in pieces]
