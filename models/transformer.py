"""The transformer decoder: norms, self-attention (MHA/GQA, RoPE), MLP, layers, the block.

Built from tensor-parallel layers; hidden states are sequence-first `[s, b, h]` (split to
`[s/tp, b, h]` under sequence parallelism). Norms and the unfused softmax go through
`gigatron.ops`. Activation recomputation (Megatron's meanings) lives in the block.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gigatron import ops
from gigatron.models.attention_kinds import GATED, gated_activation
from gigatron.models.config import TransformerConfig
from gigatron.models.documents import Documents
from gigatron.models.moe.config_checks import moe_layer_pattern
from gigatron.models.kv_cache import CacheStep, LayerCache
from gigatron.models.losses import LayerLosses
from gigatron.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRNGTracker,
    checkpoint,
    tp_size,
)
from gigatron.parallel.tensor.init import InitSpec, set_parallel_attributes
from gigatron.parallel.tensor.selective import op_contexts
from gigatron.parallel.comm import Group


# the attention core and the rotary tables live in models/attention/; their names stay
# importable from here, where the layers that use them are
from gigatron.models.attention.core import CoreAttention, dropout, equal_head_dims  # noqa: F401
from gigatron.models.attention.rotary import (  # noqa: F401
    apply_rotary, llama3_scaled_inv_freq, rotary_cos_sin, rotary_cos_sin_at, rotary_inv_freq)


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the hidden dim (or `size`: a head's channels); params
    replicated across tp. Zero-centred (--apply-layernorm-1p): the weight starts at 0 and
    scales by 1 + weight. `sequence_parallel`: each tp rank sees part of the input, so the
    grads are summed over tp."""

    def __init__(self, config: TransformerConfig, sequence_parallel: bool,
                 device: Optional[torch.device] = None, size: Optional[int] = None) -> None:
        super().__init__()
        h, dtype = size or config.hidden_size, config.params_dtype
        self.rms = config.normalization == "RMSNorm"
        self.eps = config.layernorm_epsilon
        self.zero_centered = config.layernorm_zero_centered_gamma
        self.weight = nn.Parameter(torch.empty(h, dtype=dtype, device=device))
        set_parallel_attributes(self.weight,
                                InitSpec("zeros" if self.zero_centered else "ones", (h,)),
                                sequence_parallel=sequence_parallel)
        self.bias = None
        if not self.rms:
            self.bias = nn.Parameter(torch.empty(h, dtype=dtype, device=device))
            set_parallel_attributes(self.bias, InitSpec("zeros", (h,)),
                                    sequence_parallel=sequence_parallel)
        self.recompute = False  # --recompute-modules layernorm (TransformerLayer's two)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._normalize, None, x)
        return self._normalize(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        if self.rms:
            return ops.rms_norm(x, weight, self.eps)
        return ops.layer_norm(x, weight, self.bias, self.eps)


class SelfAttention(nn.Module):
    """Causal self-attention with fused QKV (grouped per query group), optional per-head
    query/key norms (--qk-layernorm) and RoPE."""

    def __init__(self, config: TransformerConfig, tp_group: Group,
                 tracker: Optional[TensorParallelRNGTracker],
                 device: Optional[torch.device] = None, layer_number: int = 0) -> None:
        super().__init__()
        tp = tp_size(tp_group)
        self.config = config
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.local_groups = config.num_query_groups // tp
        d, sp = config.head_dim, config.sequence_parallel
        qkv_size = config.num_query_groups * (self.heads_per_group + 2) * d
        common: Dict[str, Any] = dict(tp_group=tp_group, bias=config.add_bias_linear,
                                      sequence_parallel=sp, params_dtype=config.params_dtype,
                                      device=device)
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, qkv_size,
                                               init_std=config.init_method_std,
                                               **{**common, "bias": config.add_bias_linear
                                                  or config.add_qkv_bias})
        # a head's norm, its weight shared by the heads that tp spreads over the ranks: each
        # rank's grad covers its heads only, so it is summed over tp (Megatron-Core does too)
        self.q_layernorm = Norm(config, tp > 1, device, d) if config.qk_layernorm else None
        self.k_layernorm = Norm(config, tp > 1, device, d) if config.qk_layernorm else None
        self.core_attention = CoreAttention(config, tracker, layer_number, tp, device)
        self.linear_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size,
                                             init_std=output_init_std(config), **common)
        self.recompute_core = config.recomputes("core_attn")
        self.tracker = tracker

    def forward(self, x: torch.Tensor, rotary: Optional[tuple] = None,
                kv_cache: Optional[LayerCache] = None,
                documents: Optional[Documents] = None) -> torch.Tensor:
        """`kv_cache`: inference over cached keys/values (this step's k, v are appended);
        `documents`: packed documents' boundaries (attention stays inside each)."""
        qkv = self.linear_qkv(x)
        s, b = qkv.shape[:2]
        hpg, d = self.heads_per_group, self.config.head_dim
        qkv = qkv.view(s, b, self.local_groups, hpg + 2, d)
        # one split, not slices: its backward is one cat of the three grads, where a slice's
        # and a select's each zero-fill a qkv-sized grad and add it in (~15 ms of a GPT 1.3B
        # step on an H200)
        q, k, v = torch.split(qkv, [hpg, 1, 1], dim=3)
        q = q.reshape(s, b, self.local_groups * hpg, d)
        k, v = k.squeeze(3), v.squeeze(3)
        if self.q_layernorm is not None and self.k_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if kv_cache is not None:
            keys, values = kv_cache.append(k, v)
            out = self.core_attention.forward_masked(q, keys, values, kv_cache.mask)
        elif self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self.core_attention, self.tracker, q, k, v, documents)
        else:
            out = self.core_attention(q, k, v, documents)
        return self.linear_proj(out)


