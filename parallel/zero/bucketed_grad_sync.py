"""Gradient synchronisation: backward hooks fill buckets and launch their dp reductions.

Implements the pipeline executor's `GradSync` protocol (parallel/pipeline/interfaces.py):
`enable_sync(chunk, enabled)` before every backward (True only for a chunk's last micro-batch) and `finish_sync()` once after all
backwards, which also all-reduces tied-embedding grads over the embedding group and
sequence-parallel grads over tp. A parameter is ready when its post-accumulate-grad hook
fires: in the backward, or for the linears' weights under a split-backward schedule (zb-h1,
zbv) at the W step that accumulates the deferred gradient (tensor/wgrad.py), so the
executor enables sync there, at the chunk's last W.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable, Iterator, List, Optional

import torch

from gigatron.parallel import comm, timeline
from gigatron.parallel.zero.flat_group import FlatGroup
from gigatron.parallel.zero.layout import Bucket
from gigatron.parallel.comm import Group


class BucketedGradSync:
    """Owns the post-accumulate-grad hooks of every parameter in `groups`."""

    def __init__(self, flat_groups: List[FlatGroup], num_chunks: int, stage: int,
                 overlap_comm: bool = True, tp_group: Group = None, embedding_group: Group = None,
                 on_param_grad: Optional[Callable[[torch.nn.Parameter], None]] = None) -> None:
        self.flat_groups, self.stage, self.overlap_comm = flat_groups, stage, overlap_comm
        self.tp_group, self.embedding_group = tp_group, embedding_group
        self.on_param_grad = on_param_grad
        self._sync_enabled = [True] * num_chunks
        self._inflight: list = []
        self.synced = True
        self._hooks = []
        for group in flat_groups:
            for b in group.buckets:
                self._reset_bucket(b)
                b.launched_this_step = False
                for pos, idx in enumerate(b.param_indices):
                    hook = partial(self._on_grad, group, b, pos)
                    self._hooks.append(group.params[idx].register_post_accumulate_grad_hook(hook))

    @staticmethod
    def _reset_bucket(b: Bucket) -> None:
        b.pending = len(b.param_indices)
        b.dirty = False

    def enable_sync(self, chunk: int, enabled: bool) -> None:
        """Reduce chunk's buckets during the coming backward only if `enabled`."""
        self._sync_enabled[chunk] = enabled

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate local gradients without dp reduction (all but the last micro-batch)."""
        saved = list(self._sync_enabled)
        self._sync_enabled = [False] * len(saved)
        try:
            yield
        finally:
            self._sync_enabled = saved

    def _on_grad(self, group: FlatGroup, b: Bucket, pos: int, param: torch.nn.Parameter) -> None:
        if b.launched_this_step and self.stage <= 1:
            raise RuntimeError(
                "a gradient arrived for a bucket already reduced this step: with gradient "
                "accumulation wrap all but the last micro-batch's backward in zero.no_sync() "
                "(or call enable_sync(chunk, False)), and call zero_grad() after each step")
        assert param.grad is not None  # the hook runs once the gradient is accumulated
        group.accumulate(b, pos, param.grad)
        param.grad = None
        self.synced = False
        b.dirty = True
        b.pending -= 1
        if self.on_param_grad is not None:
            self.on_param_grad(param)
        if b.pending == 0:
            if self.overlap_comm and (self.stage >= 2 or self._sync_enabled[group.chunk]):
                self._launch(group, b)
            else:
                b.pending = len(b.param_indices)

    def _launch(self, group: FlatGroup, b: Bucket) -> None:
        if self.stage >= 2:
            self._retire(b)
        self._inflight.append((b, *group.start_reduce(b)))
        b.launched_this_step = True
        self._reset_bucket(b)

    def _retire(self, b: Bucket) -> None:
        """Finish the bucket's earlier reductions (stages 2-3 reduce every micro-batch): one
        in flight per bucket, else each micro-batch's buffers live until finish_sync (NCCL
        keeps an async op's tensors until it is waited on)."""
        keep = []
        for entry in self._inflight:
            if entry[0] is b:
                entry[1].wait()
                entry[2]()
            else:
                keep.append(entry)
        self._inflight = keep

    def finish_sync(self) -> None:
        """Reduce what backward left (unused params, no overlap), wait for every reduction,
        then the extra reductions over the embedding group and tp."""
        start = timeline.now() if timeline.on else 0
        for group in self.flat_groups:
            for b in group.buckets:
                if b.dirty or not b.launched_this_step:
                    self._launch(group, b)
        for _, handle, finish in self._inflight:
            handle.wait()
            finish()
        self._inflight.clear()
        for group in self.flat_groups:
            extra = {"shared_embedding": self.embedding_group,
                     "sequence_parallel": self.tp_group}.get(group.kind)
            if extra is not None and comm.group_size(extra) > 1:
                for view in group.shard_views:
                    comm.all_reduce(view, group=extra)
        self.synced = True
        if timeline.on:
            timeline.record("gradient reduction", start, {"buckets": sum(
                len(g.buckets) for g in self.flat_groups)})

    def new_step(self) -> None:
        """Forget this step's reductions (called by zero_grad)."""
        for group in self.flat_groups:
            for b in group.buckets:
                self._reset_bucket(b)
                b.launched_this_step = False
        self.synced = True

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
