"""FlatGroup: one optimizer param group's parameters in flat, padded, contiguous buffers.

Holds the model parameters (as views into a flat buffer, or for stage 3 a persistent shard
plus per-bucket full buffers that exist only while gathered), the gradient storage in the
reduce dtype, where gradients are accumulated and reduced (full buffer for stages 0-1, this
rank's shard for stages 2-3), this rank's fp32 master shard
(for fp32 params a view of the parameter storage where possible, see `_make_master`), and
the per-bucket reductions over data parallelism.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.zero.layout import Bucket, group_sizes, plan_buckets, shard_overlaps


class FlatGroup:
    """Flat buffers and bucketed dp reductions for parameters sharing one optimizer group."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, chunk: int, kind: str,
                 weight_decay: float, stage: int, dp_group: Group, bucket_size: int,
                 unit_ids: Optional[Sequence[int]], master_device: torch.device,
                 reduce_dtype: torch.dtype, average_over: Optional[int] = None,
                 offloaded: bool = False) -> None:
        """`dp_group`: the ranks that reduce (and shard) these grads; `average_over`: the
        ranks whose losses the grads average (default the group's size; expert weights
        reduced over the expert-data-parallel group average over the dense dp size);
        `offloaded`: the master is a host copy apart from the parameters (offload.py), even
        where both are on the CPU."""
        self.params = list(params)
        self.chunk, self.kind, self.weight_decay, self.stage = chunk, kind, weight_decay, stage
        self.dp_group, self.reduce_dtype = dp_group, reduce_dtype
        self.dp_size, self.dp_rank = comm.group_size(dp_group), comm.group_rank(dp_group)
        self.average_over = self.dp_size if average_over is None else average_over
        self.numels = [p.numel() for p in self.params]
        self.ways = self.dp_size if stage >= 1 else 1
        self.rank_in_shard = self.dp_rank if stage >= 1 else 0
        self.buckets: List[Bucket] = plan_buckets(self.numels, bucket_size, self.ways, unit_ids)
        self.full_numel, self.shard_numel = group_sizes(self.buckets)
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self._place_params()
        self.master = self._make_master(master_device, offloaded)
        self._make_grad_storage()

    # ---- construction -------------------------------------------------------------
    def _param_views(self, bucket: Bucket, full: torch.Tensor):
        for pos, idx in enumerate(bucket.param_indices):
            off, n = bucket.offsets[pos], self.numels[idx]
            yield self.params[idx], full[off:off + n]

    def _place_params(self) -> None:
        """Move every parameter's data into its bucket's slot of a flat buffer."""
        r = self.rank_in_shard
        if self.stage < 3:
            self.param_buffer = torch.zeros(self.full_numel, dtype=self.dtype, device=self.device)
        else:
            self.param_shard = torch.zeros(self.shard_numel, dtype=self.dtype,
                                           device=self.device)
        for b in self.buckets:
            if self.stage < 3:
                full = self.param_buffer[b.group_offset:b.group_offset + b.padded_numel]
            else:
                full = torch.zeros(b.padded_numel, dtype=self.dtype, device=self.device)
            for p, view in self._param_views(b, full):
                view.copy_(p.data.reshape(-1))
                p.data = view.view_as(p)
            b.param_full = full
            if self.stage == 3:
                S = b.shard_numel
                self.param_shard[b.shard_offset:b.shard_offset + S].copy_(full[r * S:(r + 1) * S])
                full.untyped_storage().resize_(0)  # not gathered until first use

    def param_shard_piece(self, b: Bucket) -> torch.Tensor:
        """This rank's slice of bucket `b`'s parameters (persistent storage)."""
        S = b.shard_numel
        if self.stage == 3:
            return self.param_shard[b.shard_offset:b.shard_offset + S]
        start = b.group_offset + self.rank_in_shard * S
        return self.param_buffer[start:start + S]

    def _make_master(self, device: torch.device, offloaded: bool) -> torch.Tensor:
        """This rank's fp32 master shard. fp32 params on the optimizer's device need no
        second copy where the shard is contiguous in the parameter storage (stage 0: the
        whole buffer; stage 3: the persistent shard; stages 1-2: a single-bucket group), so
        the optimizer steps the parameters in place (1x parameter memory, like torch DDP)."""
        contiguous = self.stage in (0, 3) or len(self.buckets) == 1
        self.master_aliases_params = (self.dtype == torch.float32 and device == self.device
                                      and contiguous and not offloaded)
        if self.master_aliases_params:
            if self.stage == 0:
                return self.param_buffer
            return self.param_shard if self.stage == 3 else \
                self.param_shard_piece(self.buckets[0])
        # an offloaded master is not copied to the GPU itself (offload.py's pinned buffers are)
        master = torch.empty(self.shard_numel, dtype=torch.float32, device=device)
        self.master = master
        self.refresh_master()
        return master

    def _make_grad_storage(self) -> None:
        self.grad_buffer: Optional[torch.Tensor] = None  # stages 0-1: every bucket's grads
        self.grad_shard: Optional[torch.Tensor] = None  # stages 2-3: this rank's shard only
        if self.stage <= 1:
            self.grad_buffer = torch.zeros(self.full_numel, dtype=self.reduce_dtype,
                                           device=self.device)
        else:
            self.grad_shard = torch.zeros(self.shard_numel, dtype=self.reduce_dtype,
                                          device=self.device)
        for b in self.buckets:
            b.grad_full = None if self.grad_buffer is None else \
                self.grad_buffer[b.group_offset:b.group_offset + b.padded_numel]
        self.shard_views = [self._grad_shard_view(b) for b in self.buckets]

    def _grad_shard_view(self, b: Bucket) -> torch.Tensor:
        S = b.shard_numel
        if self.grad_shard is not None:
            return self.grad_shard[b.shard_offset:b.shard_offset + S]
        start = b.group_offset + self.rank_in_shard * S
        assert self.grad_buffer is not None  # stages 0-1 (the others hold a grad shard)
        return self.grad_buffer[start:start + S]

    # ---- gradients ----------------------------------------------------------------
    def accumulate(self, b: Bucket, pos: int, grad: torch.Tensor) -> None:
        """Add one parameter's fresh gradient into its bucket (in the reduce dtype)."""
        if b.grad_full is None:
            b.grad_full = torch.zeros(b.padded_numel, dtype=self.reduce_dtype,
                                      device=self.device)
        off = b.offsets[pos]
        b.grad_full[off:off + grad.numel()].add_(grad.reshape(-1))

    def start_reduce(self, b: Bucket) -> Tuple[comm.Work, Callable[[], object]]:
        """Launch bucket `b`'s average over dp; returns (handle, finish callback)."""
        grad = b.grad_full
        if grad is None:  # no parameter of this bucket received a gradient on this rank
            grad = torch.zeros(b.padded_numel, dtype=self.reduce_dtype, device=self.device)
        if self.stage >= 2:
            b.grad_full = None  # the transient full bucket lives only until reduced
        if self.average_over > 1:
            grad.div_(self.average_over)
        if self.stage == 0:
            return comm.all_reduce(grad, group=self.dp_group, async_op=True), lambda: None
        out = torch.empty(b.shard_numel, dtype=self.reduce_dtype, device=self.device)
        handle = comm.reduce_scatter(out, grad, group=self.dp_group, async_op=True)
        view = self.shard_views[b.index]
        if self.stage == 1:
            return handle, lambda: view.copy_(out)
        return handle, lambda: view.add_(out)

    def flat_grad_shard(self) -> torch.Tensor:
        """This rank's gradient shard as one tensor, laid out like the master shard."""
        pieces = self.grad_shard_pieces()
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def grad_shard_pieces(self) -> List[torch.Tensor]:
        """The tensors whose concatenation, in order, is `flat_grad_shard()` (one, except at
        stage 1 with several buckets: each bucket's shard)."""
        if self.grad_shard is not None:
            return [self.grad_shard]
        if self.stage == 0:
            assert self.grad_buffer is not None  # stage 0 keeps the full grad buffer
            return [self.grad_buffer]
        return list(self.shard_views)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        elif self.grad_shard is not None:
            self.grad_shard.zero_()
            for b in self.buckets:
                b.grad_full = None

    def counted_views(self, counts: Sequence[bool]) -> List[torch.Tensor]:
        """Views of the grad shard covering the parameters with counts[i] True (grad norm)."""
        views = []
        for b in self.buckets:
            view = self.shard_views[b.index]
            for idx, _, start, length in shard_overlaps(b, self.numels, self.rank_in_shard):
                if counts[idx]:
                    views.append(view[start:start + length])
        return views

    # ---- parameters after the step ----------------------------------------------------
    def write_back(self, copy_master: bool = True) -> List[comm.Work]:
        """Copy the updated master shard into the parameters (unless the offloaded step
        did: `copy_master` False); stages 1-2 all-gather the full buckets (returns the
        handles to wait on)."""
        if copy_master:
            self.copy_master_to_shard()
        return [self.start_gather(b) for b in self.buckets] if self.stage in (1, 2) else []

    def copy_master_to_shard(self) -> None:
        """This rank's slice of the parameters from the updated master shard."""
        if self.master_aliases_params:
            return
        for b in self.buckets:
            src = self.master[b.shard_offset:b.shard_offset + b.shard_numel]
            self.param_shard_piece(b).copy_(src, non_blocking=True)

    def start_gather(self, b: Bucket) -> comm.Work:
        """Stages 1-2: launch the all-gather of bucket `b`'s full parameters from every
        rank's slice (the source is a copy: this rank's slice lies inside the output)."""
        return comm.all_gather(b.param_full, self.param_shard_piece(b).clone(),
                               group=self.dp_group, async_op=True)

    def refresh_master(self) -> None:
        """Copy this rank's slice of the parameters into the master shard (after the
        parameters were overwritten; a master that aliases them is already current)."""
        if self.master_aliases_params:
            return
        for b in self.buckets:
            self.master[b.shard_offset:b.shard_offset + b.shard_numel].copy_(
                self.param_shard_piece(b))

    def load_master(self, master: torch.Tensor) -> None:
        if master.numel() != self.master.numel():
            raise ValueError(f"checkpoint master shard has {master.numel()} elements, this "
                             f"layout needs {self.master.numel()}: same model, dp size, "
                             f"zero_stage and reduce_bucket_size are required")
        self.master.copy_(master)
