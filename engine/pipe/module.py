"""`gigatron.pipe.PipelineModule`: DeepSpeed's pipeline-parallel module for users' own models.

    net = PipelineModule(layers=[TiedLayerSpec("embed", Embed, vocab, hidden),
                                 *[LayerSpec(Block, hidden) for _ in range(8)],
                                 TiedLayerSpec("embed", Embed, vocab, hidden,
                                               forward_fn=lambda embed, x: x @ embed.weight.t())],
                         num_stages=2, loss_fn=nn.CrossEntropyLoss(), seed_layers=True)
    engine, _, _, _ = gigatron.initialize(model=net, config=ds_config)
    loss = engine.train_batch(data_iter)          # yields (inputs, labels) micro-batches

DeepSpeed's names, arguments and defaults: the model is a list of layers, each feeding the
next; the list is cut into `num_stages` stages by `partition_method` (see
gigatron.engine.pipe.partition_method) and every rank builds only its stage's layers,
so a model larger than one rank's memory never exists whole. The pipeline size is
`num_stages` (or `topology.pp`, a gigatron.parallel.topology.Topology for tp x dp x pp) and
the data-parallel size is world / (tp x pp); constructing one joins the process group
(`gigatron.init_distributed`) and creates its groups, so every rank must construct it.

gigatron's addition: `virtual_stages=v` cuts the list into num_stages x v stages; rank r
runs stages r, r + num_stages, ... and the engine runs Megatron's interleaved 1F1B
schedule (a smaller bubble; gradient_accumulation_steps must be a multiple of num_stages);
`schedule="zb-h1"` runs the zero-bubble H1 schedule, `schedule="zbv"` the zero-bubble V
schedule on 2 x num_stages chunks placed in a V (rank r: chunks r and 2 num_stages-1-r;
split_backward.py). Layers keep their global index as their name, so checkpoints do not
depend on the placement.
With `seed_layers=True` each layer is built under seed base_seed + its index (a tied
module: its first layer's index), so the initial model is the same for every layout.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from gigatron.engine.deepspeed.distributed import init_distributed
from gigatron.engine.pipe.specs import (LayerSpec, TiedLayerSpec, check_layers, display_name,
                                        set_random_seed, trainable_parameter_count, type_name)
from gigatron.engine.pipe.split_backward import (ZERO_BUBBLE, check_schedule, check_v_ties,
                                                 split_linear_backward)
from gigatron.engine.pipe.stage import PipelineStage
from gigatron.parallel import comm
from gigatron.engine.pipe.partition_method import (describe_partition, partition_by_method,
                                                        stage_of_layer, tied_stages)
from gigatron.parallel.pipeline.schedules import placement_of, stage_position, virtual_stage
from gigatron.parallel.tensor.init import mark_shared_embedding
from gigatron.parallel.topology import ProcessGroups, Topology
from gigatron.training.checkpoint.torch_dist.state import mark_saved_elsewhere

_non_reentrant_checkpoint = functools.partial(checkpoint, use_reentrant=False)


def resolve_topology(num_stages: Optional[int], topology: Optional[Topology],
                     world_size: int, virtual_stages: int = 1) -> Topology:
    """The tp x dp x pp grid from `num_stages` (dp = world / num_stages) or `topology`."""
    if num_stages is None and topology is None:
        raise ValueError("PipelineModule needs num_stages=N or topology=Topology(...) (as "
                         "DeepSpeed's): how many pipeline stages to cut the layers into")
    if topology is not None:
        if not isinstance(topology, Topology):
            raise ValueError(f"PipelineModule(topology=...) takes a gigatron.parallel."
                             f"topology.Topology(tp=, dp=, pp=), got {type(topology).__name__}")
        if num_stages is not None and num_stages != topology.pp:
            raise ValueError(f"PipelineModule: num_stages={num_stages} but the topology has "
                             f"pp={topology.pp}: give one of them")
        if topology.world_size != world_size:
            raise ValueError(f"PipelineModule: the topology has tp*dp*pp = "
                             f"{topology.world_size} ranks but the job has {world_size}")
        num_stages = topology.pp
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"PipelineModule(num_stages={num_stages!r}): it must be a positive "
                         f"integer")
    if world_size % num_stages:
        raise ValueError(f"PipelineModule(num_stages={num_stages}) must divide the world size "
                         f"{world_size} (data parallelism = world / num_stages): launch a "
                         f"multiple of {num_stages} ranks or change num_stages")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"PipelineModule(virtual_stages={virtual_stages!r}) must be a "
                         f"positive integer")
    if virtual_stages > 1 and num_stages == 1:
        raise ValueError(f"PipelineModule(virtual_stages={virtual_stages}) (the interleaved "
                         f"schedule) needs num_stages > 1")
    return topology or Topology.from_world_size(world_size, pp=num_stages)


class PipelineModule(nn.Module):
    """A list of layers cut into pipeline stages; this rank holds and builds its own."""

    def __init__(self, layers: Any, num_stages: Optional[int] = None,
                 topology: Optional[Topology] = None,
                 loss_fn: Optional[Callable[..., torch.Tensor]] = None,
                 seed_layers: bool = False, seed_fn: Optional[Callable[[int], Any]] = None,
                 base_seed: int = 1234, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Optional[Callable[..., Any]] = None,
                 checkpointable_layers: Optional[List[str]] = None,
                 dynamic_shape: bool = False, *, virtual_stages: int = 1,
                 schedule: str = "1f1b") -> None:
        super().__init__()
        specs = check_layers(layers)
        chunks = check_schedule(schedule, virtual_stages)
        self.schedule, self.placement = schedule, placement_of(schedule)
        _check_options(activation_checkpoint_interval, checkpointable_layers, dynamic_shape)
        ctx = init_distributed()
        self._topo = resolve_topology(num_stages, topology, ctx.world_size, virtual_stages)
        self.groups: Optional[ProcessGroups] = (
            ProcessGroups(self._topo, ctx.rank, timeout=ctx.timeout)
            if dist.is_initialized() else None)  # None: a world of one without a launcher
        self.global_rank, self.device = ctx.rank, ctx.device
        coords = self._topo.coords(ctx.rank)
        self.num_stages, self.stage_id, self.virtual_stages = (self._topo.pp, coords["pp"],
                                                               chunks)
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self._checkpoint = (activation_checkpoint_func or _non_reentrant_checkpoint,
                            checkpointable_layers)
        counts = [trainable_parameter_count(layer) for layer in specs]
        self.parts = partition_by_method(partition_method, counts,
                                         [type_name(layer) for layer in specs],
                                         self.num_stages * chunks)
        keys = [layer.key if isinstance(layer, TiedLayerSpec) else None for layer in specs]
        self.tied_stage_map = tied_stages(keys, self.parts)
        check_v_ties(schedule, self.tied_stage_map)
        _check_shared_objects(specs, self.parts)
        if ctx.rank == 0:
            self._print_partition(specs, counts, partition_method)
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: Dict[str, List[str]] = {}
        self._stages = [self._build_stage(specs, virtual_stage(self.stage_id, c,
                                                               self.num_stages, self.placement))
                        for c in range(chunks)]
        self.to(ctx.device)
        self._tie_across_stages()
        if schedule in ZERO_BUBBLE:
            split_linear_backward(self._stages + [self.tied_modules])

    # -- DeepSpeed's accessors --------------------------------------------------------------
    def topology(self) -> Topology:
        return self._topo

    def partitions(self) -> List[int]:
        """Layer index where each (virtual) stage starts, and the number of layers last."""
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline stage (rank coordinate) that builds layer `layer_idx`."""
        return stage_position(stage_of_layer(self.parts, layer_idx), self.num_stages,
                              self.placement)[0]

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    # -- what the engine uses ---------------------------------------------------------------
    @property
    def chunks(self) -> List[PipelineStage]:
        """This rank's virtual stages, in the order the schedules number them, holding the
        modules this PipelineModule holds now (tensor parallelism may have swapped some)."""
        for stage in self._stages:
            for name in [n for n in stage._modules if n != "tied_modules"]:
                stage.add_module(name, self._modules[name])
            for key in list(stage.tied_modules):
                stage.tied_modules[key] = self.tied_modules[key]
        self._mark_tied()
        return list(self._stages)

    @property
    def dp_size(self) -> int:
        return self._topo.dp

    @property
    def dp_rank(self) -> int:
        return self._topo.coords(self.global_rank)["dp"]

    @property
    def pp_ranks(self) -> List[int]:
        """Global rank of each pipeline stage of this rank's pipeline."""
        return self.groups.ranks("pp") if self.groups is not None else [self.global_rank]

    def forward(self, forward_input: Any) -> Any:
        """Run this rank's layers on `forward_input` (the whole model on a single stage);
        training goes through the engine's train_batch()."""
        if len(self._stages) != 1:
            raise RuntimeError("this rank holds several virtual stages: run the model through "
                               "engine.train_batch() / eval_batch()")
        return self._stages[0](hidden_states=forward_input)

    def broadcast_from_data_parallel_source(self) -> None:
        """Every data-parallel replica of this stage starts from dp rank 0's parameters and
        buffers (collective over the dp group)."""
        if self.groups is None:
            return
        source = self.groups.ranks("dp")[0]
        for tensor in list(self.parameters()) + list(self.buffers()):
            comm.broadcast(tensor.data, src=source, group=self.groups.dp)

    # -- construction -----------------------------------------------------------------------
    def _build_stage(self, specs: List[Any], stage: int) -> PipelineStage:
        entries: List[Tuple[int, str, Any]] = []
        modules: Dict[str, nn.Module] = {}
        tied: Dict[str, nn.Module] = {}
        first_use: Dict[Optional[str], int] = {}
        for index, layer in enumerate(specs):
            if isinstance(layer, TiedLayerSpec):
                first_use.setdefault(layer.key, index)
        for index in range(self.parts[stage], self.parts[stage + 1]):
            layer = specs[index]
            if self.seed_layers:
                key = layer.key if isinstance(layer, TiedLayerSpec) else None
                (self.seed_fn or set_random_seed)(self.base_seed + first_use.get(key, index))
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                tied[layer.key] = self.tied_modules[layer.key]
                entries.append((index, "tied", (layer.key, layer.forward_fn)))
                continue
            func = layer.build() if isinstance(layer, LayerSpec) else layer
            if isinstance(func, nn.Module):
                self.add_module(str(index), func)
                modules[str(index)] = func
                entries.append((index, "module", str(index)))
            else:
                entries.append((index, "function", func))
        return PipelineStage(stage, entries, modules, tied, self.seed_layers, self.seed_fn,
                             self.base_seed, self.activation_checkpoint_interval,
                             *self._checkpoint)

    def _tied_across_stages(self) -> List[str]:
        """Keys of this rank's tied modules that live on the first and the last stage."""
        last = len(self.parts) - 2
        return [key for key in sorted(self.tied_stage_map)
                if self.tied_stage_map[key] == [0, last] and key in self.tied_modules]

    def _tie_across_stages(self) -> None:
        """Tied weights on the first and last stage start equal (the first stage's values)."""
        for key in self._tied_across_stages():
            assert self.groups is not None  # two stages: a process group exists
            source = self._topo.rank(**{**self._topo.coords(self.global_rank), "pp": 0})
            for attr in self.tied_weight_attrs[key]:
                comm.broadcast(_attribute(self.tied_modules[key], attr, key).data, src=source,
                               group=self.groups["embedding"])
        self._mark_tied()

    def _mark_tied(self) -> None:
        """Mark them for ZeRO, which sums their gradients over the embedding group; the
        last stage's copy for checkpoints, which save the first stage's only."""
        for key in self._tied_across_stages():
            for attr in self.tied_weight_attrs[key]:
                param = _attribute(self.tied_modules[key], attr, key)
                mark_shared_embedding(param)
                if self.stage_id != 0:
                    mark_saved_elsewhere(param)

    def _print_partition(self, specs: List[Any], counts: List[int], method: str) -> None:
        loss = getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)
        print(f"[gigatron] pipeline partition ({method}, {self.num_stages} stage"
              f"{'s' if self.num_stages > 1 else ''}"
              f"{f' x {self.virtual_stages} virtual' if self.virtual_stages > 1 else ''}, "
              f"{sum(counts):,} trainable parameters, loss: "
              f"{loss if self.loss_fn is not None else 'the last layer'}):\n"
              + describe_partition(self.parts, [display_name(s) for s in specs], counts,
                                   self.num_stages, self.placement), flush=True)


