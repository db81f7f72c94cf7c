"""--fp8-param-gather: ZeRO 1-2 all-gather the FP8 linears' weights in FP8 (Megatron-Core's
fp8_param_gather): one byte per element instead of the run's two (bf16/fp16) or four.

After the optimizer step each data-parallel rank, per flat group:
1. casts its shard of the updated fp32 masters into the parameters' dtype (as write_back);
2. takes the amax of its pieces of each FP8 weight -- per weight, or per 128x128 tile for
   blockwise -- and MAX-reduces them over the group's dp ranks in one all-reduce
   (tensorwise: then over the linears' tp x cp amax group, as their forward does), so each
   piece is quantised with the scale of the whole weight (tile): shards need not align
   with tiles;
3. quantises its pieces exactly as the forward would quantise the whole weight: delayed
   scaling with the weight's current delayed scale (the one the next forward uses),
   tensorwise with fp8_max / amax, blockwise with power-of-two tile scales;
4. all-gathers, bucket by bucket, the FP8 bytes (the float8 buffer's uint8 view: gloo and
   NCCL have no float8 type) and, apart, the other parameters in their own dtype.
Each FP8 linear then holds its weight as an `FP8Weight` (`state.param_fp8`) that its
forward uses as it is; the parameter buffer receives the dequantised FP8 values, so whoever
reads the model (checkpoints, norms) sees the weight the GEMMs use, as Megatron's FP8
parameters. The buffer in the run's dtype stays: this saves communication, not memory.
With several micro-batches per step a delayed weight scale is the step's first (as TE with
fp8_param_gather), where quantising in every forward would follow the scale's updates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Sequence, Tuple

import torch

from gigatron.parallel import comm
from gigatron.parallel.tensor.fp8 import FP8LinearState, FP8Weight
from gigatron.parallel.tensor.fp8_gemm import (BLOCK, E4M3, SQUARE_BLOCKS, TENSOR, FP8Operand,
                                               _pow2_scale, cast, current_scale)
from gigatron.parallel.zero.flat_group import FlatGroup
from gigatron.parallel.zero.layout import shard_overlaps

Piece = Tuple[int, int, int, int]  # (param index, start in param, start in rank slice, length)


@dataclass
class _Weight:
    """One FP8 linear's weight in a flat group: its state, shape, FP8 bytes and the
    entries of the group's amax vector it owns (1, or one per 128x128 tile)."""

    state: FP8LinearState
    rows: int
    cols: int
    data: torch.Tensor  # float8 [rows * cols], filled by the gather
    first: int  # its first entry in the group's amax vector
    entries: int

    def tiles(self, start: int, length: int) -> torch.Tensor:
        """The 128x128 tile of each element start..start+length of the flattened weight."""
        at = torch.arange(start, start + length, device=self.data.device)
        tile_cols = -(-self.cols // BLOCK)
        return (at // self.cols // BLOCK) * tile_cols + (at % self.cols) // BLOCK


class _GroupPlan:
    """Which elements of each rank's slice of each bucket are FP8 weights (pure layout)."""

    def __init__(self, group: FlatGroup, weights: Dict[int, _Weight]) -> None:
        self.group, self.weights = group, weights
        self.amax_entries = sum(w.entries for w in weights.values())
        self.pieces: List[List[List[Piece]]] = []  # [bucket][rank] -> the rank's FP8 pieces
        self.others: List[List[List[Tuple[int, int]]]] = []  # [bucket][rank] -> the rest
        self.counts: List[List[int]] = []  # [bucket][rank] -> FP8 elements in the slice
        for b in group.buckets:
            pieces = [[p for p in shard_overlaps(b, group.numels, rank) if p[0] in weights]
                      for rank in range(group.ways)]
            self.pieces.append(pieces)
            self.others.append([_gaps(mine, b.shard_numel) for mine in pieces])
            self.counts.append([sum(p[3] for p in mine) for mine in pieces])


def _gaps(pieces: List[Piece], size: int) -> List[Tuple[int, int]]:
    """(start, length) of the parts of a slice of `size` that `pieces` leave uncovered."""
    gaps, at = [], 0
    for _, _, start, length in pieces:
        if start > at:
            gaps.append((at, start - at))
        at = start + length
    return gaps + ([(at, size - at)] if at < size else [])


class FP8ParamGather:
    """Publishes ZeRO 1-2's updated parameters with the FP8 linears' weights gathered in FP8
    (`publish` replaces the flat groups' write_back). `states`: id(weight) -> its linear's
    FP8LinearState, for the weights that run in FP8."""

    def __init__(self, flat_groups: Sequence[FlatGroup],
                 states: Mapping[int, FP8LinearState]) -> None:
        self.plans: Dict[int, _GroupPlan] = {}
        for g in flat_groups:
            weights = self._weights(g, states)
            if not weights:
                continue
            if g.stage not in (1, 2):
                raise ValueError(f"--fp8-param-gather is built for ZeRO stages 1 and 2 (the "
                                 f"distributed optimizer), not stage {g.stage}: use "
                                 f"--zero-stage 1 or 2, or drop --fp8-param-gather")
            self.plans[id(g)] = _GroupPlan(g, weights)

    @staticmethod
    def _weights(g: FlatGroup, states: Mapping[int, FP8LinearState]) -> Dict[int, _Weight]:
        weights, first = {}, 0
        for i, p in enumerate(g.params):
            state = states.get(id(p))
            if state is None:
                continue
            if p.dim() != 2:
                raise ValueError(f"--fp8-param-gather: an FP8 weight of shape "
                                 f"{tuple(p.shape)} is not a matrix")
            rows, cols = p.shape
            entries = (-(-rows // BLOCK) * -(-cols // BLOCK)
                       if state.recipe.scaling == "blockwise" else 1)
            weights[i] = _Weight(state, rows, cols, torch.empty(
                p.numel(), dtype=state.recipe.forward_dtype, device=p.device), first, entries)
            first += entries
        return weights

    def publish(self, flat_groups: Sequence[FlatGroup]) -> None:
        """Every group's updated parameters on every rank (FP8 weights in FP8)."""
        handles = []
        for g in flat_groups:
            plan = self.plans.get(id(g))
            if plan is None:
                handles += g.write_back()
            else:
                _publish_group(plan)
        for h in handles:
            h.wait()


def _own_pieces(plan: _GroupPlan) -> List[Tuple[torch.Tensor, List[Piece]]]:
    """This rank's slice of each bucket (masters copied in) and its FP8 pieces."""
    g, out = plan.group, []
    for b in g.buckets:
        piece = g.param_shard_piece(b)
        if not g.master_aliases_params:
            piece.copy_(g.master[b.shard_offset:b.shard_offset + b.shard_numel])
        out.append((piece, plan.pieces[b.index][g.rank_in_shard]))
    return out


def _amaxes(plan: _GroupPlan, own: List[Tuple[torch.Tensor, List[Piece]]]) -> torch.Tensor:
    """Every FP8 weight's amax (blockwise: each tile's) over all its dp shards."""
    g = plan.group
    amax = torch.zeros(plan.amax_entries, dtype=torch.float32, device=g.device)
    for piece, fp8_pieces in own:
        for idx, start, at, length in fp8_pieces:
            w, values = plan.weights[idx], piece[at:at + length].detach().abs().float()
            if w.entries == 1:
                amax[w.first] = torch.maximum(amax[w.first], values.max())
            else:
                amax[w.first:w.first + w.entries].scatter_reduce_(
                    0, w.tiles(start, length), values, "amax")
    comm.all_reduce(amax, g.dp_group, op=comm.ReduceOp.MAX)
    tensorwise = [w for w in plan.weights.values() if w.state.recipe.scaling == "tensorwise"]
    if tensorwise:  # the forward's amax group: tp (and cp) shards of the same weight
        index = torch.tensor([w.first for w in tensorwise], device=g.device)
        current = amax[index]
        comm.all_reduce(current, tensorwise[0].state.current_amax_group,
                        op=comm.ReduceOp.MAX)
        amax[index] = current
    return amax


def _scales(plan: _GroupPlan, amax: torch.Tensor) -> Dict[int, torch.Tensor]:
    """Each FP8 weight's quantisation scale (blockwise: [row tiles, column tiles])."""
    scales = {}
    for idx, w in plan.weights.items():
        scaling = w.state.recipe.scaling
        if scaling == "delayed":
            scales[idx] = w.state.forward.scale[w.state.WEIGHT].clone()
        elif scaling == "tensorwise":
            scales[idx] = current_scale(amax[w.first], E4M3)
        else:
            scales[idx] = _pow2_scale(amax[w.first:w.first + w.entries], E4M3).view(
                -(-w.rows // BLOCK), -1)
    return scales


def _publish_group(plan: _GroupPlan) -> None:
    """Quantise this rank's pieces, gather every bucket (FP8 bytes and the rest apart),
    hand each FP8 linear its weight and write its dequantised values into the parameter."""
    g = plan.group
    own = _own_pieces(plan)
    amax = _amaxes(plan, own)
    scales = _scales(plan, amax)
    gathers = []
    for b, (piece, fp8_pieces) in zip(g.buckets, own):
        counts = plan.counts[b.index]
        fp8_width, other_width = max(counts), b.shard_numel - min(counts)
        fp8_send = torch.zeros(fp8_width, dtype=E4M3, device=g.device)
        at_send = 0
        for idx, start, at, length in fp8_pieces:
            w, values = plan.weights[idx], piece[at:at + length]
            scale = scales[idx]
            if w.entries > 1:
                scale = scale.reshape(-1)[w.tiles(start, length)]
            fp8_send[at_send:at_send + length] = cast(values, scale, w.data.dtype)
            at_send += length
        other_send = torch.zeros(other_width, dtype=g.dtype, device=g.device)
        at_send = 0
        for start, length in plan.others[b.index][g.rank_in_shard]:
            other_send[at_send:at_send + length] = piece[start:start + length]
            at_send += length
        fp8_out = torch.empty(g.ways * fp8_width, dtype=torch.uint8, device=g.device)
        other_out = torch.empty(g.ways * other_width, dtype=g.dtype, device=g.device)
        gathers.append((b, fp8_out, other_out, [
            comm.all_gather(fp8_out, fp8_send.view(torch.uint8), g.dp_group, async_op=True),
            comm.all_gather(other_out, other_send, g.dp_group, async_op=True)]))
    for b, fp8_out, other_out, handles in gathers:
        for h in handles:
            h.wait()
        _unpack(plan, b.index, fp8_out.view(g.ways, -1), other_out.view(g.ways, -1))
    # a master that aliases the (fp32) parameters keeps its own values, not FP8's: there
    # each rank's own slice of the parameters stays exact, the other slices FP8-rounded
    kept = [piece.clone() for piece, _ in own] if g.master_aliases_params else []
    for idx, w in plan.weights.items():
        _hand_over(g.params[idx], w, scales[idx], amax)
    for (piece, _), values in zip(own, kept):
        piece.copy_(values)


def _unpack(plan: _GroupPlan, bucket: int, fp8_rows: torch.Tensor,
            other_rows: torch.Tensor) -> None:
    """Every rank's gathered slice of one bucket into the FP8 weights and the parameters."""
    g = plan.group
    b = g.buckets[bucket]
    for rank in range(g.ways):
        full = b.param_full[rank * b.shard_numel:(rank + 1) * b.shard_numel]
        at = 0
        for start, length in plan.others[bucket][rank]:
            full[start:start + length] = other_rows[rank, at:at + length]
            at += length
        at = 0
        for idx, start, _, length in plan.pieces[bucket][rank]:
            data = plan.weights[idx].data.view(torch.uint8)
            data[start:start + length] = fp8_rows[rank, at:at + length]
            at += length


def _hand_over(param: torch.Tensor, w: _Weight, scale: torch.Tensor,
               amax: torch.Tensor) -> None:
    """The gathered weight to its linear (state.param_fp8) and, dequantised, to `param`."""
    blockwise = w.entries > 1
    operand = FP8Operand(w.data.view(w.rows, w.cols), scale.reciprocal(),
                         SQUARE_BLOCKS if blockwise else TENSOR)
    w.state.param_fp8 = FP8Weight(operand, scale, amax[w.first:w.first + w.entries].max())
    with torch.no_grad():
        param.data.copy_(operand.dequantize(param.dtype))
