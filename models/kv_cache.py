"""KVCache: the keys and values of the tokens seen so far, for incremental decoding.

One cache serves one batch of sequences on one tensor-parallel rank. Each layer keeps this
rank's key/value heads in `[b, g/tp, max_length, d]` buffers (multi-latent attention: its
normalised latent `[b, 1, max_length, kv_lora_rank]` as keys and its rotated positional key
`[b, 1, max_length, qk_pos_emb_head_dim]` as values, the same on every rank); slot j of
every row holds the j-th token fed to the model (left padding included). A forward over s
new tokens is one
step:

    step = cache.begin(s, padding_mask)   # GPTModel.forward does this
    per layer: keys, values = step.layer(i).append(k, v)   # slots 0 .. length + s
    attention under step.mask: causal over slots, never to padding, always to itself
    cache.commit(step)                    # length += s

Positions follow the real tokens only: a row's first real token is at position 0 however
much padding precedes it, and padding slots take position 0 (their outputs are never read).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple

import torch

from gigatron.models.config import TransformerConfig


def step_attention_mask(key_padding: torch.Tensor, start: int,
                        num_tokens: int) -> torch.Tensor:
    """[b, 1, s, start + s] bool, True where query i (slot start + i) may attend to a key
    slot: causal and not padding; a query always sees its own slot (so a padding query's
    row is never empty, which would make softmax NaN)."""
    total = start + num_tokens
    query_slot = torch.arange(start, total, device=key_padding.device)[:, None]
    key_slot = torch.arange(total, device=key_padding.device)[None, :]
    causal = key_slot <= query_slot                                   # [s, total]
    allowed = causal[None] & ~key_padding[:, None, :total]            # [b, s, total]
    allowed |= (key_slot == query_slot)[None]
    return allowed[:, None]


def positions_after(real_tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """Position ids [b, s] of new tokens for rows that already hold `real_tokens` [b] real
    tokens: the count of real tokens before each, padding at 0."""
    real = (~padding).long()
    positions = real_tokens[:, None] + real.cumsum(dim=1) - 1
    return positions.clamp(min=0) * real


class LayerCache:
    """One layer's view of a step: where its new keys/values go, what attention sees."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, start: int,
                 mask: torch.Tensor) -> None:
        self.keys, self.values, self.start, self.mask = keys, values, start, mask

    def append(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store the step's k, v [s, b, g, d]; return every key and value so far
        [b, g, start + s, d]."""
        end = self.start + k.shape[0]
        self.keys[:, :, self.start:end] = k.permute(1, 2, 0, 3)
        self.values[:, :, self.start:end] = v.permute(1, 2, 0, 3)
        return self.keys[:, :, :end], self.values[:, :, :end]


@dataclass
class CacheStep:
    """What one forward over `num_tokens` new tokens needs: positions and the mask."""

    cache: "KVCache"
    start: int
    num_tokens: int
    position_ids: torch.Tensor  # [b, s]
    mask: torch.Tensor  # [b, 1, s, start + s]
    real_tokens_after: torch.Tensor  # [b]

    def layer(self, number: int) -> LayerCache:
        """The cache of layer `number` (global numbering) for this step."""
        if number not in self.cache.keys:
            raise KeyError(f"the KV cache holds no layer {number}: build it with the "
                           f"model's layer numbers")
        return LayerCache(self.cache.keys[number], self.cache.values[number], self.start,
                          self.mask)


class KVCache:
    """Keys and values of `max_length` token slots for `batch_size` sequences, per layer."""

    def __init__(self, config: TransformerConfig, batch_size: int, max_length: int,
                 tp_size: int = 1, layer_numbers: Optional[Iterable[int]] = None,
                 dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"a KV cache needs batch_size >= 1 and max_length >= 1, got "
                             f"{batch_size} and {max_length}")
        groups = config.num_query_groups // tp_size
        shape = value_shape = (batch_size, groups, max_length, config.head_dim)
        if config.multi_latent_attention:  # MLA caches its latent and positional key
            shape = (batch_size, 1, max_length, config.kv_lora_rank)
            value_shape = (batch_size, 1, max_length, config.qk_pos_emb_head_dim)
        dtype = config.params_dtype if dtype is None else dtype
        numbers = range(config.num_layers) if layer_numbers is None else layer_numbers
        self.keys: Dict[int, torch.Tensor] = {}
        self.values: Dict[int, torch.Tensor] = {}
        for i in numbers:
            self.keys[i] = torch.zeros(shape, dtype=dtype, device=device)
            self.values[i] = torch.zeros(value_shape, dtype=dtype, device=device)
        self.batch_size, self.max_length = batch_size, max_length
        self.length = 0
        self.key_padding = torch.zeros(batch_size, max_length, dtype=torch.bool, device=device)
        self.real_tokens = torch.zeros(batch_size, dtype=torch.long, device=device)

    def begin(self, num_tokens: int,
              padding_mask: Optional[torch.Tensor] = None) -> CacheStep:
        """Open a step over `num_tokens` new tokens; `padding_mask` [b, s] (1/True: a real
        token, 0/False: padding; default all real) marks their padding."""
        end = self.length + num_tokens
        if end > self.max_length:
            raise ValueError(f"the KV cache holds {self.max_length} tokens: {self.length} "
                             f"cached + {num_tokens} new do not fit (make it longer)")
        device = self.key_padding.device
        if padding_mask is None:
            padding = torch.zeros(self.batch_size, num_tokens, dtype=torch.bool, device=device)
        else:
            if tuple(padding_mask.shape) != (self.batch_size, num_tokens):
                raise ValueError(f"attention_mask has shape {tuple(padding_mask.shape)}, the "
                                 f"step has [{self.batch_size}, {num_tokens}] tokens")
            padding = ~padding_mask.to(device=device, dtype=torch.bool)
        self.key_padding[:, self.length:end] = padding
        return CacheStep(self, self.length, num_tokens,
                         positions_after(self.real_tokens, padding),
                         step_attention_mask(self.key_padding, self.length, num_tokens),
                         self.real_tokens + (~padding).sum(dim=1))

    def commit(self, step: CacheStep) -> None:
        """Keep the step's tokens: the next step starts after them."""
        if step.cache is not self or step.start != self.length:
            raise ValueError("commit() takes the step this cache's begin() opened last")
        self.length = step.start + step.num_tokens
        self.real_tokens = step.real_tokens_after
