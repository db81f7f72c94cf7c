"""megatron-core's GPTModel and training step on one device, for bench_train_gpu.py.

Built as Megatron-LM's pretrain_gpt builds it for a zoo config (local layer spec, since
Transformer Engine is absent on the device machine): GPT (learned positions, LayerNorm, GeLU,
biases, tied) or Llama (RoPE with optional Llama 3.1 scaling, RMSNorm, SwiGLU, grouped
key/value heads, no biases, tied or untied); the model wrapped in megatron-core's DistributedDataParallel
(fp32 main grads) and stepped by `get_megatron_optimizer` (bf16 params, fp32 master,
Adam), which is what Megatron-LM's train_step drives. On the CPU (the bench's --tiny check
only) three CUDA-only spots are shimmed in this process, and since Megatron's optimizer
allocates on 'cuda' the model steps with torch's AdamW instead, unwrapped: the CPU run proves
the model and step run, not Megatron's optimizer. On a GPU nothing is patched.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn.functional as F


def available() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True


def _cpu_shims() -> None:
    """Megatron-Core assumes CUDA where a CPU forward reaches: the current device, Tensor.cuda
    and the CUDA RNG tracker's fork (dropout is 0 in the bench)."""
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]


# gigatron's activation names -> (megatron-core activation_func, gated_linear_unit)
_ACTIVATIONS: Dict[str, Tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "gelu": (F.gelu, False),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), False),
    "swiglu": (F.silu, True),
}


def _rope_scaling(arch: Any) -> Dict[str, Any]:
    """GPTModel's rope arguments; megatron-core 0.16 fixes Llama 3.1's low/high frequency
    factors (1, 4) and original context (8192), so only those are accepted."""
    if arch.position_embedding_type != "rope":
        return {}
    scaling = dict(rotary_base=int(arch.rotary_base), rope_scaling=bool(arch.rope_scaling))
    if arch.rope_scaling:
        fixed = (arch.rope_scaling_low_freq_factor, arch.rope_scaling_high_freq_factor,
                 arch.rope_scaling_original_max_position_embeddings)
        if fixed != (1.0, 4.0, 8192):
            raise ValueError(f"rope scaling {fixed}: megatron-core's GPTModel has only "
                             f"(1.0, 4.0, 8192) for (low, high, original positions)")
        scaling["rope_scaling_factor"] = arch.rope_scaling_factor
    return scaling


def _transformer_config(arch: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """megatron-core's TransformerConfig of `arch`, with the fusions the local spec runs
    without Apex/Transformer Engine."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if arch.activation not in _ACTIVATIONS:
        raise ValueError(f"activation {arch.activation!r}: the megatron-core path knows "
                         f"{', '.join(_ACTIVATIONS)}")
    activation, gated = _ACTIVATIONS[arch.activation]
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels, ffn_hidden_size=arch.ffn_hidden_size,
        normalization=arch.normalization, layernorm_epsilon=arch.layernorm_epsilon,
        activation_func=activation, gated_linear_unit=gated, bias_activation_fusion=False,
        add_bias_linear=arch.add_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=device.type == "cpu", init_method_std=arch.init_method_std,
        # its fused softmax needs Apex/TE's compiled module (absent): torch's softmax
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        bias_dropout_fusion=device.type == "cuda")


def build(arch: Any, vocab_size: int, seq_length: int, device: torch.device,
          dtype: torch.dtype, lr: float = 1e-4
          ) -> Tuple[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """(model, step(tokens, labels) -> loss): megatron-core's model of `arch` (an object
    with gigatron TransformerConfig's field names) and one training step."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if device.type == "cpu":
        _cpu_shims()
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    bf16 = dtype == torch.bfloat16
    config = _transformer_config(arch, device, dtype)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization=arch.normalization),
                     vocab_size=vocab_size, max_sequence_length=seq_length,
                     parallel_output=False,
                     share_embeddings_and_output_weights=not
                     arch.untie_embeddings_and_output_weights,
                     position_embedding_type=arch.position_embedding_type,
                     **_rope_scaling(arch)).to(device)
    if bf16:  # as Megatron-LM's get_model wraps it: bf16 module, fp32 logits out
        model = Float16Module(config, model)
    if device.type == "cpu":  # Megatron's optimizer allocates on 'cuda' in its constructor
        optimizer: Any = torch.optim.AdamW(model.parameters(), lr=lr)
    else:
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, bf16=bf16, params_dtype=dtype,
                            use_distributed_optimizer=False, clip_grad=1.0), [model])
    positions = torch.arange(seq_length, device=device)[None]
    causal = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device),
                        diagonal=1)[None, None]

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(model, DistributedDataParallel):
            model.zero_grad_buffer()
        optimizer.zero_grad()
        per_token = model(tokens, positions.expand_as(tokens), causal, labels=labels)
        loss = per_token.float().mean()
        loss.backward()
        if isinstance(model, DistributedDataParallel):
            model.finish_grad_sync()
        optimizer.step()
        return loss.detach()

    return model, step
