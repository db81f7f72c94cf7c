"""Why gigatron has no row for these Megatron-LM / Megatron-DeepSpeed flags, by flag prefix.

`doc.REASONS` ends with these (first match wins there; a flag that has a row is never looked
up). Each reason says what cannot apply and what gigatron does instead; speed, memory and
NCCL switches that change no number are accepted instead (`accepted.py`).
"""
from __future__ import annotations

from typing import Tuple

_GPT_ONLY = "encoder-decoder (T5) and BERT models and their data are not part of gigatron " \
            "(GPT only)"

# (flag prefixes, reason)
MORE_REASONS: Tuple[Tuple[Tuple[str, ...], str], ...] = (
    (("--batch-size", "--warmup", "--model-parallel-size"),
     "an old spelling Megatron refuses too: use --micro-batch-size, --lr-warmup-iters or "
     "--tensor-model-parallel-size"),
    (("--pipeline-model-parallel-comm-backend", "--use-ring-exchange-p2p",
      "--overlap-p2p-communication-warmup-flush", "--microbatch-group-size-per-virtual",
      "--account-for-", "--pipeline-model-parallel-layout", "--pipeline-model-parallel-split-rank",
      "--standalone-embedding-stage"),
     "this pipeline layout or schedule option is not implemented: layers are split by "
     "--decoder-first/last-pipeline-num-layers and --num-layers-per-virtual-pipeline-stage "
     "(or --num-virtual-stages-per-pipeline-rank) and scheduled by --pipeline-schedule"),
    (("--defer-embedding-wgrad", "--wgrad-deferral-limit"),
     "weight gradients are deferred by the zero-bubble schedules (--pipeline-schedule zb-h1 "
     "or zbv), not by a separate switch"),
    (("--cpu-offloading-", "--fine-grained-", "--offload-modules", "--min-offloaded-tensor",
      "--delta-offload-bytes", "--activation-offload-fraction", "--optimizer-offload-fraction"),
     "activation offloading and partial optimizer offloading are not implemented: "
     "--optimizer-cpu-offload moves all of the optimizer state to the host"),
    (("--dsa-", "--no-dsa-"), "DeepSeek sparse attention is not implemented"),
    (("--encoder-", "--decoder-num-layers", "--decoder-seq-length", "--bert-",
      "--sample-rate", "--mask-prob", "--short-seq-prob"), _GPT_ONLY),
    (("--fp32-residual-connection", "--apply-residual-connection-post-layernorm",
      "--rotary-interleaved", "--qk-l2-norm", "--qk-clip", "--attention-output-gate",
      "--relative-attention-", "--embedding-init-method-std",
      "--init-method-xavier-uniform", "--embedding-weights-in-fp32",
      "--use-fused-weighted-squared-relu",
      "--experimental-attention-variant"),
     "this layer variant is not implemented in gigatron's GPT (docs/FLAGS.md lists the model "
     "flags it has); it would change the model, so it is refused rather than ignored"),
    (("--no-initialization", "--use-cpu-initialization", "--init-model-with-meta-device",
      "--data-parallel-random-init"),
     "gigatron initialises every weight itself, the same weights at any tp/pp/dp (and the "
     "same on every data-parallel rank); other initialisation paths are not provided"),
    (("--deterministic-mode", "--batch-invariant-"),
     "deterministic and batch-invariant kernels are not selected: torch's defaults run"),
    (("--flash-attention-version", "--use-flash-attn-"),
     "a FlashAttention build is not chosen: torch's scaled_dot_product_attention picks its "
     "kernel (--use-flash-attn, --attention-backend)"),
    (("--fp16-lm-cross-entropy", "--output-logit-dtype"),
     "not implemented: logits and the cross entropy are computed in fp32"),
    (("--high-priority-", "--tensor-parallel-num-weight-shards", "--gtp-"),
     "stream priorities and weight rematerialisation across tensor-parallel ranks are not "
     "implemented"),
    (("--config-logger-dir", "--dump-param-to-param-group-map"),
     "Megatron's debugging dumps are not provided"),
    (("--apply-wd-to-qk-layernorm", "--no-weight-decay-cond-type", "--start-weight-decay",
      "--end-weight-decay", "--weight-decay-incr-style"),
     "weight-decay schedules and conditions are not implemented: --weight-decay is "
     "constant, on weights of 2 or more dimensions only"),
    (("--freeze-all-layers",), "freezing layers is not implemented"),
    (("--use-mp-args-from-checkpoint-args",),
     "not needed: gigatron's checkpoints load at any tensor/pipeline layout, so the layout "
     "comes from --tensor-model-parallel-size / --pipeline-model-parallel-size, never from "
     "the checkpoint"),
    (("--override-ckpt-iteration",),
     "rewinding a loaded checkpoint's iteration (Megatron's distillation replay) is not "
     "implemented: --ckpt-step loads an older saved iteration"),
    (("--step-batch-size-schedule", "--decrease-batch-size-if-needed"),
     "batch-size schedules other than --rampup-batch-size are not implemented"),
    (("--check-weight-hash", "--gpu-sniff-test", "--train-sync-interval",
      "--check-for-large-grads", "--result-rejected-tracker", "--iterations-to-skip"),
     "Megatron's health checks and iteration skipping are not provided "
     "(--check-for-nan-in-loss-and-grad is)"),
    (("--exit-signal", "--kill-switch-file"),
     "--exit-signal-handler acts on SIGTERM and --exit-duration-in-mins on time; other "
     "signals, per-part handlers and kill-switch files are not provided"),
    (("--dataloader-type",),
     "the data loader is Megatron's single-pass sampler; cyclic and external loaders are not "
     "provided"),
    (("--lazy-mpu-init", "--use-tp-pp-dp-mapping", "--disable-gloo-process-groups",
      "--distributed-timeout-seconds-after-init", "--flight-recorder-",
      "--no-flight-recorder-", "--fake-process-group"),
     "process groups are made by gigatron's topology (one rank order, one timeout: "
     "--distributed-timeout-minutes, its watchdog reports hangs); external initialisation, "
     "another rank order, NCCL's flight recorder and fake groups are not provided"),
    (("--ddp-reduce-scatter-with-fp32", "--ddp-param-name-patterns",
      "--ddp-average-in-collective"),
     "gradients are reduced in one dtype (--accumulate-allreduce-grads-in-fp32, "
     "--grad-reduce-in-bf16), divided by the data-parallel size before the sum; these "
     "variants would round differently"),
    (("--no-use-layer-wise-param-layout", "--suggested-communication-unit-size"),
     "Megatron's FSDP is not provided: --zero-stage 3 shards parameters the same way"),
    (("--start-eval-at-iter", "--eval-global-batch-size", "--eval-micro-batch-size",
      "--skip-train", "--test-mode", "--full-validation", "--multiple-validation-sets",
      "--validation-set-names"),
     "evaluation runs every --eval-interval for --eval-iters at the training batch sizes "
     "(`gigatron evaluate` for a checkpoint); these variants are not provided"),
    (("--phase-transition-iterations", "--per-dataset-sequences-path", "--dataloader-fast-cache-load",
      "--object-storage-cache-path", "--mid-level-dataset-surplus",
      "--allow-ambiguous-pad-tokens"),
     "this data option is not provided: --data-path (or --train/valid/test-data-path) with "
     "weights and --split"),
    (("--aml-data-download-path", "--train-data-exact-num-epochs", "--return-data-index",
      "--train-idx-path", "--train-desc-path", "--train-doc-idx-path",
      "--train-sample-idx-path", "--train-shuffle-idx-path", "--repeated-dataloader",
      "--use-dataset-only"),
     "Megatron-DeepSpeed's data-loader options are not provided (--data-cache-path keeps the "
     "sample indices)"),
    (("--ds-inference", "--cpu-optimizer", "--cpu_torch_adam", "--ds_fused_adam"),
     "DeepSpeed's inference engine and CPU/fused Adam are not used: --optimizer-cpu-offload "
     "steps the optimizer on the host"),
    (("--profile_steps",), "use --profile with --profile-step-start/--profile-step-end"),
    (("--save-params-interval", "--save-activations-interval", "--save-tokens-per-expert",
      "--save-wgrads-interval", "--save-dgrads-interval"),
     "Megatron's tensor dumps are not provided (--save writes checkpoints every "
     "--save-interval)"),
    (("--save-retain-interval",), "gigatron never deletes checkpoints"),
    (("--pretrained-checkpoint",), "use --load with --finetune"),
    (("--load-tag",), "use --ckpt-step (the iteration to load)"),
    (("--no-load-lr-state",),
     "use --override-opt_param-scheduler (the flags' schedule, not the checkpoint's)"),
    (("--universal-checkpoint",),
     "gigatron's torch_dist checkpoints load into any layout without conversion"),
    (("--onnx-safe",), "ONNX export is not part of gigatron"),
    (("--disable-mamba",), "not implemented (Mamba is not)"),
)
