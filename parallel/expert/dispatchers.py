"""The MoE layers' dispatcher factory for an expert-parallel layout
(--moe-token-dispatcher-type alltoall|allgather over this rank's ep and etp groups)."""
from __future__ import annotations

from typing import Callable, Dict

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.expert.allgather import AllGatherDispatcher
from gigatron.parallel.expert.alltoall import AllToAllDispatcher
from gigatron.parallel.expert.dispatch import TokenDispatcher

DISPATCHERS: Dict[str, Callable[..., TokenDispatcher]] = {
    "alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


def expert_dispatcher_factory(kind: str, ep_group: Group, etp_group: Group = None
                              ) -> Callable[[int], TokenDispatcher]:
    """num_experts -> a `kind` dispatcher over `ep_group` (and `etp_group`, None: etp 1)."""
    if kind not in DISPATCHERS:
        raise ValueError(f"--moe-token-dispatcher-type {kind!r}: use one of "
                         f"{', '.join(DISPATCHERS)}")
    etp = None if etp_group is None or comm.group_size(etp_group) == 1 else etp_group
    return lambda num_experts: DISPATCHERS[kind](ep_group, num_experts, etp)