def output_init_std(config: TransformerConfig) -> float:
    """Std of output projections: scaled by 1/sqrt(2 L) when apply_scaled_init (GPT-2)."""
    if config.apply_scaled_init:
        return config.init_method_std / math.sqrt(2.0 * config.num_layers)
    return config.init_method_std


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Megatron's --squared-relu)."""
    return torch.pow(F.relu(x), 2)


# the activation of a non-gated MLP, by TransformerConfig.activation
ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "squared_relu": squared_relu,
}


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's gated silu: fc1's output is [gate, up] along the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def mlp_activation(name: str, glu_linear_offset: float = 0.0,
                   clamp: Optional[float] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """What an MLP applies between fc1 and fc2, by TransformerConfig.activation (the gated
    ones, SwiGLU and quick GeGLU, with their fc1 twice as wide; their linear offset and
    clamp: glu_linear_offset, activation_func_clamp_value)."""
    if name == "swiglu" and not glu_linear_offset and clamp is None:
        return swiglu
    if name in GATED:
        return gated_activation(GATED[name], glu_linear_offset, clamp)
    return ACTIVATIONS[name]


class MLP(nn.Module):
    """fc1 (column-parallel) -> GeLU, SwiGLU or squared ReLU -> fc2 (row-parallel)."""

    def __init__(self, config: TransformerConfig, tp_group: Group,
                 device: Optional[torch.device] = None,
                 ffn_hidden_size: Optional[int] = None) -> None:
        """`ffn_hidden_size`: the inner width when not config's (an MoE's shared experts)."""
        super().__init__()
        self.swiglu = config.activation in GATED
        self.activation = mlp_activation(config.activation, config.glu_linear_offset,
                                         config.activation_func_clamp_value)
        ffn = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        common: Dict[str, Any] = dict(tp_group=tp_group, bias=config.add_bias_linear,
                                      sequence_parallel=config.sequence_parallel,
                                      params_dtype=config.params_dtype, device=device)
        # SwiGLU's fc1 holds [gate; up]: stride 2 so each rank gets its slice of both.
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, 2 * ffn if self.swiglu else ffn,
            init_std=config.init_method_std, partition_stride=2 if self.swiglu else 1, **common)
        self.linear_fc2 = RowParallelLinear(ffn, config.hidden_size,
                                            init_std=output_init_std(config), **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(x)))


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))); the MLP is an
    MoELayer where moe_layer_freq puts one (`layer_number`: the global layer number)."""

    def __init__(self, config: TransformerConfig, tp_group: Group,
                 tracker: Optional[TensorParallelRNGTracker],
                 device: Optional[torch.device] = None, layer_number: int = 0,
                 layer_losses: Optional[LayerLosses] = None,
                 dispatcher_factory: Optional[Callable] = None) -> None:
        """`layer_losses`: where an MoE layer leaves its balancing losses (the model's);
        `dispatcher_factory`: its token dispatcher by expert count (default: all local)."""
        super().__init__()
        sp = config.sequence_parallel and tp_size(tp_group) > 1
        self.input_layernorm = Norm(config, sp, device)
        self.self_attention: nn.Module
        if config.multi_latent_attention:  # the attention kind of DeepSeek-V2/V3
            from gigatron.models.mla.attention import MultiLatentAttention  # builds on this
            self.self_attention = MultiLatentAttention(config, tp_group, tracker, device,
                                                       layer_number)
        else:
            self.self_attention = SelfAttention(config, tp_group, tracker, device, layer_number)
        self.pre_mlp_layernorm = Norm(config, sp, device)
        self.mlp: nn.Module
        if moe_layer_pattern(config)[layer_number]:
            from gigatron.models.moe.layer import MoELayer  # moe/ builds on this module
            extra = {} if dispatcher_factory is None else {"dispatcher_factory":
                                                           dispatcher_factory}
            self.mlp = MoELayer(config, tp_group, layer_losses, layer_number, device=device,
                                **extra)
        else:
            self.mlp = MLP(config, tp_group, device)
        self.p = config.hidden_dropout
        # Under SP each rank holds a different slice of the sequence: draw per-rank masks.
        self.dropout_tracker = tracker if sp else None
        self.tracker = tracker
        self.recompute_mlp = config.recomputes("moe" if hasattr(self.mlp, "recomputing")
                                               else "mlp")
        self.input_layernorm.recompute = self.pre_mlp_layernorm.recompute = \
            config.recomputes("layernorm")

    def forward(self, x: torch.Tensor, rotary: Optional[tuple] = None,
                kv_cache: Optional[LayerCache] = None,
                documents: Optional[Documents] = None) -> torch.Tensor:
        a = self.self_attention(self.input_layernorm(x), rotary, kv_cache, documents)
        x = x + dropout(a, self.p, self.training, self.dropout_tracker)
        if self.recompute_mlp and torch.is_grad_enabled():  # --recompute-modules mlp, moe
            m = checkpoint(_run_once(self, self.mlp), self.tracker, self.pre_mlp_layernorm(x))
        else:
            m = self.mlp(self.pre_mlp_layernorm(x))
        return x + dropout(m, self.p, self.training, self.dropout_tracker)


class TransformerBlock(nn.Module):
    """The layers `layer_range` (global numbers), plus the final norm on the last stage."""

    def __init__(self, config: TransformerConfig, layer_range: Sequence[int], tp_group: Group,
                 tracker: Optional[TensorParallelRNGTracker], post_process: bool = True,
                 device: Optional[torch.device] = None,
                 layer_losses: Optional[LayerLosses] = None,
                 dispatcher_factory: Optional[Callable] = None) -> None:
        super().__init__()
        self.config = config
        self.tracker = tracker
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(config, tp_group, tracker, device, i, layer_losses,
                                     dispatcher_factory)
            for i in layer_range})
        sp = config.sequence_parallel and tp_size(tp_group) > 1
        self.final_layernorm = Norm(config, sp, device) if post_process else None

    def _run(self, layers: Sequence[nn.Module], checkpointed: bool = False,
             documents: Optional[Documents] = None) -> Callable:
        """The layers as one function; `checkpointed`: calls after the first are the
        recomputation in backward, where MoE layers add no losses and count no tokens again
        (a checkpoint's forward and recompute run the same function, with its documents)."""
        def run(x: torch.Tensor, *rotary: torch.Tensor) -> torch.Tensor:
            for layer in layers:
                x = layer(x, rotary or None, None, documents)
            return x
        return _run_once(layers, run) if checkpointed else run

    def forward(self, x: torch.Tensor, rotary: Optional[tuple] = None,
                kv_step: Optional[CacheStep] = None,
                documents: Optional[Documents] = None) -> torch.Tensor:
        """`kv_step`: one inference step over a KV cache (no recomputation: no backward);
        `documents`: packed documents' boundaries (models/documents.py)."""
        if kv_step is not None:
            for number, layer in self.layers.items():
                x = layer(x, rotary, kv_step.layer(int(number)))
            return x if self.final_layernorm is None else self.final_layernorm(x)
        layers = list(self.layers.values())
        rot = tuple(rotary) if rotary is not None else ()
        cfg = self.config
        if cfg.selective_ac_option == "op" and torch.is_grad_enabled():  # torchtitan's
            for layer in layers:
                x = checkpoint(self._run([layer], True, documents), self.tracker, x, *rot,
                               keep=op_contexts)
        elif cfg.recompute_granularity == "full" and torch.is_grad_enabled():
            n = cfg.recompute_num_layers
            assert n is not None, "TransformerConfig.validate requires it with 'full'"
            if cfg.recompute_method == "uniform":
                for start in range(0, len(layers), n):
                    x = checkpoint(self._run(layers[start:start + n], True, documents),
                                   self.tracker, x, *rot)
            else:  # block: recompute the first n layers of this stage, keep the rest
                for i, layer in enumerate(layers):
                    if i < n:
                        x = checkpoint(self._run([layer], True, documents), self.tracker,
                                       x, *rot)
                    else:
                        x = layer(x, rotary, None, documents)
        else:
            x = self._run(layers, documents=documents)(x, *rot)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x


def _run_once(layers: Any, function: Callable) -> Callable:
    """`function` for a checkpoint: calls after the first are the recomputation, where the
    MoE layers among `layers` (a layer or a list) add no losses and count no tokens again.
    Dense layers inside a compiled layer (--torch-compile): `function` itself, as there is
    nothing to mark and the counter would keep dynamo from tracing the checkpoint (AOT
    autograd recomputes it, from the graph); an MoE layer's checkpoint runs eager."""
    if torch.compiler.is_compiling() and not any(
            hasattr(layer.mlp, "recomputing")
            for layer in (layers if isinstance(layers, list) else [layers])):
        return function
    calls = 0

    def run(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        with _recomputing(layers if isinstance(layers, list) else [layers], calls > 1):
            return function(*args)
    return run


@contextlib.contextmanager
def _recomputing(layers: Sequence[nn.Module], recomputing: bool) -> Iterator[None]:
    """Mark the MoE layers among `layers` as re-running for the duration (no-op when not)."""
    marked = [layer.mlp for layer in layers if recomputing and hasattr(layer.mlp, "recomputing")]
    for moe in marked:
        moe.recomputing = True
    try:
        yield
    finally:
        for moe in marked:
            moe.recomputing = False
