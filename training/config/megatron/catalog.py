"""Megatron-LM's and Megatron-DeepSpeed's command-line flags, by family, as data.

Facts about those projects (flag names and defaults), read from their sources, not from
gigatron: docs/MEGATRON.md is generated from them and the config table
(`gigatron.training.config.megatron.doc`). Each family is Megatron's argument group; each entry is
`--flag|--alias`, with `=default` (JSON, spaces as \\u0020) for a flag that takes a value
and whose default is not None.

- MEGATRON_LM: all 838 arguments of Megatron-LM's pretrain_gpt.py parser
  (`megatron.training.arguments.add_megatron_arguments`), NVIDIA/Megatron-LM at
  d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22).
- MEGATRON_DEEPSPEED: the 115 flags of microsoft/Megatron-DeepSpeed at
  f4157bea69f3df8c6cb66f2ebcda66ba03d1288e (megatron/arguments.py and DeepSpeed's
  `add_config_arguments`) that Megatron-LM does not have.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Iterator, Optional, Tuple

MEGATRON_LM_SOURCE = ("NVIDIA/Megatron-LM", "megatron/training/arguments.py",
                      "d98e8a64ddf34856e74b24714e3bedb2f5a39553")
MEGATRON_DEEPSPEED_SOURCE = ("microsoft/Megatron-DeepSpeed", "megatron/arguments.py",
                             "f4157bea69f3df8c6cb66f2ebcda66ba03d1288e")

MEGATRON_LM: Dict[str, str] = {
    'transformer configuration': """
        --tensor-model-parallel-size=1 --tensor-parallel-num-weight-shards
        --pipeline-model-parallel-comm-backend --pipeline-model-parallel-size=1
        --sequence-parallel --context-parallel-size=1 --hierarchical-context-parallel-sizes
        --max-seqlen-per-dp-cp-rank --hybrid-context-parallel --expert-model-parallel-size=1
        --expert-tensor-parallel-size --expert-tensor-parallel-num-weight-shards
        --no-initialization --use-cpu-initialization --fp16 --bf16 --deterministic-mode
        --tp-comm-overlap --no-tp-comm-bulk-wgrad|--disable-tp-comm-bulk-wgrad
        --no-tp-comm-bulk-dgrad|--disable-tp-comm-bulk-dgrad
        --no-tp-comm-overlap-ag|--disable-tp-comm-overlap-ag
        --no-tp-comm-overlap-rs|--disable-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad
        --no-tp-comm-split-ag|--disable-tp-comm-split-ag
        --no-tp-comm-split-rs|--disable-tp-comm-split-rs --cross-entropy-loss-fusion
        --cross-entropy-fusion-impl="native" --tp-comm-bootstrap-backend="nccl"
        --overlap-moe-expert-parallel-comm --delay-wgrad-compute
        --overlap-dispatch-backward-with-experts-wgrad --ep-overlap-early-attn-memory-release
        --use-ring-exchange-p2p --defer-embedding-wgrad-compute --wgrad-deferral-limit=0
        --overlap-p2p-communication-warmup-flush
        --microbatch-group-size-per-virtual-pipeline-stage --mtp-standalone
        --cpu-offloading-num-layers=0 --cpu-offloading-retain-pinned-cpu-buffers --num-layers
        --mtp-num-layers --mtp-loss-scaling-factor=0.1 --mtp-use-repeated-layer --mtp-detach-heads
        --mtp-hsm --mtp-hybrid-override-pattern --account-for-embedding-in-pipeline-split
        --account-for-loss-in-pipeline-split --hidden-size --num-attention-heads
        --attention-backend="auto" --flash-attention-version --softmax-type="vanilla"
        --num-query-groups=1 --ffn-hidden-size --kv-channels --hidden-dropout=0.1
        --attention-dropout=0.1 --fp32-residual-connection
        --apply-residual-connection-post-layernorm --norm-epsilon=1e-05 --apply-layernorm-1p
        --disable-bias-linear --add-qkv-bias --glu-linear-offset=0.0 --activation-func-clamp-value
        --rotary-interleaved --normalization="LayerNorm" --qk-layernorm --qk-l2-norm --qk-clip
        --qk-clip-alpha=0.5 --qk-clip-threshold=100 --attention-output-gate
        --calculate-per-token-loss --multi-latent-attention --experimental-attention-variant
        --dsa-indexer-n-heads --dsa-indexer-head-dim --dsa-indexer-topk --dsa-indexer-topk-freq=1
        --dsa-indexer-skip-topk-offset=0 --dsa-indexer-loss-coeff --dsa-indexer-use-sparse-loss
        --dsa-kernel-backend="none" --dsa-indexer-rope-interleaved
        --no-dsa-indexer-rotate-activation|--disable-dsa-indexer-rotate-activation
        --no-dsa-indexer-scoring-relu|--disable-dsa-indexer-scoring-relu
        --dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32 --linear-conv-kernel-dim=4
        --linear-key-head-dim=128 --linear-value-head-dim=128 --linear-num-key-heads=16
        --linear-num-value-heads=32 --init-method-std=0.02 --embedding-init-method-std
        --init-model-with-meta-device --use-mup --mup-width-mult=1.0 --mup-base-hidden-size
        --mup-embedding-mult=1.0 --mup-output-mult=1.0 --mup-base-head-dim
        --mup-attn-scale-power=1.0 --apply-query-key-layer-scaling
        --disable-bf16-reduced-precision-matmul --use-fused-weighted-squared-relu
        --fused-residual-rmsnorm --use-transformer-engine-op-fuser --recompute-granularity
        --recompute-method --recompute-num-layers --distribute-saved-activations
        --recompute-modules --fp8-format --fp8-recipe="delayed" --fp8-quantizer-factory
        --fp8-margin=0 --fp8-interval=1 --fp8-amax-history-len=1
        --fp8-amax-compute-algo="most_recent" --no-fp8-wgrad|--disable-fp8-wgrad --fp8-output-proj
        --first-last-layers-bf16 --num-layers-at-start-in-bf16=1 --num-layers-at-end-in-bf16=1
        --use-kitchen-attention --kitchen-attention-backend="sdpa" --fp4-format
        --fp4-recipe="nvfp4" --fp4-quantizer-factory --high-priority-a2a-comm-stream
        --moe-shared-expert-intermediate-size --moe-shared-expert-gate --moe-shared-expert-overlap
        --use-grouped-gemm-for-shared-expert --moe-shared-expert-glu-interleave-size
        --moe-ffn-hidden-size --moe-router-topk=2 --moe-enable-routing-replay
        --moe-router-padding-for-quantization --moe-router-padding-for-fp8 --moe-router-num-groups
        --moe-router-group-topk --moe-router-pre-softmax --moe-router-topk-scaling-factor
        --moe-router-score-function="softmax" --moe-router-dtype --moe-router-enable-expert-bias
        --moe-router-bias-update-rate=0.001 --moe-router-quantile-balancing-ema=0.0
        --moe-router-force-load-balancing --moe-router-force-biased
        --use-grouped-gemm-for-dense-mlp --moe-grouped-gemm --moe-use-grouped-tensor
        --moe-single-grouped-weight --moe-single-grouped-bias --moe-z-loss-coeff
        --moe-input-jitter-eps --moe-token-dispatcher-type="allgather" --moe-enable-deepep
        --moe-flex-dispatcher-backend="deepep" --moe-permute-fusion-into-hybridep
        --moe-hybridep-pad-uneven-dispatch-inputs --moe-per-layer-logging
        --moe-expert-capacity-factor --moe-pad-expert-input-to-capacity
        --moe-pad-experts-for-cuda-graph-inference --moe-token-drop-policy="probs"
        --moe-layer-recompute --moe-permute-fusion --moe-router-fusion --moe-apply-probs-on-input
        --moe-latent-size --gtp-remat-opt-in-modules=[] --moe-flex-dispatcher-num-sms
        --moe-deepep-num-sms --moe-hybridep-num-sms --moe-hybridep-num-blocks-permute
        --moe-hybridep-num-blocks-unpermute --moe-hybridep-num-sms-preprocessing=108
        --moe-ncclep-zero-copy --moe-dispatch-fwd-dtype="bf16" --moe-combine-bwd-dtype="bf16"
        --moe-mlp-glu-interleave-size --moe-expert-rank-capacity-factor --enable-cuda-graph
        --cuda-graph-warmup-steps=3 --external-cuda-graph --cuda-graph-impl="none"
        --inference-cuda-graph-scope --enable-mhc-connections --mhc-num-residual-streams=4
        --mhc-sinkhorn-iterations=20 --mhc-init-gating-factor=0.01 --mhc-recompute-layer-num
        --no-clone-scatter-output-in-embedding|--disable-clone-scatter-output-in-embedding
        --config-logger-dir="" --flash-decode --batch-invariant-mode
        --batch-invariant-backend="te_native" --use-te-activation-func --symmetric-ar-type
        --nccl-all-reduce-for-prefill --inference-fuse-tp-communication
        --inference-disable-triton-nvls-kernels --inference-grouped-gemm-backend="vllm"
        --inference-moe-disable-fused-quant-kernels --inference-moe-token-dispatcher-type="nvls"
        --mrope-section --is-hybrid-model --mamba-state-dim=128 --mamba-head-dim=64
        --mamba-num-groups=8 --mamba-num-heads --gdp-num-householder=3
        --disable-mamba-mem-eff-path --gdp-cutedsl-kernel --gdp-num-chunk-states-to-recompute=2
        --mlp-chunks-for-prefill=1 --mlp-chunks-for-training=1
        --transformer-impl="transformer_engine" --fine-grained-activation-offloading
        --offload-modules=[] --min-offloaded-tensor-size=1048576 --delay-offload-until-cuda-graph
        --delta-offload-bytes-across-pp-ranks=0 --activation-offload-fraction=1.0
        --moe-paged-stash --moe-paged-stash-page-size=64
        --moe-paged-stash-buffer-size-factor-cuda=1.1 --moe-paged-stash-buffer-size-factor-cpu=0.0
        --fine-grained-offloading-max-inflight-offloads
    """,
    'network size': """
        --encoder-num-layers --decoder-num-layers --group-query-attention --window-size
        --window-attn-skip-freq --max-position-embeddings
        --position-embedding-type="learned_absolute" --yarn-original-max-position-embeddings
        --yarn-beta-fast --yarn-beta-slow --yarn-correction-range-round-to-int
        --no-yarn-correction-range-round-to-int --relative-attention-num-buckets=32
        --relative-attention-max-distance=128 --use-rotary-position-embeddings --rotary-base=10000
        --rotary-percent=1.0 --rotary-seq-len-interpolation-factor --use-rope-scaling
        --rope-scaling-factor=8.0 --no-rope-freq --no-position-embedding
        --make-vocab-size-divisible-by=128 --openai-gelu --squared-relu --swiglu --quick-geglu
        --onnx-safe --bert-no-binary-head --untie-embeddings-and-output-weights
    """,
    'regularization': """
        --weight-decay=0.01 --apply-wd-to-qk-layernorm --clip-grad=1.0 --adam-beta1=0.9
        --adam-beta2=0.999 --adam-eps=1e-08 --sgd-momentum=0.9 --muon-momentum=0.9
        --muon-no-split-qkv --muon-nesterov --muon-scale-mode="spectral"
        --muon-fp32-matmul-prec="medium" --muon-coefficient-type="quintic" --muon-num-ns-steps=5
        --muon-tp-mode="duplicated" --muon-use-syrk --muon-extra-scale-factor=1.0
        --muon-scalar-optimizer="adam" --lion-beta1=0.95 --lion-beta2=0.98
        --no-weight-decay-cond-type
    """,
    'profiling': """
        --profile --profile-step-start=10 --profile-step-end=12 --use-pytorch-profiler
        --pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack
        --pytorch-profiler-collect-chakra --profile-ranks=[] --record-memory-history
        --memory-snapshot-path="snapshot.pickle" --record-shapes --nvtx-ranges
    """,
    'training': """
        --micro-batch-size --global-batch-size --rampup-batch-size --step-batch-size-schedule
        --decrease-batch-size-if-needed --empty-unused-memory-level=0
        --check-weight-hash-across-dp-replicas-interval --gpu-sniff-test-interval
        --train-sync-interval --train-iters --train-samples --exit-interval
        --exit-duration-in-mins --exit-signal-handler --exit-signal=15
        --exit-signal-handler-for-dataloader --exit-signal-handler-for-training --manual-gc
        --manual-gc-interval=0 --no-manual-gc-eval|--disable-manual-gc-eval
        --iterations-to-skip=[] --batch-size --recompute-activations
        --no-check-for-nan-in-loss-and-grad --check-for-large-grads
        --result-rejected-tracker-filename --tp-comm-overlap-cfg --checkpoint-activations
        --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion
        --no-bias-dropout-fusion --no-rope-fusion --rope-type --use-flash-attn --optimizer="adam"
        --optimizer-cpu-offload --optimizer-cuda-graph --optimizer-offload-fraction=1.0
        --use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d
        --dump-param-to-param-group-map --no-pin-cpu-grads --no-pin-cpu-params --dataloader-type
        --no-persist-layer-norm --no-gradient-accumulation-fusion --use-mcore-models
    """,
    'rl': """
        --perform-rl-step --rl-prompts-per-eval=32 --grpo-prompts-per-step=32 --grpo-group-size=2
        --rl-generation-lag --rl-max-inflight-requests --rl-submission-granularity="B"
        --rl-consumption-granularity="B" --rl-durable-rollout-bank --rl-rollout-bank-dir
        --rl-rollout-bank-max-bytes=0 --grpo-iterations=2 --grpo-clamp-eps-lower=0.01
        --grpo-clamp-eps-upper=0.01 --grpo-kl-beta=0.001 --grpo-entropy-term-weight=0.0
        --grpo-filter-groups-with-same-reward --langrl-env-config --rl-default-temperature=1.0
        --rl-default-top-p=0 --rl-default-top-k=-1 --rl-offload-optimizer-during-inference
        --rl-kv-cache-management-mode="persist"
        --rl-persist-cuda-graphs|--no-rl-persist-cuda-graphs
        --rl-partial-rollouts|--no-rl-partial-rollouts
        --rl-inference-logprobs-is-correction|--no-rl-inference-logprobs-is-correction
        --rl-importance-sampling-truncation-coef
        --rl-use-sequence-packing|--no-rl-use-sequence-packing
        --rl-sequence-packing-max-sequences-per-bin=50 --rl-sequence-packing-algo="fifo"
        --rl-training-cuda-graphs|--no-rl-training-cuda-graphs
        --rl-inference-tensor-model-parallel-size --rl-inference-pipeline-model-parallel-size
        --rl-inference-expert-model-parallel-size --rl-inference-expert-tensor-model-parallel-size
        --rl-inference-model-unified-memory-level=0
        --rl-offload-inference-model-weights-when-idle|--no-rl-offload-inference-model-weights-when-idle
        --refit-method="gloo" --rl-verify-model-weights-swap|--no-rl-verify-model-weights-swap
        --rl-skip-bos-token|--no-rl-skip-bos-token --rl-profile --rl-profile-dir
        --rl-inference-parsers=[]
    """,
    'RNG and initialization': """
        --seed=1234 --te-rng-tracker --inference-rng-tracker --data-parallel-random-init
        --init-method-xavier-uniform
    """,
    'learning rate and weight decay': """
        --lr-decay-style="linear" --lr-wsd-decay-style="exponential" --lr-decay-iters
        --lr-decay-samples --lr-wsd-decay-iters --lr-wsd-decay-samples --lr-warmup-fraction
        --lr-warmup-iters=0 --lr-warmup-samples=0 --lr-warmup-init=0.0
        --override-opt_param-scheduler|--override-opt-param-scheduler
        --use-checkpoint-opt_param-scheduler|--use-checkpoint-opt-param-scheduler
        --start-weight-decay --end-weight-decay --weight-decay-incr-style="constant" --lr --warmup
        --min-lr=0.0 --decoupled-lr --decoupled-min-lr --freeze-all-layers
    """,
    'checkpointing': """
        --save --save-interval|--persistent-save-interval --save-params-interval
        --save-activations-interval --save-tokens-per-expert-interval --save-wgrads-interval
        --save-dgrads-interval --save-retain-interval --load --load-main-params-from-ckpt
        --non-persistent-save-interval --non-persistent-ckpt-type --non-persistent-global-ckpt-dir
        --non-persistent-local-ckpt-dir --non-persistent-local-ckpt-algo="fully_parallel"
        --finetune --pretrained-checkpoint --ckpt-step --use-checkpoint-args
        --use-mp-args-from-checkpoint-args
        --no-use-tokenizer-model-from-checkpoint-args|--disable-use-tokenizer-model-from-checkpoint-args
        --exit-on-missing-checkpoint --ckpt-format="torch_dist" --auto-detect-ckpt-format
        --ckpt-convert-format --ckpt-convert-save --ckpt-convert-update-legacy-dist-opt-format
        --no-ckpt-fully-parallel-save --async-save --async-strategy="nvrx"
        --use-persistent-ckpt-worker --async-ckpt-cpu-priority=10 --async-ckpt-io-priority=3
        --async-ckpt-use-cpu-shm --ckpt-fully-parallel-load
        --ckpt-fully-parallel-load-exchange-algo="broadcast"
        --ckpt-fully-parallel-load-per-rank-objects --ckpt-fully-parallel-save-process-group="dp"
        --ckpt-fully-parallel-load-process-group="dp" --ckpt-assume-constant-structure
        --ckpt-pg-tensors-cache-path --ckpt-pg-tensors-cache-create
        --no-ckpt-load-validate-sharding-integrity|--disable-ckpt-load-validate-sharding-integrity
        --no-strict-fsdp-dtensor-load|--disable-strict-fsdp-dtensor-load
        --dist-ckpt-strictness="assume_ok_unexpected" --dist-ckpt-save-pre-mcore-014
        --dist-ckpt-optim-fully-reshardable --distrib-optim-fully-reshardable-mem-efficient
        --no-save-tokenizer-assets|--disable-save-tokenizer-assets --replication
        --replication-jump --replication-factor=2 --verify-integrity --no-save-optim --no-save-rng
        --no-load-optim --no-load-rng --override-ckpt-iteration --use-dist-ckpt --dist-ckpt-format
        --dist-ckpt-workers=1 --ckpt-fully-parallel-save --ckpt-drop-redundant-extra-state
    """,
    'mixed precision': """
        --grad-reduce-in-bf16 --loss-scale --initial-loss-scale=4294967296 --min-loss-scale=1.0
        --loss-scale-window=1000 --hysteresis=2 --attention-softmax-in-fp32
        --accumulate-allreduce-grads-in-fp32 --fp16-lm-cross-entropy --output-logit-dtype
        --reuse-grad-buf-for-mxfp8-param-ag --mamba-training-ssm-states-dtype
    """,
    'distributed init': """
        --distributed-backend="nccl" --distributed-timeout-minutes=10
        --no-align-grad-reduce|--disable-align-grad-reduce --local-rank=0 --lazy-mpu-init
        --use-megatron-fsdp --use-torch-fsdp2 --nccl-communicator-config-path
        --use-tp-pp-dp-mapping --disable-gloo-process-groups --use-sharp --sharp-enabled-group
        --high-priority-stream-groups=[] --distributed-timeout-seconds-after-init
        --flight-recorder-dump-path --flight-recorder-trace-buffer-size=2000
        --no-flight-recorder-dump-on-timeout|--disable-flight-recorder-dump-on-timeout
        --flight-recorder-include-stack-trace
        --no-flight-recorder-include-only-active|--disable-flight-recorder-include-only-active
        --no-flight-recorder-extra-dump-on-exec|--disable-flight-recorder-extra-dump-on-exec
        --disable-jit-fuser --decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers
        --pipeline-model-parallel-layout --model-parallel-size
        --num-layers-per-virtual-pipeline-stage --num-virtual-stages-per-pipeline-rank
        --no-overlap-p2p-communication --overlap-grad-reduce --ddp-num-buckets --ddp-bucket-size
        --ddp-pad-buckets-for-high-nccl-busbw --ddp-reduce-scatter-with-fp32-accumulation
        --gtp-remat-reduce-scatter-with-fp32-accumulation
        --ddp-param-name-patterns-for-fp32-local-accumulation=[] --ddp-average-in-collective
        --overlap-param-gather --overlap-param-gather-with-optimizer-step --no-align-param-gather
        --use-distributed-optimizer --megatron-fsdp-version=1 --no-use-layer-wise-param-layout
        --use-nccl-ub --disable-symmetric-registration --gtp-remat-nccl-ub
        --gtp-expert-remat-nccl-ub --fsdp-manual-registration --create-all-gather-group
        --data-parallel-sharding-strategy="optim_grads_params"
        --outer-dp-sharding-strategy="no_shard" --no-gradient-reduce-div-fusion
        --fsdp-double-buffer --suggested-communication-unit-size --keep-fp8-transpose-cache
        --enable-full-sharding-in-hsdp --num-distributed-optimizer-instances=1
        --torch-fsdp2-no-reshard-after-forward --cp-comm-type=["p2p"] --fake-process-group
    """,
    'validation': """
        --eval-iters=100 --eval-interval --start-eval-at-iter --eval-global-batch-size
        --eval-micro-batch-size --skip-train --test-mode --full-validation
        --multiple-validation-sets --validation-set-names
    """,
    'data and dataloader': """
        --data-path --phase-transition-iterations --split --train-data-path --valid-data-path
        --test-data-path --data-args-path --per-split-data-args-path --per-dataset-sequences-path
        --dataloader-fast-cache-load --dataloader-defer-npy-index-mmap --data-cache-path
        --no-mmap-bin-files --mock-data --seq-length --encoder-seq-length --decoder-seq-length
        --sample-rate=1.0 --mask-prob=0.15 --short-seq-prob=0.1 --num-workers=2
        --reset-position-ids --reset-attention-mask --dataloader-inter-document-masking
        --eod-mask-loss --no-create-attention-mask-in-dataloader --num-dataset-builder-threads=1
        --object-storage-cache-path --mid-level-dataset-surplus=0.005 --allow-ambiguous-pad-tokens
        --fim-data --fim-rate=0.5 --fim-spm-rate=0.5 --fim-split-sample --fim-fragment-rate
        --fim-no-prefix --fim-prefix-token="<fim_prefix>" --fim-middle-token="<fim_middle>"
        --fim-suffix-token="<fim_suffix>" --fim-pad-token="<fim_pad>"
        --fim-eod-token="<|endoftext|>"
    """,
    'tokenizer': """
        --vocab-size --padded-vocab-size --no-pad-vocab-size|--disable-pad-vocab-size --vocab-file
        --merge-file --vocab-extra-ids=0 --tokenizer-type --tokenizer-model --tokenizer-metadata
        --tokenizer-special-tokens --tiktoken-pattern --tiktoken-num-special-tokens=1000
        --tokenizer-sentencepiece-legacy
        --no-tokenizer-sentencepiece-ignore-extra-whitespaces|--disable-tokenizer-sentencepiece-ignore-extra-whitespaces
        --tokenizer-hf-no-use-fast --tokenizer-hf-no-include-special-tokens --trust-remote-code
        --null-tokenizer-eod-id --null-tokenizer-pad-id=-1 --chat-template --use-gigatoken
    """,
    'autoresume': """
        --adlr-autoresume --adlr-autoresume-interval=1000
    """,
    'biencoder': """
        --ict-head-size --biencoder-projection-dim=0 --biencoder-shared-query-context-model
        --ict-load --bert-load --titles-data-path --query-in-block-prob=0.1 --use-one-sent-docs
        --evidence-data-path --retriever-report-topk-accuracies=[] --retriever-score-scaling
        --block-data-path --embedding-path --indexer-batch-size=128 --indexer-log-interval=1000
    """,
    'vision': """
        --num-classes=1000 --img-h=224 --img-w=224 --num-channels=3 --patch-dim=16
        --classes-fraction=1.0 --data-per-class-fraction=1.0 --no-data-sharding --head-lr-mult=1.0
        --vision-pretraining --vision-pretraining-type="classify" --vision-backbone-type="vit"
        --swin-backbone-type="tiny" --mask-type="random" --mask-factor=1.0 --iter-per-epoch=1250
        --dino-local-img-size=96 --dino-local-crops-number=10 --dino-head-hidden-size=2048
        --dino-bottleneck-size=256 --dino-freeze-last-layer=1 --dino-norm-last-layer
        --dino-warmup-teacher-temp=0.04 --dino-teacher-temp=0.07
        --dino-warmup-teacher-temp-epochs=30
    """,
    'moe': """
        --num-experts --moe-layer-freq=1 --moe-use-upcycling
        --moe-router-load-balancing-type="aux_loss" --moe-aux-loss-coeff=0.0
        --moe-upcycling-granularity=1
    """,
    'mla': """
        --q-lora-rank --kv-lora-rank=32 --qk-head-dim=128 --qk-pos-emb-head-dim=64
        --v-head-dim=128 --rotary-scaling-factor=1.0 --mscale=1.0 --mscale-all-dim=0.0
        --cache-mla-latents --mla-down-proj-fusion
    """,
    'experimental_attention_variant': """
        --linear-attention-freq
    """,
    'heterogeneous architecture': """
        --heterogeneous-layers-config-path --heterogeneous-layers-config-encoded-json
    """,
    'logging': """
        --log-interval=100 --log-params-norm --log-throughput --log-progress --timing-log-level=0
        --timing-log-option="minmax" --tensorboard-dir --tensorboard-log-interval=1
        --tensorboard-queue-size=1000 --log-timers-to-tensorboard
        --no-log-loss-scale-to-tensorboard|--disable-log-loss-scale-to-tensorboard
        --log-validation-ppl-to-tensorboard --log-memory-to-tensorboard --log-memory-interval
        --log-device-memory-used --log-num-zeros-in-grad --log-max-attention-logit
        --no-barrier-with-level-1-timing --log-world-size-to-tensorboard --wandb-project
        --wandb-exp-name --wandb-save-dir --wandb-entity --logging-level --log-energy
        --moe-routing-trace-path --moe-routing-trace-max-training-iters
        --moe-routing-trace-capture-logits --moe-routing-trace-capture-hidden-states
        --moe-routing-trace-dump-weights
    """,
    'opentelemetry': """
        --otel-enabled --otel-service-name --otel-span-groups
    """,
    'Logits Distillation': """
        --logits-save-top-k --logits-save-top-p --logits-save-top-p-min-k=1 --logits-save-dir
        --logits-save-dtype="fp16" --logits-load-dir --logits-load-decode-threads=4
        --logits-load-prefetch-factor=3 --logits-load-msc-prefetch-depth=2
        --logits-load-kd-loss-alpha=1.0 --logits-load-ignore-errors
    """,
    'straggler': """
        --log-straggler --straggler-ctrlr-port=65535 --straggler-minmax-count=1
        --disable-straggler-on-startup
    """,
    'workload inspector': """
        --run-workload-inspector-server
    """,
    'inference': """
        --inference-batch-times-seqlen-threshold=-1 --max-tokens-to-oom=12000
        --output-bert-embeddings --bert-embedder-type="megatron" --cuda-graph-scope
        --cuda-graph-modules=[] --use-legacy-static-engine --inference-max-requests=8
        --inference-max-seq-length=2560 --inference-dynamic-batching
        --inference-dynamic-batching-buffer-size-gb=40.0
        --inference-dynamic-batching-paused-buffer-size-gb
        --inference-dynamic-batching-mamba-memory-ratio
        --inference-dynamic-batching-block-size=256 --inference-dynamic-batching-max-requests
        --inference-dynamic-batching-max-tokens --inference-dynamic-batching-num-cuda-graphs=16
        --inference-dynamic-batching-track-paused-request-events
        --inference-dynamic-batching-track-generated-token-events --decode-only-cuda-graphs
        --inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens=512
        --inference-dynamic-batching-unified-memory-level=0 --enable-chunked-prefill
        --num-speculative-tokens=0
        --inference-dynamic-batching-prefix-caching|--no-inference-dynamic-batching-prefix-caching
        --inference-dynamic-batching-prefix-caching-eviction-policy="ref_zero"
        --inference-dynamic-batching-prefix-caching-coordinator-policy="load_balanced"
        --inference-dynamic-batching-prefix-caching-routing-alpha=0.5
        --inference-dynamic-batching-prefix-caching-mamba-gb
        --inference-dynamic-batching-cuda-graph-mixed-prefill-count=16
        --inference-dynamic-batching-cuda-graph-sizing-distribution="exponential"
        --inference-dynamic-batching-sampling-backend="torch"
        --use-same-sampling-seed-across-dp-ranks
        --inference-dynamic-batching-async-sched-mode="legacy"
        --inference-dynamic-batching-logprobs-mode="raw_logprobs"
        --inference-logging-step-interval=0
        --inference-text-gen-server-logging|--no-inference-text-gen-server-logging
        --inference-wandb-logging|--no-inference-wandb-logging --inference-coordinator-port
        --mamba-inference-conv-states-dtype="bf16" --mamba-inference-ssm-states-dtype="bf16"
        --inference-use-synchronous-zmq-collectives|--no-inference-use-synchronous-zmq-collectives
        --inference-disable-ep-consensus|--no-inference-disable-ep-consensus --inference-shards
    """,
    'Transformer-Engine': """
        --fp4-param-gather --fp8-param-gather --te-precision-config-file
    """,
    'experimental': """
        --enable-experimental --spec --hybrid-layer-pattern --hybrid-override-pattern --yaml-cfg
        --use-precision-aware-optimizer --main-grads-dtype="fp32" --main-params-dtype="fp32"
        --exp-avg-dtype="fp32" --exp-avg-sq-dtype="fp32" --megatron-fsdp-main-params-dtype="fp32"
        --megatron-fsdp-main-grads-dtype="auto" --megatron-fsdp-grad-comm-dtype="auto"
        --megatron-fsdp-enable-fine-grained-param-gather --megatron-fsdp-max-pool-double-buffer
        --fsdp-db-use-persist-buf-on-alloc-fail
    """,
    'one logger': """
        --no-one-logger --one-logger-project="megatron-lm" --one-logger-run-name
        --one-logger-async --app-tag-run-name --app-tag-run-version="0.0.0"
    """,
    'In-process restart': """
        --inprocess-restart --inprocess-max-iterations --inprocess-monitor-thread-interval=1.0
        --inprocess-monitor-process-interval=1.0 --inprocess-progress-watchdog-interval=1.0
        --inprocess-heartbeat-interval=30 --inprocess-soft-timeout=60 --inprocess-hard-timeout=90
        --inprocess-heartbeat-timeout=60 --inprocess-barrier-timeout=120
        --inprocess-completion-timeout=120 --inprocess-last-call-wait=1
        --inprocess-termination-grace-time=1 --inprocess-granularity="node"
        --inprocess-active-world-size=1 --inprocess-empty-cuda-cache
    """,
    'ft_package': """
        --enable-ft-package --calc-ft-timeouts --ft-num-warmup-iters=5
    """,
    'rerun engine': """
        --error-injection-rate=0 --error-injection-type="transient_error"
        --rerun-mode="validate_results" --check-for-spiky-loss
    """,
    'msc': """
        --enable-msc --disable-msc
    """,
    'sft': """
        --sft --sft-tokenizer-prompt-format="nemotron-h-aligned"
    """,
    'fault injector': """
        --fault-injector-ranks --fault-injector-num-ranks --fault-injector-fault-types
        --fault-injector-fault-probabilities --fault-injector-fault-delay
        --fault-injector-delay-start-iteration --fault-injector-mtti-seconds
        --fault-injector-offset-seconds --fault-injector-seed
    """,
}

MEGATRON_DEEPSPEED: Dict[str, str] = {
    'Transformer-Engine': """
        --fp8-e4m3 --fp8-hybrid
    """,
    'retro': """
        --retro-workdir --retro-add-retriever --retro-cyclic-train-iters --retro-encoder-layers
        --retro-encoder-hidden-dropout --retro-encoder-attention-dropout --retro-num-neighbors
        --retro-num-retrieved-chunks --retro-return-doc-ids
    """,
    'network size': """
        --mlp-type --topk --expert-interval --num-key-value-heads
        --rotary-position-embeddings-theta --layernorm-epsilon --disable-mem-efficient-ln
        --num-experts-switch --embedding-weights-in-fp32 --kill-switch-file
    """,
    'logging': """
        --log-batch-size-to-tensorboard --no-log-learnig-rate-to-tensorboard
        --log-optimizer-states-to-tensorboard
    """,
    'training': """
        --enable-zbh1-pipeline --enable-zbh1-exact-semantics --distribute-checkpointed-activations
        --checkpoint-num-layers --train-tokens --random-ltd --disable-moe-token-dropping
        --moe-train-capacity-factor --moe-eval-capacity-factor --moe-min-capacity --moe-loss-coeff
        --create-moe-param-group --disable-moe-top2-2nd-expert-sampling --use-flash-attn-v2
        --use-flash-attn-triton --use-flash-attn-builder --ds-inference --cpu-optimizer
        --cpu_torch_adam --ds_fused_adam --no-pipeline-parallel --use-tutel --inference
        --no-async-tensor-model-parallel-allreduce --ds-sequence-parallel-size
        --force-ds-sequence-parallel --ds-sequence-parallel-fpdt
        --ds-sequence-parallel-fpdt-chunk-size --ds-sequence-parallel-fpdt-offloading
        --use-dataset-only
    """,
    'learning rate': """
        --lr-decay-tokens --lr-warmup-tokens
    """,
    'checkpointing': """
        --load-tag --no-load-lr-state --universal-checkpoint
    """,
    'mixed precision': """
        --no-query-key-layer-scaling
    """,
    'distributed': """
        --enable-expert-tensor-parallelism --pipeline-model-parallel-split-rank
        --moe-expert-parallel-size --overlap-p2p-communication --DDP-impl
        --no-contiguous-buffers-in-local-ddp --no-scatter-gather-tensors-in-pipeline
        --standalone-embedding-stage
    """,
    'data and dataloader': """
        --aml-data-download-path --retriever-seq-length --mmap-warmup --data-impl
        --train-data-exact-num-epochs --return-data-index --data-efficiency-curriculum-learning
        --train-idx-path --train-desc-path --train-doc-idx-path --train-sample-idx-path
        --train-shuffle-idx-path --repeated-dataloader
    """,
    'ZeRO': """
        --zero-stage --zero-reduce-scatter --zero-contigious-gradients --zero-reduce-bucket-size
        --zero-allgather-bucket-size --remote-device --use-pin-memory
    """,
    'memory optimizations': """
        --scattered-embeddings --split-transformers --memory-centric-tiled-linear --tile-factor
    """,
    'activation checkpointing': """
        --deepspeed-activation-checkpointing --partition-activations --contigious-checkpointing
        --checkpoint-in-cpu --synchronize-each-layer --profile-backward
    """,
    'distillation': """
        --num-layers-teacher --num-experts-teacher --hidden-size-teacher
        --num-attention-heads-teacher --mos --kd --kd-alpha-ce --kd-beta-ce --kd-temp
        --reset-iteration --load-teacher
    """,
    'profiling configuration': """
        --profile_steps
    """,
    'DeepSpeed (deepspeed.add_config_arguments)': """
        --deepspeed --deepspeed_config|--deepspeed-config --deepscale --deepscale_config
        --deepspeed_mpi
    """,
}


def entries(families: Dict[str, str]) -> Iterator[Tuple[str, Tuple[str, ...], Optional[Any]]]:
    """(family, (flag, aliases...), default or None) for every flag of `families`."""
    for family, text in families.items():
        for token in text.split():
            names, _, default = token.partition("=")
            yield family, tuple(names.split("|")), json.loads(default) if default else None
