"""Overlapped parameter all-gather for ZeRO 1-2 (Megatron-Core's --overlap-param-gather).

Without it the optimizer step all-gathers every updated bucket and waits. With it the step
copies the master shard into this rank's slice of the parameters, launches the all-gather of
the first bucket (in forward order) and returns; forward pre-hooks do the rest:

    step():               gather(0) issued, not waited
    forward, module m:    m's parameters are in bucket k -> wait buckets 0..k, issue k+1
                          (so bucket k+1's gather runs under bucket k's modules' compute)
    end of a chunk's forward: every bucket of the chunk (and of the chunks before) waited

Buckets form one chain per optimizer, ordered by (model chunk, first parameter's position in
`chunk.parameters()`): registration order, which is the order forward uses them. Gathers are
issued strictly in chain order on every rank, whatever modules run (an expert that gets no
tokens skips its forward), so the dp ranks always agree on the collectives' order. A module
waits for its bucket and every bucket before it in the chain, so a parameter read by a module
other than its own (a tied output weight) is covered as long as some later module ran first.

Everything before the next step has already waited; what reads the parameters outside a
forward (evaluation, checkpoint saving, `gathered_parameters`, loading) calls `finish()`,
and the next `step()` calls it first, so a skipped step (fp16 overflow) or a bucket no forward
touched never leaves a gather in flight while the optimizer writes the shard it reads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from torch import nn

from gigatron.parallel import comm

if TYPE_CHECKING:
    from gigatron.parallel.zero.flat_group import FlatGroup
    from gigatron.parallel.zero.layout import Bucket


class OverlappedParamGather:
    """The chain of stage 1-2 parameter all-gathers, issued after the step and waited in
    forward pre-hooks."""

    def __init__(self, flat_groups: Sequence["FlatGroup"], chunks: Sequence[nn.Module]) -> None:
        self.flat_groups = list(flat_groups)
        self.chain: List[Tuple["FlatGroup", "Bucket"]] = _chain(self.flat_groups, chunks)
        self.handles: List[Optional[comm.Work]] = [None] * len(self.chain)
        self.issued = self.waited = len(self.chain)  # [waited, issued): in flight
        position = {id(g.params[i]): k for k, (g, b) in enumerate(self.chain)
                    for i in b.param_indices}
        self._hooks = []
        for chunk in chunks:
            last = -1
            for module in chunk.modules():
                mine = [position[id(p)] for p in module.parameters(recurse=False)
                        if id(p) in position]
                if mine:
                    self._hooks.append(module.register_forward_pre_hook(
                        lambda m, args, k=max(mine): self.wait_through(k)))
                    last = max(last, *mine)
            if last >= 0:  # a bucket no module of the chunk claimed is waited here at last
                self._hooks.append(chunk.register_forward_hook(
                    lambda m, args, out, k=last: self.wait_through(k)))

    @property
    def pending(self) -> bool:
        """Some bucket's gather is not waited for yet."""
        return self.waited < len(self.chain)

    def launch(self, copied: bool = False) -> None:
        """After the step: the updated slices into the parameters (unless the offloaded step
        wrote them: `copied`), the first gather issued."""
        self.finish()
        for g in self.flat_groups:
            if not copied:
                g.copy_master_to_shard()
        self.issued = self.waited = 0
        self._issue_through(0)

    def wait_through(self, k: int) -> None:
        """Buckets 0..k gathered (a forward pre-hook: module's last bucket k); issue k+1."""
        if k < self.waited:
            return
        self._issue_through(k + 1)
        for i in range(self.waited, k + 1):
            handle, self.handles[i] = self.handles[i], None
            assert handle is not None
            handle.wait()
        self.waited = k + 1

    def finish(self) -> None:
        """Every gather issued and waited: the full parameters are current."""
        if self.pending:
            self.wait_through(len(self.chain) - 1)

    def _issue_through(self, k: int) -> None:
        for i in range(self.issued, min(k + 1, len(self.chain))):
            g, b = self.chain[i]
            self.handles[i] = g.start_gather(b)
        self.issued = max(self.issued, min(k + 1, len(self.chain)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _chain(flat_groups: Sequence["FlatGroup"], chunks: Sequence[nn.Module]
           ) -> List[Tuple["FlatGroup", "Bucket"]]:
    """Every stage 1-2 bucket, ordered by (chunk, position of its first parameter there)."""
    position: Dict[int, Tuple[int, int]] = {}
    for c, chunk in enumerate(chunks):
        for i, p in enumerate(chunk.parameters()):
            position.setdefault(id(p), (c, i))
    keyed = []
    for n, g in enumerate(flat_groups):
        if g.stage not in (1, 2):
            continue
        for b in g.buckets:
            first = min(position.get(id(g.params[i]), (len(chunks), 0)) for i in b.param_indices)
            keyed.append((first, n, b.index, g, b))
    keyed.sort(key=lambda t: t[:3])
    return [(g, b) for *_, g, b in keyed]
