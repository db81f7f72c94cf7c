"""One rank's model state as `gigatron.parallel.zero` lays it out (exact): parameters,
gradients, fp32 master weights and optimizer moments per ZeRO stage, the routed experts'
part sharded over the expert-data-parallel group, and a split backward's W stash."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import torch

from gigatron.parallel.zero.layout import group_sizes, plan_buckets
from gigatron.training.plan.parameters import ParamSpec

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig
    from gigatron.parallel.zero.config import ZeroConfig


@dataclass(frozen=True)
class ModelStateBytes:
    """What ZeRO holds on one rank (the fields of `measure_memory`), and where."""

    params: int
    grads: int
    master_params: int
    optimizer_state: int
    offloaded: bool = False  # master weights and optimizer state live in host memory

    @property
    def device(self) -> int:
        return self.params + self.grads + (0 if self.offloaded else self.host_side)

    @property
    def host_side(self) -> int:
        return self.master_params + self.optimizer_state


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes of one element of `dtype`."""
    return torch.empty((), dtype=dtype).element_size()



def _ordered(chunks: List[List[ParamSpec]], stage: int) -> Tuple[List[List[ParamSpec]],
                                                                Optional[Dict[str, int]]]:
    """ZeroOptimizer._build_groups' order: reversed registration per chunk; stage 3: the
    gather units (each layer, then the rest) of its single chunk."""
    if stage < 3:
        return [specs[::-1] for specs in chunks], None
    (specs,) = chunks
    unit_of: Dict[str, int] = {}
    layers = [s for s in specs if s.name.startswith("decoder.layers.")]
    for s in layers:
        unit_of[s.name] = int(s.name.split(".")[2])
    rest = [s for s in specs if s.name not in unit_of]
    for s in rest:
        unit_of[s.name] = -1
    order = {index: n for n, index in enumerate(dict.fromkeys(unit_of[s.name]
                                                              for s in layers))}
    order[-1] = len(order)
    unit_ids = {name: order[u] for name, u in unit_of.items()}
    return [layers + rest], unit_ids


def model_state_bytes(chunks: List[List[ParamSpec]], zero: "ZeroConfig", dp: int,
                      params_dtype: torch.dtype, offload_to_host: bool) -> ModelStateBytes:
    """Bytes of one rank's ZeRO buffers for these chunks' parameters (`offload_to_host`:
    the master weights live on another device than the parameters, i.e. optimizer offload
    on a GPU)."""
    from gigatron.training.plan.muon import is_matrix

    stage, width = zero.zero_stage, dtype_bytes(params_dtype)
    ordered, unit_ids = _ordered(chunks, stage)
    params = grads = master = state = 0
    per_element_state = 8 if zero.optimizer in ("adam", "adamw", "muon") else \
        (4 if zero.sgd_momentum else 0)
    for specs in ordered:
        # Muon: its matrices (a momentum, 4 bytes) in flat groups apart from AdamW's tensors
        keyed: Dict[Tuple[str, bool, bool], List[ParamSpec]] = {}
        for s in specs:
            keyed.setdefault((s.kind, s.ndim >= 2, zero.optimizer == "muon" and is_matrix(s)),
                             []).append(s)
        for (kind, _, matrices), group in sorted(keyed.items()):
            bucket_size = 1 if kind == "shared_embedding" else zero.reduce_bucket_size
            buckets = plan_buckets([s.numel for s in group], bucket_size,
                                   dp if stage >= 1 else 1,
                                   None if unit_ids is None else [unit_ids[s.name]
                                                                  for s in group])
            full, shard = group_sizes(buckets)
            params += (shard if stage == 3 else full) * width
            grads += (full if stage <= 1 else shard) * zero.reduce_dtype.itemsize
            aliases = width == 4 and not offload_to_host and \
                (stage in (0, 3) or len(buckets) == 1)
            master += 0 if aliases else shard * 4
            state += shard * (4 if matrices else per_element_state)
    return ModelStateBytes(params, grads, master, state, offloaded=offload_to_host)


def _plus(a: ModelStateBytes, b: ModelStateBytes) -> ModelStateBytes:
    return ModelStateBytes(a.params + b.params, a.grads + b.grads,
                           a.master_params + b.master_params,
                           a.optimizer_state + b.optimizer_state, a.offloaded)


def expert_data_parallel_size(tp: int, dp: int, ep: int, etp: int) -> int:
    """edp: the ranks of a pipeline stage holding the same experts (Megatron-Core's)."""
    if (tp * dp) % (etp * ep):
        raise ValueError(f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size "
                         f"{ep} does not divide tensor x data parallel = {tp} x {dp}")
    return tp * dp // (etp * ep)


def w_stash_bytes(specs: Sequence[ParamSpec], dtype: torch.dtype) -> float:
    """Bytes per token of a chunk's W stash: each deferred linear's input and output
    gradient (parallel/tensor/wgrad.py), as wide as this rank's weight (column-parallel: in,
    gathered under sequence parallelism, and out/tp; row-parallel: in/tp and out)."""
    return dtype_bytes(dtype) * sum(s.shape[0] + s.shape[1] for s in specs if s.deferrable)


def model_state(c: "TransformerConfig", chunks: List[List[ParamSpec]], zero: "ZeroConfig",
                 dp: int, edp: int, offload: bool) -> Tuple[ModelStateBytes,
                                                            Optional[ModelStateBytes]]:
    """(all of one rank's ZeRO state, the routed experts' part of it): expert-parallel
    weights (kind 'expert') are sharded over edp in flat groups of their own, the rest over
    dp (replicated experts too, as the trainer reduces them)."""
    if not any(s.is_expert for specs in chunks for s in specs):
        return model_state_bytes(chunks, zero, dp, c.params_dtype, offload), None
    experts = [[s for s in specs if s.kind == "expert"] for specs in chunks]
    if not any(experts):  # experts replicated over tp: their state as the dense state's
        part = [[s for s in specs if s.is_expert] for specs in chunks]
        return model_state_bytes(chunks, zero, dp, c.params_dtype, offload), \
            model_state_bytes(part, zero, dp, c.params_dtype, offload)
    dense = [[s for s in specs if s.kind != "expert"] for specs in chunks]
    expert_state = model_state_bytes(experts, zero, edp, c.params_dtype, offload)
    return _plus(model_state_bytes(dense, zero, dp, c.params_dtype, offload),
                 expert_state), expert_state
