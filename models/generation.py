"""Text generation with a GPTModel: KV cache, greedy or sampled decoding, batched prompts.

    result = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=20)        # greedy
    result = generate(model, prompts, 20, temperature=0.8, top_p=0.9, seed=7)  # sampled

Prompts of different lengths are left-padded into one batch; the padding is masked out of
attention and positions count real tokens only, so each prompt continues as it would alone.
Every step feeds one new token per prompt through the KV cache (`use_cache=False`
recomputes the whole sequence instead: the same tokens, slower). Under tensor parallelism
every rank of the model's tp group calls this with the same arguments; the vocab-parallel
logits are gathered and each rank draws the same token from the same seeded generator.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from gigatron.models.kv_cache import KVCache
from gigatron.parallel.tensor import gather_from_tensor_parallel_region, tp_size

# called after each step with the new token of every prompt (None: the prompt had stopped)
StepCallback = Callable[[List[Optional[int]]], None]


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen (Hugging Face's order: temperature, top-k, top-p).

    temperature 0 is greedy (the argmax; top_k and top_p must stay off); above 0 the
    logits are divided by it and a token is drawn from the softmax, restricted to the
    top_k most likely (0: all) and then to the smallest set whose probability reaches top_p
    (1.0: all), from a generator seeded with `seed`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def problems(self) -> List[str]:
        """Every invalid field, one line each naming it and the fix."""
        out = []
        if not self.temperature >= 0:
            out.append(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            out.append(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1] (1: off), got {self.top_p}")
        if self.temperature == 0 and (self.top_k or self.top_p < 1):
            out.append("top_k / top_p filter a sampled token: with temperature 0 (greedy) "
                       "leave them off, or give a temperature > 0")
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits [b, V] with every token outside the top_k (0: off) and then outside the
    top_p nucleus (1.0: off) set to -inf; the most likely token always stays."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each
        drop_sorted = before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, params: SamplingParams,
                generator: Optional[torch.Generator]) -> torch.Tensor:
    """The next token [b] from full-vocabulary logits [b, V] (fp32)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_token: int,
             device: Optional[torch.device] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tokens [b, L], attention_mask [b, L]: 1 for a token, 0 for padding) with every
    prompt right-aligned to the longest one's length L."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, each of at least one token")
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_token, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return tokens.to(device), mask.to(device)


@dataclass
class GenerationResult:
    """Per prompt: the generated tokens (ending with the stop token when one was drawn)."""

    tokens: List[List[int]]
    stopped: List[bool] = field(default_factory=list)  # a stop token ended the prompt


def _check_model(model: torch.nn.Module) -> None:
    if not (getattr(model, "pre_process", False) and getattr(model, "post_process", False)):
        raise ValueError("generate needs the whole model on each rank (pipeline size 1): "
                         "pipeline-parallel generation is not supported")
    config = getattr(model, "config")
    if config.sequence_parallel and tp_size(getattr(model, "tp_group")) > 1:
        raise ValueError("generate needs a model built with sequence_parallel=False (the "
                         "weights are the same; rebuild or load it without "
                         "--sequence-parallel)")


def _last_logits(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The last position's full-vocabulary logits [b, V] (fp32) from tp-sharded ones."""
    last = gather_from_tensor_parallel_region(logits[:, -1].contiguous(),
                                              getattr(model, "tp_group"))
    return last[:, :getattr(model, "config").vocab_size].float()


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop_tokens: Sequence[int] = (), pad_token: int = 0, use_cache: bool = True,
             on_step: Optional[StepCallback] = None) -> GenerationResult:
    """Continue each prompt (token ids) by up to `max_new_tokens` tokens; a prompt stops
    after drawing one of `stop_tokens`, the batch when all prompts stopped. The model is in
    eval mode (no dropout) while generating and is put back as it was."""
    params = SamplingParams(temperature, top_k, top_p, seed)
    problems = params.problems()
    if max_new_tokens < 0:
        problems.append(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if problems:
        raise ValueError("\n".join(problems))
    _check_model(model)
    config = getattr(model, "config")
    device = next(model.parameters()).device
    tokens, mask = left_pad(prompts, pad_token, device)
    total = tokens.shape[1] + max_new_tokens
    if config.position_embedding_type == "learned_absolute" and \
            total > config.max_position_embeddings:
        raise ValueError(f"the longest prompt ({tokens.shape[1]} tokens) + max_new_tokens "
                         f"({max_new_tokens}) exceeds the model's "
                         f"max_position_embeddings ({config.max_position_embeddings})")
    generator = None
    if not params.greedy:
        generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        out = _decode(model, tokens, mask, max_new_tokens, params, generator,
                      set(int(t) for t in stop_tokens), pad_token, use_cache, on_step)
    finally:
        model.train(was_training)
    return out


def _decode(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor,
            max_new_tokens: int, params: SamplingParams, generator: Optional[torch.Generator],
            stop_tokens: set, pad_token: int, use_cache: bool,
            on_step: Optional[StepCallback]) -> GenerationResult:
    batch = tokens.shape[0]
    cache = None
    if use_cache:
        cache = KVCache(getattr(model, "config"), batch, tokens.shape[1] + max_new_tokens,
                        tp_size(getattr(model, "tp_group")), getattr(model, "layer_range"),
                        device=tokens.device)
    generated: List[List[int]] = [[] for _ in range(batch)]
    stopped = [False] * batch
    step_input, step_mask = tokens, mask
    for _ in range(max_new_tokens):
        if cache is None:  # the whole (left-padded) sequence again
            logits = model(tokens, attention_mask=mask, last_logits_only=True)
        else:
            logits = model(step_input, kv_cache=cache, attention_mask=step_mask,
                           last_logits_only=True)
        chosen = next_tokens(_last_logits(model, logits), params, generator).tolist()
        news: List[Optional[int]] = []
        for row, token in enumerate(chosen):
            if stopped[row]:
                chosen[row] = pad_token
                news.append(None)
                continue
            generated[row].append(token)
            stopped[row] = token in stop_tokens
            news.append(token)
        if on_step is not None:
            on_step(news)
        if all(stopped):
            break
        step_input = torch.tensor(chosen, dtype=torch.long, device=tokens.device)[:, None]
        step_mask = torch.ones_like(step_input)
        tokens = torch.cat([tokens, step_input], dim=1)
        mask = torch.cat([mask, step_mask], dim=1)
    return GenerationResult(generated, stopped)
