#!/usr/bin/env bash
# GPT-3 XL (1.3B, the zoo's gpt3-1.3b) on one node of 8 GPUs: tp=2 x pp=2 x dp=2, bf16,
# sequence parallelism, ZeRO stage 1 (Megatron's distributed optimizer).
#   DATA=my-data/pile_text_document VOCAB=gpt2-vocab.json MERGES=gpt2-merges.txt \
#       bash examples/gpt3_1.3b_8gpu.sh
# Without DATA it runs on --mock-data.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpt3-1.3b}
if [ -n "${DATA:-}" ]; then
  DATA_FLAGS=(--data-path "$DATA" --split 949,50,1 --tokenizer-type GPT2BPETokenizer
              --vocab-file "$VOCAB" --merge-file "$MERGES")
else
  DATA_FLAGS=(--mock-data)
fi
torchrun --nproc-per-node 8 pretrain_gpt.py \
    --model gpt3-1.3b --bf16 \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
    --use-distributed-optimizer \
    --micro-batch-size 4 --global-batch-size 512 --train-iters 300000 \
    --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
    "${DATA_FLAGS[@]}" \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 \
    --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 2000 \
    --exit-signal-handler --metrics-file "$OUT/metrics.jsonl" \
    --tensorboard-dir "$OUT/tensorboard" --timing-log-level 1 "$@"
