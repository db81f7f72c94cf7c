"""GPTModel: GPT-2/3 and Llama-style decoders from one code path, buildable per stage.

A pipeline stage builds only its layers (`layer_range`, global numbers), the embedding only
if `pre_process`, the final norm + output layer (+ loss) only if `post_process`. Every
parameter is initialised from a generator seeded by (seed, name) as the full tensor and
then sliced for this tp rank, so every layout holds the same full model.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from gigatron.models.config import TransformerConfig
from gigatron.models.documents import document_bounds
from gigatron.models.kv_cache import CacheStep, KVCache
from gigatron.models.losses import LayerLosses
from gigatron.models.moe.layer import MoELayer
from gigatron.models.transformer import (CoreAttention, TransformerBlock, dropout,
                                         rotary_cos_sin, rotary_cos_sin_at)
from gigatron.parallel import comm
from gigatron.parallel.context.split import rank_positions
from gigatron.parallel.expert.init import initialize_expert_parameter
from gigatron.parallel.tensor import (
    ColumnParallelLinear,
    TensorParallelRNGTracker,
    VocabParallelEmbedding,
    initialize_parameter,
    model_parallel_seed,
    tp_rank,
    tp_size,
    vocab_parallel_cross_entropy,
)
from gigatron.parallel.tensor.init import InitSpec, mark_shared_embedding, set_parallel_attributes
from gigatron.parallel.tensor.random import MODEL_PARALLEL_RNG
from gigatron.parallel.comm import Group

WORD_EMBEDDING_NAME = "embedding.word_embeddings.weight"


class LanguageModelEmbedding(nn.Module):
    """Word embeddings (vocab-parallel) + learned positions (if asked), dropout; output
    [s(/tp), b, h]."""

    def __init__(self, config: TransformerConfig, tp_group: Group,
                 tracker: Optional[TensorParallelRNGTracker],
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel and tp_size(tp_group) > 1
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size(tp_size(tp_group)), config.hidden_size, tp_group=tp_group,
            vocab_size=config.vocab_size, init_std=config.init_method_std,
            reduce_scatter_embeddings=self.sequence_parallel,
            params_dtype=config.params_dtype, device=device)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            shape = (config.max_position_embeddings, config.hidden_size)
            # nn.Embedding draws an init that _initialize overwrites (kept on real devices:
            # it advances the RNG dropout draws from); on meta it would draw nothing but
            # cost an import of torch._dynamo (~1 s), so the planner's meta builds skip it.
            meta = torch.empty(shape, device=device, dtype=config.params_dtype) \
                if device is not None and torch.device(device).type == "meta" else None
            self.position_embeddings = nn.Embedding(*shape, _weight=meta, device=device,
                                                    dtype=config.params_dtype)
            # Under SP each rank adds the positions of its sequence slice only: partial grads.
            set_parallel_attributes(self.position_embeddings.weight,
                                    InitSpec("normal", shape, config.init_method_std),
                                    sequence_parallel=self.sequence_parallel)
        self.p = config.hidden_dropout
        self.tracker = tracker

    def forward(self, input_ids: torch.Tensor,
                position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        if not self.sequence_parallel:
            x = x.transpose(0, 1)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
                position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
            pos = self.position_embeddings(position_ids).transpose(0, 1)
            if self.sequence_parallel:
                n, r = tp_size(self.tp_group), tp_rank(self.tp_group)
                pos = pos.chunk(n, dim=0)[r]
            x = x + pos
        x = x.contiguous()
        return dropout(x, self.p, self.training, self.tracker if self.sequence_parallel else None)


class GPTModel(nn.Module):
    """A GPT decoder (or one pipeline stage of it) on one tensor-parallel group."""

    def __init__(self, config: TransformerConfig, tp_group: Group = None, pre_process: bool = True,
                 post_process: bool = True, layer_range: Optional[Sequence[int]] = None,
                 seed: int = 1234, device: Optional[torch.device] = None,
                 rng_tracker: Optional[TensorParallelRNGTracker] = None,
                 dispatcher_factory: Optional[Callable] = None, cp_group: Group = None,
                 cp_comm_type: str = "p2p") -> None:
        """`rng_tracker`: the rank's tracker, shared by all its pipeline chunks so their
        dropout masks differ (default: a tracker of this model's own, from `seed`);
        `dispatcher_factory`: the MoE layers' token dispatcher by expert count (default:
        every expert on this rank, models/moe/layer.py); `cp_group`: the context-parallel
        ranks splitting each sequence (their inputs are this rank's load-balanced chunks,
        parallel/context/split.py), attending to each other by `cp_comm_type`."""
        super().__init__()
        tp = tp_size(tp_group)
        config.validate(tp)
        self.config = config
        self.tp_group = tp_group
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_range = list(range(config.num_layers) if layer_range is None
                                else layer_range)
        bad = [i for i in self.layer_range if not 0 <= i < config.num_layers]
        if bad:
            raise ValueError(f"layer_range has layers {bad} outside 0..{config.num_layers - 1}")
        self.tied = not config.untie_embeddings_and_output_weights
        if rng_tracker is None:
            rng_tracker = TensorParallelRNGTracker()
            rng_tracker.add(MODEL_PARALLEL_RNG, model_parallel_seed(seed, tp_rank(tp_group)))
        self.rng_tracker = rng_tracker
        # losses the layers add during forward (MoE routers' balancing losses)
        self.layer_losses = LayerLosses()

        # multi-token prediction (models/mtp/) sits with the output layer and needs the
        # embedding there too: a last stage without it keeps a copy, shared as a tied one
        self.mtp_process = post_process and bool(config.mtp_num_layers)
        if self.mtp_process and not pre_process and \
                config.position_embedding_type == "learned_absolute":
            raise ValueError("multi-token prediction on a pipeline stage without the "
                             "embedding needs position_embedding_type rope or none")
        if pre_process or self.mtp_process:
            self.embedding = LanguageModelEmbedding(config, tp_group, self.rng_tracker, device)
        self.decoder = TransformerBlock(config, self.layer_range, tp_group, self.rng_tracker,
                                        post_process, device, self.layer_losses,
                                        dispatcher_factory)
        if post_process:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size(tp), tp_group=tp_group,
                bias=False, sequence_parallel=config.sequence_parallel,
                init_std=config.init_method_std, valid_rows=config.vocab_size,
                skip_weight_param=(pre_process or self.mtp_process) and self.tied,
                params_dtype=config.params_dtype, device=device)
        if self.mtp_process:
            from gigatron.models.mtp.block import MultiTokenPredictionBlock  # builds on this
            self.mtp = MultiTokenPredictionBlock(config, tp_group, self.rng_tracker, device,
                                                 self.layer_losses, dispatcher_factory)
        # the loss of the last stage; --torch-compile puts a compiled one here
        self.cross_entropy: Callable[..., torch.Tensor] = vocab_parallel_cross_entropy
        self._mark_shared_embedding()
        self._initialize(seed)
        self.cp_size, self.cp_rank = ((comm.group_size(cp_group), comm.group_rank(cp_group))
                                      if cp_group is not None else (1, 0))
        for module in self.decoder.modules():
            if isinstance(module, CoreAttention):
                module.set_context_parallel(cp_group, cp_comm_type)
            elif cp_group is not None and isinstance(module, MoELayer):
                module.set_context_parallel(cp_group)

    def _mark_shared_embedding(self) -> None:
        if self.pre_process and self.post_process:
            return
        if self.pre_process and (self.tied or self.config.mtp_num_layers):
            mark_shared_embedding(self.embedding.word_embeddings.weight)
        if self.mtp_process:  # the last stage's copy of the embedding (the output weight if tied)
            mark_shared_embedding(self.embedding.word_embeddings.weight, copy=True)
        elif self.post_process and self.tied:
            weight = self.output_layer.weight
            assert weight is not None, "a last stage without the embedding owns its weight"
            mark_shared_embedding(weight)

    def _initialize(self, seed: int) -> None:
        rank, size = tp_rank(self.tp_group), tp_size(self.tp_group)
        for name, param in self.named_parameters():
            # A tied output weight on a stage without the embedding starts as its copy.
            seed_name = WORD_EMBEDDING_NAME if (name == "output_layer.weight" and self.tied) \
                else name
            if getattr(param, "expert_parallel", False):
                initialize_expert_parameter(param, seed, name)
            else:
                initialize_parameter(param, seed, seed_name, rank, size)

    def output_weight(self) -> torch.Tensor:
        """The weight of the output layer (the word embeddings when tied on one stage)."""
        if self.output_layer.weight is None:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def forward(self, input_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                hidden_states: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None,
                attention_mask: Optional[torch.Tensor] = None,
                last_logits_only: bool = False,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per-token loss [b, s] (last stage, labels), tp-sharded logits [b, s, V_pad/tp]
        with the padded vocabulary's columns at -inf (last stage, no labels), else hidden
        states [s(/tp), b, h].

        Positions (learned or RoPE) are `position_ids` [b, s], default 0 .. s-1. Inference:
        `kv_cache` holds the earlier tokens (positions continue from them) and keeps these;
        `attention_mask` [b, s] (1: token, 0: padding) keeps padding out of attention (a
        forward without a cache then uses a one-step cache of its own); `last_logits_only`:
        the output layer on the last position only ([b, 1, V_pad/tp]: a long prompt's
        prefill needs no more). Training on packed documents: `cu_seqlens` [b, s + 1], a host
        tensor of each sample's document boundaries (data/documents.py; every stage and cp
        rank gets the whole sample's), keeps attention inside each document; the positions
        then come as `position_ids` on every stage (they restart with
        --reset-position-ids)."""
        documents = document_bounds(cu_seqlens)
        if documents is not None and (kv_cache is not None or attention_mask is not None):
            raise ValueError("cu_seqlens (packed documents) is for training: inference takes "
                             "attention_mask and kv_cache instead")
        step = None
        if kv_cache is not None or attention_mask is not None:
            step = self._begin_inference(input_ids, hidden_states, kv_cache, attention_mask)
            if position_ids is None:
                position_ids = step.position_ids
        if self.pre_process:
            if input_ids is None:
                raise ValueError("the first pipeline stage needs input_ids [b, s]")
            x = self.embedding(input_ids, position_ids)
        else:
            if hidden_states is None:
                raise ValueError("a non-first pipeline stage needs hidden_states [s, b, h]")
            x = hidden_states
        rotary = self._rotary(x, position_ids)
        x = self.decoder(x, rotary, step, documents)
        if step is not None:
            step.cache.commit(step)
        if not self.post_process:
            return x
        if self.mtp_process and labels is not None:
            return self._losses_with_mtp(x, input_ids, position_ids, labels, rotary, documents)
        if last_logits_only:
            if self.config.sequence_parallel and tp_size(self.tp_group) > 1:
                raise ValueError("last_logits_only needs sequence_parallel=False")
            x = x[-1:]
        logits = self.output_layer(x, self.output_weight())  # [s, b, V_pad/tp]
        if labels is None:
            return self._mask_padded_vocab(logits).transpose(0, 1).contiguous()
        loss = self.cross_entropy(logits, labels.transpose(0, 1), self.tp_group,
                                  self.config.vocab_size)
        return loss.transpose(0, 1).contiguous()

    def _losses_with_mtp(self, x: torch.Tensor, input_ids: Optional[torch.Tensor],
                         position_ids: Optional[torch.Tensor], labels: torch.Tensor,
                         rotary: Optional[tuple], documents: Any) -> torch.Tensor:
        """[1 + D, b, s]: the per-token loss, then depth k's against the labels k places
        further (the last k places' are meaningless: models/mtp/loss.py masks them)."""
        from gigatron.models.mtp.block import roll_left

        if input_ids is None:
            raise ValueError("multi-token prediction needs input_ids on the last stage")
        if position_ids is None and self.embedding.position_embeddings is not None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        hidden = [x] + self.mtp(x, input_ids, position_ids, self.embedding, rotary, documents)
        # one output-layer call over the depths side by side in the batch (dim 1: sequence
        # parallelism gathers dim 0): a deferred weight gradient (zb-h1) takes one use
        logits = self.output_layer(torch.cat(hidden, dim=1), self.output_weight())
        losses = []
        for part in logits.chunk(len(hidden), dim=1):
            losses.append(self.cross_entropy(part, labels.transpose(0, 1), self.tp_group,
                                             self.config.vocab_size))
            labels = roll_left(labels)
        return torch.stack(losses).transpose(1, 2).contiguous()

    def _rotary(self, x: torch.Tensor, position_ids: Optional[torch.Tensor]) -> Optional[tuple]:
        """RoPE's cos/sin tables at `position_ids`, or 0 .. s-1 without them (a non-first
        pipeline stage gets none: the data's positions are 0 .. s-1; under context
        parallelism those of this rank's chunks)."""
        if self.config.position_embedding_type != "rope" and \
                not self.config.multi_latent_attention:  # MLA rotates its own channels
            return None
        if position_ids is not None:
            return rotary_cos_sin_at(position_ids.to(x.device), self.config)
        seq = x.shape[0] * (tp_size(self.tp_group) if self.config.sequence_parallel else 1)
        if self.cp_size > 1:
            positions = rank_positions(seq * self.cp_size, self.cp_size, self.cp_rank)
            return rotary_cos_sin_at(positions.to(x.device)[None], self.config)
        return rotary_cos_sin(seq, self.config, x.device)

    def _begin_inference(self, input_ids: Optional[torch.Tensor],
                         hidden_states: Optional[torch.Tensor], kv_cache: Optional[KVCache],
                         attention_mask: Optional[torch.Tensor]) -> CacheStep:
        """Open this forward's step in `kv_cache` (a one-step cache when None)."""
        if self.config.sequence_parallel and tp_size(self.tp_group) > 1:
            raise ValueError("inference (kv_cache / attention_mask) needs sequence_parallel="
                             "False: build the model with it off (the weights are the same)")
        if input_ids is not None:
            batch, seq, device = input_ids.shape[0], input_ids.shape[1], input_ids.device
        elif hidden_states is not None:
            batch, seq, device = hidden_states.shape[1], hidden_states.shape[0], \
                hidden_states.device
        else:
            raise ValueError("a forward needs input_ids or hidden_states")
        if kv_cache is None:
            kv_cache = KVCache(self.config, batch, seq, tp_size(self.tp_group),
                               self.layer_range, device=device)
        return kv_cache.begin(seq, attention_mask)

    def _mask_padded_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [.., V_pad/tp] with the columns past the real vocabulary at -inf (no
        sampler or argmax can pick a padding row)."""
        width = logits.shape[-1]
        real = min(max(self.config.vocab_size - tp_rank(self.tp_group) * width, 0), width)
        if real == width:
            return logits
        if logits.requires_grad:  # autograd may need the output as it was
            logits = logits.clone()
        logits[..., real:] = float("-inf")
        return logits


def count_parameters(config: TransformerConfig) -> int:
    """Parameters of the full model, computed on the meta device (nothing allocated)."""
    model = GPTModel(config, device=torch.device("meta"))
    return sum(p.numel() for p in model.parameters())


def count_active_parameters(config: TransformerConfig) -> int:
    """Parameters one token passes through: all but the routed experts it is not sent to
    (top-k of num_moe_experts) and the input embedding table when untied (a lookup), the
    convention of "37B active of 671B" (DeepSeek-V3) and "3.6B active" (gpt-oss-20b)."""
    model = GPTModel(config, device=torch.device("meta"))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    if config.num_moe_experts:
        total -= experts * (config.num_moe_experts - config.moe_router_topk) \
            // config.num_moe_experts
    if config.untie_embeddings_and_output_weights:
        total -= model.embedding.word_embeddings.weight.numel()
    return total
