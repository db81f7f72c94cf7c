"""Horovod's gradient compression: what a tensor becomes on the wire, and back.

A compressor's `compress(tensor)` gives (wire tensor, context) and `decompress(wire, context)`
the tensor in its own dtype again. `Compression.fp16` sends floating-point tensors as
float16 (half the bytes; the reduction itself runs in float16), `Compression.none` as they are.
A user's own subclass of `Compressor` plugs in the same way as in Horovod.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch


class Compressor:
    """Interface: compress before the all-reduce, decompress after it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """The tensor to send and the context decompress needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The received tensor back in the original form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors unchanged (the default)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """The tensor itself, no context."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The tensor itself."""
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16; other dtypes unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """float16 copy of a floating-point tensor; the context is the original dtype."""
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Back to the original floating-point dtype."""
        return tensor.to(ctx) if ctx.is_floating_point else tensor


class Compression:
    """The compressors by Horovod's names: `hvd.Compression.none`, `hvd.Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
