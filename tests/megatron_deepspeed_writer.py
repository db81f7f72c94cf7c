"""Megatron-DeepSpeed GPT checkpoints at tp 1 / pp 1 and at tp 2 x pp 2, of the same weights,
written by the real DeepSpeed (called from deepspeed_checkpoint_script.py's 2-rank run).

The tp1 save is a plain `engine.save_checkpoint` of a module named like Megatron-DeepSpeed's
GPTModel. The tp2 x pp2 save has the file names and contents of Megatron-DeepSpeed's
GPTModelPipe under DeepSpeed's pipeline engine (PipeModelDataParallelTopology): what the
four model-parallel ranks (stage, tp rank) of each data-parallel replica write. A real
PipelineModule at tp2 x pp2 needs 4 ranks (x dp 2 here: 8), more than this CPU test runs, so
each model-parallel rank's part is a real DeepSpeed ZeRO 1 save (over the launch's 2 dp
ranks) of a module holding exactly that rank's parameters under GPTModelPipe's names, its
files renamed to the rank (DeepSpeed's grid: model-parallel rank = stage x tp + tp rank) and
its module moved into the layer files the pipeline engine writes instead
(`layer_LL-model_TT-model_states.pt`; module None in the model states file).

GPTModelPipe's layers (megatron/model/gpt_model.py): 0 the fp16 cast function (no file), 1
the embedding (TiedLayerSpec 'embed'), 2..1+L the transformer layers, 2+L the final norm,
3+L the tied embedding again (the logits); 'type:transformer' partitioning puts layers 0-2
on stage 0 and 3-5 on stage 1 for L = 2. Tensor parallelism follows Megatron's layers:
column-parallel (vocabulary rows, query_key_value and dense_h_to_4h rows, whose fused QKV is
[heads, 3, head dim] so a contiguous split is whole heads) split along dim 0, row-parallel
(dense, dense_4h_to_h) along dim 1, the rest (norms, position embeddings, row-parallel
biases) replicated.
"""
from __future__ import annotations

import argparse
import os
import shutil
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

TP, PP = 2, 2
TAG = "global_step1"
_COLUMN = ("word_embeddings.weight", "query_key_value.weight", "query_key_value.bias",
           "dense_h_to_4h.weight", "dense_h_to_4h.bias")
_ROW = ("attention.dense.weight", "dense_4h_to_h.weight")
STAGE_LAYERS = {0: (1, 2), 1: (3, 4, 5)}  # stage -> GPTModelPipe layer indices with weights


class Named(torch.nn.Module):
    """Parameters with the given names and values; the loss is half their squared norm, so
    Adam's moments are the weights' own (equal however the weights are split)."""

    def __init__(self, tensors: Dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            owner: torch.nn.Module = self
            for part in name.split(".")[:-1]:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(name.split(".")[-1], torch.nn.Parameter(tensor.clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p * p).sum() for p in self.parameters()) * x.mean() / 2


def tp_shard(name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """tp rank `rank`'s part of a full tensor, as Megatron's parallel layers hold it."""
    if name.endswith(_COLUMN):
        return tensor.chunk(TP, dim=0)[rank].clone()
    if name.endswith(_ROW):
        return tensor.chunk(TP, dim=1)[rank].clone()
    return tensor.clone()


def pipe_layers(full: Dict[str, torch.Tensor], num_layers: int, rank: int
                ) -> Dict[int, Dict[str, torch.Tensor]]:
    """GPTModelPipe's layers (index -> its state dict) of tp rank `rank`, from GPTModel names."""
    shard = {k[len("language_model."):]: tp_shard(k, v, rank) for k, v in full.items()}
    embed = {k[len("embedding."):]: v for k, v in shard.items() if k.startswith("embedding.")}
    layers = {1: embed, 3 + num_layers: embed}
    for i in range(num_layers):
        prefix = f"encoder.layers.{i}."
        layers[2 + i] = {k[len(prefix):]: v for k, v in shard.items() if k.startswith(prefix)}
    layers[2 + num_layers] = {k.rsplit(".", 1)[1]: v for k, v in shard.items()
                              if k.startswith("encoder.final_layernorm.")}
    return layers


def stage_parameters(layers: Dict[int, Dict[str, torch.Tensor]], stage: int
                     ) -> Dict[str, torch.Tensor]:
    """A stage's parameters under the PipelineModule's names (tied: tied_modules.embed.*)."""
    out = {}
    for index in STAGE_LAYERS[stage]:
        tied = index in (1, max(layers))
        for name, tensor in layers[index].items():
            out[f"tied_modules.embed.{name}" if tied else f"{index}.{name}"] = tensor
    return out


def save_engine(initialize: Callable, tensors: Dict[str, torch.Tensor], folder: str,
                args: argparse.Namespace) -> None:
    """One ZeRO 1 AdamW step at lr 0 (weights unchanged, moments set), saved by DeepSpeed."""
    model = Named(tensors)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0,
                                                     "torch_adam": True}},
           "zero_optimization": {"stage": 1},
           "gradient_clipping": 0.0}  # DeepSpeed's default 1.0 would clip each part by its norm
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.backward(engine(torch.ones(2)))
    engine.step()
    engine.save_checkpoint(folder, tag=TAG, client_state={"args": args, "iteration": 1})
    engine.destroy()


def write_both(initialize: Callable, out_dir: str, full: Dict[str, torch.Tensor],
               megatron_args: Dict[str, Any], num_layers: int) -> Tuple[str, str]:
    """OUT/megatron-tp1 and OUT/megatron-tp2pp2 (collective over the launch's ranks)."""
    rank = dist.get_rank()
    tp1 = os.path.join(out_dir, "megatron-tp1")
    save_engine(initialize, full, tp1, argparse.Namespace(**megatron_args))
    pipe = os.path.join(out_dir, f"megatron-tp{TP}pp{PP}")
    args = argparse.Namespace(**{**megatron_args, "tensor_model_parallel_size": TP,
                                 "pipeline_model_parallel_size": PP})
    per_tp = [pipe_layers(full, num_layers, t) for t in range(TP)]
    for stage in range(PP):
        for t in range(TP):
            part = os.path.join(out_dir, f"part-{stage}-{t}")
            save_engine(initialize, stage_parameters(per_tp[t], stage), part, args)
            dist.barrier()
            if rank == 0:
                _place(os.path.join(part, TAG), os.path.join(pipe, TAG), stage * TP + t)
    if rank == 0:
        for t, layers in enumerate(per_tp):
            for index, state in layers.items():
                torch.save(state, os.path.join(pipe, TAG, f"layer_{index:02d}-model_{t:02d}"
                                                          f"-model_states.pt"))
        with open(os.path.join(pipe, "latest"), "w") as f:
            f.write(TAG)
    dist.barrier()
    return tp1, pipe


def _place(part: str, tag: str, mp_rank: int) -> None:
    """A model-parallel rank's files, renamed to its rank, its module left to the layers."""
    os.makedirs(tag, exist_ok=True)
    for name in os.listdir(part):
        target = os.path.join(tag, name.replace("mp_rank_00", f"mp_rank_{mp_rank:02d}"))
        if name.endswith("_model_states.pt"):
            states = torch.load(os.path.join(part, name), weights_only=False)
            states.update(module=None, mp_world_size=TP * PP)
            torch.save(states, target)
        else:
            shutil.move(os.path.join(part, name), target)
    shutil.rmtree(os.path.dirname(part))


def saved_parts(folder: str) -> List[str]:
    """The file names of a tag (for the test's layout check)."""
    return sorted(os.listdir(os.path.join(folder, TAG)))