def _attribute(module: nn.Module, name: str, key: str) -> nn.Parameter:
    value: Any = module
    for part in name.split("."):
        value = getattr(value, part, None)
    if not isinstance(value, nn.Parameter):
        raise ValueError(f"TiedLayerSpec {key!r}: tied_weight_attr {name!r} is not a parameter "
                         f"of {type(module).__name__}")
    return value


def _check_options(interval: int, checkpointable_layers: Optional[List[str]],
                   dynamic_shape: bool) -> None:
    if not isinstance(interval, int) or interval < 0:
        raise ValueError(f"activation_checkpoint_interval must be an integer >= 0 (0: off), "
                         f"got {interval!r}")
    if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
        raise ValueError("checkpointable_layers must be a list of layer class names")
    if dynamic_shape:
        raise ValueError("PipelineModule(dynamic_shape=True) is not supported: activations "
                         "between stages keep the shapes of the first micro-batch; pad the "
                         "inputs to one shape")


def _check_shared_objects(specs: List[Any], parts: List[int]) -> None:
    """One module object on two stages would be trained as two untied copies: refuse it."""
    seen: Dict[int, int] = {}
    for index, layer in enumerate(specs):
        if not isinstance(layer, nn.Module):
            continue
        first = seen.setdefault(id(layer), index)
        if stage_of_layer(parts, first) != stage_of_layer(parts, index):
            raise ValueError(f"layers[{first}] and layers[{index}] are the same module object "
                             f"on different pipeline stages, which would train two untied "
                             f"copies: use TiedLayerSpec to share a module across stages")
