"""megatron-core's GPTModel and training step on one device, for bench_train_gpu.py.

Built as Megatron-LM's pretrain_gpt builds it for the zoo's GPT configs (local layer spec,
since Transformer Engine is absent on the device machine; learned positions, LayerNorm,
tanh-GeLU, tied embeddings): the model wrapped in megatron-core's DistributedDataParallel
(fp32 main grads) and stepped by `get_megatron_optimizer` (bf16 params, fp32 master,
Adam), which is what Megatron-LM's train_step drives. On the CPU (the bench's --tiny check
only) three CUDA-only spots are shimmed in this process, and since Megatron's optimizer
allocates on 'cuda' the model steps with torch's AdamW instead, unwrapped: the CPU run proves
the model and step run, not Megatron's optimizer. On a GPU nothing is patched.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Tuple

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


def build(num_layers: int, hidden_size: int, num_attention_heads: int, vocab_size: int,
          seq_length: int, device: torch.device, dtype: torch.dtype, lr: float = 1e-4
          ) -> Tuple[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """(model, step(tokens, labels) -> loss): megatron-core's model and one training step."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if device.type == "cpu":
        _cpu_shims()
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    bf16 = dtype == torch.bfloat16
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        ffn_hidden_size=4 * hidden_size, normalization="LayerNorm", layernorm_epsilon=1e-5,
        activation_func=lambda x: F.gelu(x, approximate="tanh"), bias_activation_fusion=False,
        add_bias_linear=True, hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16,
        params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=device.type == "cpu",
        init_method_std=0.02,
        # its fused softmax needs Apex/TE's compiled module (absent): torch's softmax
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=device.type == "cuda")
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab_size,
                     max_sequence_length=seq_length, parallel_output=False,
                     share_embeddings_and_output_weights=True,
                     position_embedding_type="learned_absolute").to(device)
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
