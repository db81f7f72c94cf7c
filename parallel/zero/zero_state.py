"""ZeroOptimizer's checkpoint state: this rank's shard out (state_dict) and back in
(load_state_dict, or load_resharded from a torch_dist checkpoint resharded to this layout)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

import torch

from gigatron.parallel import comm

if TYPE_CHECKING:
    from gigatron.parallel.zero.flat_group import FlatGroup
    from gigatron.parallel.zero.loss_scaler import LossScaler

STATE_FORMAT = "gigatron-zero-v1"


class ZeroCheckpointing:
    """The checkpoint half of ZeroOptimizer (which sets these attributes)."""

    stage: int
    process_groups: Any  # optimizer.ZeroGroups
    flat_groups: List["FlatGroup"]
    optimizer: torch.optim.Optimizer
    scaler: "LossScaler"
    skipped_steps: int
    _publish_params: Callable[..., None]  # refreshes the model's parameters from the masters

    def state_dict(self) -> dict:
        """This rank's shard: master weights, optimizer state, loss scaler. Host tensors are
        the live ones (as torch's Optimizer.state_dict): serialise it before the next step."""
        return {"format": STATE_FORMAT, "zero_stage": self.stage,
                "dp_size": comm.group_size(self.process_groups.dp),
                "dp_rank": comm.group_rank(self.process_groups.dp),
                "layout": [(g.chunk, g.kind, g.full_numel, g.shard_numel)
                           for g in self.flat_groups],
                "master": [_host_copy(g.master) for g in self.flat_groups],
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def refresh_master_from_params(self) -> None:
        """After the module's weights were overwritten in place (loading weights only), make
        the fp32 master shards match them again."""
        for g in self.flat_groups:
            g.refresh_master()

    def load_resharded(self, masters: List[torch.Tensor],
                       per_element: List[Dict[str, torch.Tensor]], scalars: Dict[str, Any],
                       scaler: Dict[str, Any], skipped_steps: int) -> None:
        """Restore state that was resharded to this rank's layout (the torch_dist
        checkpoint): per flat group a master shard and its per-element optimizer states
        (exp_avg, ...), the optimizer's scalar state shared by all groups (the step count);
        then refresh the model parameters from the masters."""
        for g, master in zip(self.flat_groups, masters):
            if master is not g.master:  # torch_dist reads into the live shard itself
                g.load_master(master)
        state = self.optimizer.state_dict()
        order = [p for group in self.optimizer.param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(order)}
        # each group its own scalars: optimizers step a tensor "step" in place; an optimizer
        # with several rules (Muon) names the state each tensor keeps
        keys = getattr(self.optimizer, "state_keys", lambda p: None)
        state["state"] = {index[id(g.master)]: _only(keys(g.master),
                                                     {**_copies(scalars), **tensors})
                          for g, tensors in zip(self.flat_groups, per_element)
                          if tensors or scalars}
        self.optimizer.load_state_dict(state)
        self.scaler.load_state_dict(scaler)
        self.skipped_steps = int(skipped_steps)
        self._publish_params()

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


def _host_copy(master: torch.Tensor) -> torch.Tensor:
    """The master shard for a synchronous save: itself when it lives on the host in its own
    storage (an offloaded shard: no second 4 B/param on the host; torch.save writes it
    before training goes on), a copy of its elements when it is a view of a larger buffer
    (torch.save would write the whole storage) or on the device."""
    master = master.detach().cpu()
    whole = master.untyped_storage().nbytes() == master.numel() * master.element_size()
    return master if whole else master.clone()


def _only(keys: Optional[Sequence[str]], values: Dict[str, Any]) -> Dict[str, Any]:
    return values if keys is None else {k: v for k, v in values.items() if k in keys}


def _copies(values: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
