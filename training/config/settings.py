"""The settings of concerns whose runtime config is owned elsewhere, one dataclass per concern.

`arguments.build_run` resolves them into the owner's config: ModelSettings -> the model's
TransformerConfig (a flag left at None lets the --model zoo value show through),
PrecisionSettings + OptimizerSettings -> the ZeRO wrapper's ZeroConfig and the
LRScheduleConfig, DataSettings -> GPTDataConfig and the tokenizer. Each field is one row of
the config table (see `field.setting`); the run keeps them all in `RunConfig.settings`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from gigatron.data.tokenizer import TOKENIZER_TYPES as TOKENIZERS
from gigatron.training.config.field import setting
from gigatron.training.lr.megatron import DECAY_STYLES, WSD_DECAY_STYLES


@dataclass(frozen=True)
class ModelSettings:
    """Model flags; each overrides the --model zoo config (None: the zoo's or the default)."""

    model: Optional[str] = setting(None, "zoo model name (e.g. gpt2-124m, llama3-8b)",
                                   "--model", metavar="NAME")
    num_layers: Optional[int] = setting(None, "transformer layers", "--num-layers")
    hidden_size: Optional[int] = setting(None, "width of the residual stream",
                                         "--hidden-size")
    ffn_hidden_size: Optional[int] = setting(None, "MLP inner width (default 4 x hidden; "
                                             "SwiGLU: 8/3 x hidden, rounded to 64)",
                                             "--ffn-hidden-size")
    num_attention_heads: Optional[int] = setting(None, "query heads",
                                                 "--num-attention-heads")
    num_query_groups: Optional[int] = setting(
        None, "key/value heads with --group-query-attention (Megatron's default there: 1, "
        "multi-query)", "--num-query-groups")
    num_key_value_heads: Optional[int] = setting(
        None, "Megatron-DeepSpeed's name for key/value heads: grouped-query attention "
        "without --group-query-attention", "--num-key-value-heads")
    kv_channels: Optional[int] = setting(
        None, "channels per attention head (default --hidden-size / --num-attention-heads)",
        "--kv-channels")
    seq_length: Optional[int] = setting(None, "tokens per sample", "--seq-length")
    max_position_embeddings: Optional[int] = setting(
        None, "rows of the learned position table (default --seq-length)",
        "--max-position-embeddings")
    make_vocab_size_divisible_by: Optional[int] = setting(
        None, "pad the vocabulary to a multiple of this x tp (model default 128)",
        "--make-vocab-size-divisible-by")
    position_embedding_type: Optional[str] = setting(
        None, "learned_absolute (GPT), rope (Llama) or none; mrope and relative are not "
        "supported (model default learned_absolute)", "--position-embedding-type",
        choices=("learned_absolute", "rope", "none", "mrope", "relative"))
    use_rotary_position_embeddings: bool = setting(
        False, "Megatron-DeepSpeed's (and old Megatron's) name for --position-embedding-type "
        "rope", "--use-rotary-position-embeddings")
    no_position_embedding: bool = setting(
        False, "Megatron's deprecated switch: accepted with --position-embedding-type rope (where "
        "it changes nothing, as in Megatron-Core), refused otherwise", "--no-position-embedding")
    rotary_base: Optional[float] = setting(
        None, "RoPE base theta (model default 10000)", "--rotary-base",
        "--rotary-position-embeddings-theta")
    rotary_percent: Optional[float] = setting(
        None, "fraction of each head's channels RoPE rotates (model default 1.0)",
        "--rotary-percent")
    rotary_seq_len_interpolation_factor: Optional[float] = setting(
        None, "RoPE positions divided by this (linear interpolation for longer contexts)",
        "--rotary-seq-len-interpolation-factor")
    use_rope_scaling: Optional[bool] = setting(
        None, "Llama 3.1's RoPE frequency scaling as Megatron-Core applies it (low/high "
        "frequency factors 1 and 4, original context 8192)", "--use-rope-scaling")
    rope_scaling_factor: Optional[float] = setting(
        None, "factor of --use-rope-scaling (model default 8.0)", "--rope-scaling-factor")
    rope_scaling_low_freq_factor: Optional[float] = setting(
        None, "gigatron's: --use-rope-scaling slows wavelengths above the original context / "
        "this (Hugging Face's rope_scaling.low_freq_factor; model default 1.0, the value "
        "Megatron-Core fixes)", "--rope-scaling-low-freq-factor")
    rope_scaling_high_freq_factor: Optional[float] = setting(
        None, "gigatron's: --use-rope-scaling keeps wavelengths below the original context / "
        "this (rope_scaling.high_freq_factor; model default 4.0, Megatron-Core's)",
        "--rope-scaling-high-freq-factor")
    rope_scaling_original_max_position_embeddings: Optional[int] = setting(
        None, "gigatron's: the context --use-rope-scaling's model was trained on "
        "(rope_scaling.original_max_position_embeddings; model default 8192, Megatron-Core's)",
        "--rope-scaling-original-max-position-embeddings")
    normalization: Optional[str] = setting(
        None, "norm layer (model default LayerNorm; Megatron-DeepSpeed's layernorm/rmsnorm "
        "too)", "--normalization", choices=("LayerNorm", "RMSNorm", "layernorm", "rmsnorm"))
    norm_epsilon: Optional[float] = setting(None, "epsilon of the norms (model default 1e-5)",
                                            "--norm-epsilon", "--layernorm-epsilon")
    apply_layernorm_1p: Optional[bool] = setting(
        None, "zero-centred norm weights: stored as w, initialised to 0, applied as 1 + w "
        "(Megatron-Core's layernorm_zero_centered_gamma; every norm of the model, LayerNorm "
        "or RMSNorm, as its Transformer Engine norms)", "--apply-layernorm-1p")
    qk_layernorm: Optional[bool] = setting(
        None, "normalise each attention head's query and key (over --kv-channels, before "
        "RoPE) with the model's --normalization and --norm-epsilon (Megatron-Core's "
        "qk_layernorm; Qwen3's q_norm / k_norm)", "--qk-layernorm")
    group_query_attention: Optional[bool] = setting(
        None, "use --num-query-groups key/value groups", "--group-query-attention")
    swiglu: Optional[bool] = setting(None, "SwiGLU MLP (Llama style)", "--swiglu")
    squared_relu: Optional[bool] = setting(None, "squared ReLU MLP activation",
                                           "--squared-relu")
    no_bias_gelu_fusion: bool = setting(
        False, "exact (erf) GeLU: without it GeLU is the tanh approximation of Megatron's "
        "bias-GeLU fusion (as with --disable-bias-linear, where Megatron turns the fusion off)",
        "--no-bias-gelu-fusion")
    openai_gelu: bool = setting(
        False, "accepted without effect, as in Megatron-Core (it chose the tanh GeLU of "
        "Megatron's legacy models; Megatron-Core's default bias-GeLU fusion is that GeLU)",
        "--openai-gelu")
    no_bias_swiglu_fusion: bool = setting(
        False, "accepted without effect: SwiGLU computes the same numbers fused or not",
        "--no-bias-swiglu-fusion")
    untie_embeddings_and_output_weights: Optional[bool] = setting(
        None, "separate output layer", "--untie-embeddings-and-output-weights")
    disable_bias_linear: Optional[bool] = setting(None, "no biases in linear layers",
                                                  "--disable-bias-linear")
    hidden_dropout: Optional[float] = setting(None, "dropout on residual branches (model "
                                              "default 0.1)", "--hidden-dropout")
    attention_dropout: Optional[float] = setting(None, "dropout on attention probabilities "
                                                 "(model default 0.1)", "--attention-dropout")
    init_method_std: Optional[float] = setting(None, "std of the weights' normal init (model "
                                               "default 0.02)", "--init-method-std")
    attention_backend: Optional[str] = setting(
        None, "core attention: auto, flash, fused and sdpa run torch's "
        "scaled_dot_product_attention (flash or memory-efficient kernels where the device has "
        "them), unfused and local the explicit softmax(QK^T)V of gigatron.ops (Megatron's "
        "default auto; same numbers either way)", "--attention-backend",
        choices=("auto", "flash", "fused", "unfused", "local", "sdpa"))
    recompute_granularity: Optional[str] = setting(
        None, "activation recomputation: whole layers or core attention",
        "--recompute-granularity", choices=("full", "selective"))
    recompute_method: Optional[str] = setting(
        None, "with full: chunks of N layers (uniform) or the first N (block)",
        "--recompute-method", choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = setting(
        None, "N of --recompute-method (with full: default 1, Megatron-DeepSpeed's default)",
        "--recompute-num-layers")
    recompute_activations: bool = setting(
        False, "Megatron's shorthand for --recompute-granularity selective",
        "--recompute-activations")
    checkpoint_activations: bool = setting(
        False, "Megatron-DeepSpeed's (and old Megatron's) name for --recompute-granularity "
        "full --recompute-method uniform --recompute-num-layers --checkpoint-num-layers",
        "--checkpoint-activations")
    checkpoint_num_layers: int = setting(1, "layers per recomputed chunk of "
                                         "--checkpoint-activations", "--checkpoint-num-layers")


@dataclass(frozen=True)
class PrecisionSettings:
    """Mixed precision, loss scaling and ZeRO flags (-> ZeroConfig and params dtype)."""

    fp16: bool = setting(False, "fp16 parameters with dynamic loss scaling", "--fp16",
                         ds="fp16.enabled")
    bf16: bool = setting(False, "bf16 parameters with fp32 master weights", "--bf16",
                         ds="bf16.enabled")
    loss_scale: Optional[float] = setting(
        None, "static loss scale for --fp16 (default: dynamic; without --fp16: no effect, "
        "noted in the banner)", "--loss-scale",
        ds="fp16.loss_scale", ds_as="loss_scale", ds_when="fp16", ds_doc="0 = dynamic")
    initial_loss_scale: float = setting(
        2.0 ** 32, "first dynamic loss scale (a power of 2; Megatron's default 2**32)",
        "--initial-loss-scale", ds="fp16.initial_scale_power", ds_as="power_of_2",
        ds_when="fp16", ds_doc="2**power", ds_default=2.0 ** 16)
    min_loss_scale: float = setting(1.0, "floor of the dynamic loss scale",
                                    "--min-loss-scale", ds="fp16.min_loss_scale",
                                    ds_when="fp16")
    loss_scale_window: int = setting(1000, "clean steps before the loss scale doubles",
                                     "--loss-scale-window", ds="fp16.loss_scale_window",
                                     ds_when="fp16")
    hysteresis: int = setting(2, "overflows tolerated before the loss scale halves",
                              "--hysteresis", ds="fp16.hysteresis", ds_when="fp16")
    consecutive_hysteresis: Optional[bool] = setting(
        None, "refill the hysteresis on every clean step (JSON only; default false)",
        ds="fp16.consecutive_hysteresis", ds_when="fp16", ds_default=False)
    zero_stage: Optional[int] = setting(
        None, "ZeRO stage: 1 shards optimizer state, 2 also grads, 3 also parameters "
        "(default 0, or 1 with --use-distributed-optimizer)", "--zero-stage",
        choices=(0, 1, 2, 3), ds="zero_optimization.stage", ds_default=0)
    use_distributed_optimizer: bool = setting(False, "Megatron's name for ZeRO stage 1",
                                              "--use-distributed-optimizer")
    ddp_bucket_size: Optional[int] = setting(
        None, "gradient bucket size in elements (default 500000000)", "--ddp-bucket-size",
        ds="zero_optimization.reduce_bucket_size", ds_as="count", ds_default=500_000_000)
    overlap_comm: Optional[bool] = setting(
        None, "reduce gradient buckets over data-parallel ranks while backward runs (default "
        "on here; Megatron's default is off: the numbers are the same either way)",
        "--overlap-grad-reduce", ds="zero_optimization.overlap_comm",
        ds_doc="gigatron.initialize, as DeepSpeed: default true at stage 3 only")
    overlap_param_gather: bool = setting(
        False, "overlap the updated parameters' all-gather with the next forward (needs "
        "--use-distributed-optimizer or --zero-stage >= 1, and --overlap-grad-reduce, as in "
        "Megatron): ZeRO 1-2 launch each bucket's all-gather after the step and wait for it "
        "just before the bucket's first use; ZeRO 3 gathers each layer just in time with "
        "prefetch either way",
        "--overlap-param-gather")
    grad_reduce_in_bf16: bool = setting(
        False, "with --bf16: accumulate and reduce gradients in bf16, not fp32 (Megatron's "
        "rule; without --bf16 it changes nothing, as there)", "--grad-reduce-in-bf16")
    accumulate_allreduce_grads_in_fp32: bool = setting(
        False, "accumulate and reduce gradients in fp32 (the grad buffers and the "
        "data-parallel reduction); Megatron's defaults without it: --fp16 in fp16, --bf16 in "
        "fp32 (unless --grad-reduce-in-bf16); a --deepspeed-config's data_types."
        "grad_accum_dtype \"fp32\" sets it", "--accumulate-allreduce-grads-in-fp32")
    attention_softmax_in_fp32: bool = setting(
        False, "the unfused attention's softmax in fp32 under --fp16/--bf16 (without it: in "
        "the model's dtype, as Megatron's torch softmax); torch's scaled_dot_product_attention "
        "and the fused softmax kernel compute in fp32 either way",
        "--attention-softmax-in-fp32")
    disable_bf16_reduced_precision_matmul: bool = setting(
        False, "with --bf16: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"
        " = False, as Megatron-Core sets it (CUDA's bf16 GEMMs accumulate without reduced-"
        "precision reductions; CPU GEMMs never use them)", "--disable-bf16-reduced-precision-matmul")
    optimizer_cpu_offload: bool = setting(
        False, "keep master weights and optimizer state on the host (ZeRO >= 1)",
        "--optimizer-cpu-offload", ds="zero_optimization.offload_optimizer",
        ds_as="offload", ds_doc='{"device": "cpu"} = on, "none" = off')


@dataclass(frozen=True)
class OptimizerSettings:
    """Optimizer, clipping and Megatron's learning-rate schedule (in iterations)."""

    optimizer: str = setting("adam", "adam is AdamW (decoupled weight decay); muon: Muon on "
                             "the matrices, AdamW on the rest", "--optimizer",
                             choices=("adam", "sgd", "muon"), ds="optimizer.type",
                             ds_as="optimizer_type", ds_doc="Adam, AdamW = adam; SGD = sgd")
    lr: Optional[float] = setting(None, "peak learning rate (required)", "--lr",
                                  ds="optimizer.params.lr", ds_default=0.001,
                                  ds_doc="Adagrad's: 0.01")
    min_lr: float = setting(0.0, "learning rate at the end of the decay", "--min-lr")
    lr_decay_style: str = setting("linear", "decay after warm-up", "--lr-decay-style",
                                  choices=DECAY_STYLES)
    lr_decay_iters: Optional[int] = setting(None, "iterations of warm-up + decay (default "
                                            "--train-iters)", "--lr-decay-iters")
    lr_decay_samples: Optional[int] = setting(
        None, "samples of warm-up + decay, with --train-samples (default --train-samples)",
        "--lr-decay-samples")
    lr_warmup_iters: int = setting(0, "warm-up iterations", "--lr-warmup-iters")
    lr_warmup_samples: int = setting(0, "warm-up samples, with --train-samples",
                                     "--lr-warmup-samples")
    lr_decay_tokens: Optional[int] = setting(
        None, "Megatron-DeepSpeed: tokens of warm-up + decay; overrides --lr-decay-iters/"
        "--lr-decay-samples (tokens = samples x --seq-length)", "--lr-decay-tokens")
    lr_warmup_tokens: Optional[int] = setting(
        None, "Megatron-DeepSpeed: warm-up tokens; overrides --lr-warmup-iters/"
        "--lr-warmup-samples/--lr-warmup-fraction", "--lr-warmup-tokens")
    lr_warmup_fraction: Optional[float] = setting(
        None, "warm-up as a fraction of the decay (--lr-decay-iters or --lr-decay-samples); "
        "a float, not rounded, as in Megatron", "--lr-warmup-fraction")
    lr_warmup_init: float = setting(0.0, "learning rate at the start of warm-up",
                                    "--lr-warmup-init")
    lr_wsd_decay_style: str = setting("exponential", "annealing of the WSD schedule",
                                      "--lr-wsd-decay-style", choices=WSD_DECAY_STYLES)
    lr_wsd_decay_iters: Optional[int] = setting(None, "annealing iterations of WSD",
                                                "--lr-wsd-decay-iters")
    lr_wsd_decay_samples: Optional[int] = setting(
        None, "annealing samples of WSD, with --train-samples", "--lr-wsd-decay-samples")
    weight_decay: float = setting(0.01, "decoupled weight decay (not on biases and norms)",
                                  "--weight-decay", ds="optimizer.params.weight_decay",
                                  ds_default=0.0)
    adam_beta1: float = setting(0.9, "Adam beta1", "--adam-beta1",
                                ds="optimizer.params.betas[0]", ds_when="adam")
    adam_beta2: float = setting(0.999, "Adam beta2", "--adam-beta2",
                                ds="optimizer.params.betas[1]", ds_when="adam")
    adam_eps: float = setting(1e-8, "Adam epsilon", "--adam-eps", ds="optimizer.params.eps",
                              ds_when="adam")
    sgd_momentum: float = setting(0.9, "SGD momentum", "--sgd-momentum",
                                  ds="optimizer.params.momentum", ds_when="sgd",
                                  ds_default=0.0)
    clip_grad: float = setting(1.0, "clip the global gradient norm to this (0: off)",
                               "--clip-grad", ds="gradient_clipping", ds_default=0.0)


@dataclass(frozen=True)
class LossSettings:
    """How the loss of a step is normalised (training/run/per_token_loss.py)."""

    calculate_per_token_loss: bool = setting(
        False, "normalise the loss by the unmasked tokens of the whole global batch (every "
        "token weighs the same), not per micro-batch (every micro-batch weighs the same); "
        "the logged loss is that ratio too", "--calculate-per-token-loss")


@dataclass(frozen=True)
class DataSettings:
    """Data sources and the tokenizer (-> GPTDataConfig and the tokenizer)."""

    data_path: Optional[List[str]] = setting(None, "prefix, or weight prefix weight prefix ...",
                                             "--data-path", metavar="PATH")
    split: str = setting("969,30,1", "train,valid,test weights of --data-path", "--split")
    data_args_path: Optional[str] = setting(
        None, "a file holding --data-path's words (prefixes and weights, whitespace-separated),"
        " read in its place, as Megatron-LM", "--data-args-path", metavar="FILE")
    per_split_data_args_path: Optional[str] = setting(
        None, "a JSON file {\"train\": ..., \"valid\": ..., \"test\": ...} holding "
        "--train/valid/test-data-path's words (a list or one string each), read in their "
        "place, as Megatron-LM", "--per-split-data-args-path", metavar="FILE")
    train_data_path: Optional[List[str]] = setting(None, "training prefixes (weighted)",
                                                   "--train-data-path", metavar="PATH")
    valid_data_path: Optional[List[str]] = setting(None, "validation prefixes (weighted)",
                                                   "--valid-data-path", metavar="PATH")
    test_data_path: Optional[List[str]] = setting(None, "test prefixes (weighted)",
                                                  "--test-data-path", metavar="PATH")
    mock_data: bool = setting(False, "Megatron-Core's mock documents instead of a corpus",
                              "--mock-data")
    data_cache_path: Optional[str] = setting(None, "where sample indices are cached",
                                             "--data-cache-path")
    tokenizer_type: Optional[str] = setting(
        None, "tokenizer of the corpus, Megatron-Core's meaning (docs/DATA.md); not given: "
        "GPT2BPETokenizer (Megatron's default), or with --mock-data and no --vocab-file a "
        "NullTokenizer of --vocab-size (or the --model's vocab)", "--tokenizer-type",
        choices=TOKENIZERS)
    tokenizer_model: Optional[str] = setting(
        None, "SentencePiece .model, Hugging Face tokenizer.json or its folder, or "
        "TikTokenizer's JSON vocabulary", "--tokenizer-model")
    vocab_file: Optional[str] = setting(None, "GPT-2 vocab.json or BERT vocab.txt",
                                        "--vocab-file")
    merge_file: Optional[str] = setting(None, "GPT-2 BPE merges.txt", "--merge-file")
    vocab_size: Optional[int] = setting(
        None, "NullTokenizer's vocabulary (eod is its last id, as in Megatron-Core), "
        "TikTokenizer's (default 131072), or --mock-data's", "--vocab-size")
    null_tokenizer_eod_id: Optional[int] = setting(
        None, "NullTokenizer's eod (default --vocab-size - 1)", "--null-tokenizer-eod-id")
    tiktoken_pattern: Optional[str] = setting(None, "TikTokenizer's split pattern (default "
                                              "v2)", "--tiktoken-pattern", choices=("v1", "v2"))
    tiktoken_num_special_tokens: int = setting(
        1000, "TikTokenizer: ids reserved for special tokens before the BPE ranks",
        "--tiktoken-num-special-tokens")
    tokenizer_special_tokens: Optional[List[str]] = setting(
        None, "TikTokenizer's special tokens (default <unk> <s> </s> <mask> <pad> <cls> <sep>)",
        "--tokenizer-special-tokens", metavar="TOKEN")
    tokenizer_hf_no_include_special_tokens: bool = setting(
        False, "HuggingFaceTokenizer: do not add the tokenizer's special tokens (e.g. BOS) to "
        "each document", "--tokenizer-hf-no-include-special-tokens")
    eod_mask_loss: bool = setting(False, "no loss on end-of-document tokens",
                                  "--eod-mask-loss")
    sft: bool = setting(
        False, "supervised fine-tuning, Megatron-LM's meaning: --data-path names JSON-lines "
        "files of conversations (\"messages\"), tokenized with the HuggingFaceTokenizer's chat "
        "template; a line's conversations are packed as documents and the loss is on the "
        "assistant's tokens only (docs/SFT.md)", "--sft")
    reset_position_ids: bool = setting(
        False, "positions restart at 0 after each end-of-document token "
        "(docs/PACKED_SEQUENCES.md)", "--reset-position-ids")
    reset_attention_mask: bool = setting(
        False, "attention stays inside each document of a packed sample (a document ends at "
        "its end-of-document token; docs/PACKED_SEQUENCES.md)", "--reset-attention-mask")
    tokenizer_hf_no_use_fast: bool = setting(
        False, "accepted without effect: Hugging Face tokenizers are read from tokenizer.json "
        "(the fast form), whose ids the slow form shares", "--tokenizer-hf-no-use-fast")
    trust_remote_code: bool = setting(
        False, "accepted without effect: tokenizer.json is read by the tokenizers library; no "
        "code from the tokenizer's folder runs", "--trust-remote-code")
    vocab_extra_ids: int = setting(
        0, "accepted without effect, as in Megatron-Core, whose GPT tokenizers do not use it "
        "(T5's sentinel tokens)", "--vocab-extra-ids")
    data_impl: Optional[str] = setting(
        None, "accepted (older Megatron, Megatron-DeepSpeed): the mmap .bin/.idx format is the "
        "only one, as in Megatron-Core", "--data-impl", choices=("mmap", "infer"))
    no_mmap_bin_files: bool = setting(
        False, "accepted without effect: the .bin file is memory-mapped either way (the same "
        "tokens)", "--no-mmap-bin-files")
    no_create_attention_mask_in_dataloader: bool = setting(
        False, "accepted without effect: the data loader never builds attention masks (the "
        "model's attention is causal by itself)", "--no-create-attention-mask-in-dataloader")


@dataclass(frozen=True)
class SourceSettings:
    """Where else settings come from."""

    deepspeed_config: Optional[str] = setting(
        None, "a DeepSpeed JSON config: fills flags not given; a flag that disagrees with it, "
        "or an unsupported key, is an error", "--deepspeed-config", "--deepspeed_config",
        "--deepscale_config",
        metavar="PATH")
    deepspeed: bool = setting(
        False, "Megatron-DeepSpeed's switch to its DeepSpeed engine: accepted; gigatron always "
        "runs its own engine (ZeRO by --zero-stage or --deepspeed-config)", "--deepspeed",
        "--deepscale")


@dataclass(frozen=True)
class ImplementationSettings:
    """Flags that choose an implementation, not the numbers: accepted, mapped, logged."""

    use_mcore_models: bool = setting(
        False, "accepted: gigatron's model is built like Megatron-Core's (the default of "
        "Megatron too; legacy models are not provided)", "--use-mcore-models")
    transformer_impl: Optional[str] = setting(
        None, "local: gigatron's own layers (the default here); transformer_engine "
        "(Megatron's default): Transformer Engine is not used, gigatron's layers compute the "
        "same numbers and the banner says so", "--transformer-impl",
        choices=("local", "transformer_engine"))
    use_flash_attn: bool = setting(
        False, "FlashAttention: same as --attention-backend flash (torch's "
        "scaled_dot_product_attention picks its flash kernel where the device has one)",
        "--use-flash-attn")
    deepspeed_activation_checkpointing: bool = setting(
        False, "Megatron-DeepSpeed's recomputation through DeepSpeed: accepted; what is "
        "recomputed is set by --recompute-granularity/--recompute-method as there",
        "--deepspeed-activation-checkpointing")
    no_masked_softmax_fusion: bool = setting(
        False, "accepted: the fused and unfused softmax compute the same numbers",
        "--no-masked-softmax-fusion")
    cross_entropy_loss_fusion: bool = setting(
        False, "accepted: the fused and unfused cross entropy compute the same numbers "
        "(gigatron's vocab-parallel cross entropy either way)", "--cross-entropy-loss-fusion")
    manual_gc: bool = setting(
        False, "accepted without effect: Python's garbage collector runs as usual (Megatron "
        "times its collections to keep ranks in step; no numbers change)", "--manual-gc")
    manual_gc_interval: int = setting(
        0, "accepted without effect (see --manual-gc)", "--manual-gc-interval")
    empty_unused_memory_level: int = setting(
        0, "accepted without effect: the allocator's cache is not emptied between steps "
        "(memory use only)", "--empty-unused-memory-level", choices=(0, 1, 2))
    ds_sequence_parallel_size: int = setting(
        1, "Megatron-DeepSpeed's Ulysses sequence parallelism: accepted at 1 (off); other "
        "sizes are not supported (use --sequence-parallel with tensor parallelism)",
        "--ds-sequence-parallel-size")
    no_bias_dropout_fusion: bool = setting(
        False, "accepted: bias + dropout + residual are the same numbers fused or not",
        "--no-bias-dropout-fusion")
    no_gradient_accumulation_fusion: bool = setting(
        False, "accepted: gigatron accumulates weight gradients with torch's autograd (what "
        "this flag asks Megatron to do)", "--no-gradient-accumulation-fusion")
    no_async_tensor_model_parallel_allreduce: bool = setting(
        False, "accepted: overlap of the tensor-parallel all-reduce changes no numbers",
        "--no-async-tensor-model-parallel-allreduce")
    no_query_key_layer_scaling: bool = setting(
        False, "accepted (Megatron-DeepSpeed): gigatron never scales QK^T by the layer number "
        "(Megatron-Core's default), the softmax is the same in exact arithmetic",
        "--no-query-key-layer-scaling")
    apply_query_key_layer_scaling: bool = setting(
        False, "accepted: QK^T is not scaled by the layer number (the same softmax in exact "
        "arithmetic); as in Megatron it turns on --attention-softmax-in-fp32",
        "--apply-query-key-layer-scaling")
    use_legacy_models: bool = setting(
        False, "refused: gigatron builds Megatron-Core's model only", "--use-legacy-models")
    torch_compile: Optional[bool] = setting(
        None, "compile each transformer layer and the loss with torch.compile (per block, as "
        "torchtitan's compile; not a Megatron flag): the same numbers within float rounding; "
        "the compile time is printed once, after the first step (docs/PERFORMANCE.md). "
        "Default: off on the CPU, and off on CUDA until a GPU measurement shows it faster "
        "(COMPILE_BY_DEFAULT_ON_CUDA in training/run/compile.py)", "--torch-compile",
        negative="--no-torch-compile")
