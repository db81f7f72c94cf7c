#!/usr/bin/env bash
# Llama 3 8B (the zoo's llama3-8b) on NNODES nodes of 8 GPUs with torchrun's rendezvous:
# tp=8 inside a node, pp=2 across node pairs, dp = the rest; bf16, sequence parallelism,
# ZeRO stage 1, selective activation recomputation, seq 8192.
# Run the same command on every node (MASTER = first node's address):
#   NNODES=4 MASTER=node001 DATA=my-data/llama_text_document TOKENIZER=/models/llama3 \
#       bash examples/llama3_8b_multinode_torchrun.sh
# TOKENIZER is a local folder (or tokenizer.json) for HuggingFaceTokenizer. Without DATA it
# runs on --mock-data.
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-4}
MASTER=${MASTER:?set MASTER to the first node's hostname or address}
OUT=${OUT:-runs/llama3-8b}
if [ -n "${DATA:-}" ]; then
  DATA_FLAGS=(--data-path "$DATA" --split 990,9,1 --tokenizer-type HuggingFaceTokenizer
              --tokenizer-model "$TOKENIZER")
else
  DATA_FLAGS=(--mock-data)
fi
torchrun --nnodes "$NNODES" --nproc-per-node 8 \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER:29500" --rdzv-id "llama3-8b-$NNODES" \
    pretrain_gpt.py \
    --model llama3-8b --bf16 \
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --sequence-parallel \
    --use-distributed-optimizer --recompute-granularity selective \
    --micro-batch-size 1 --global-batch-size 256 --train-iters 100000 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
    "${DATA_FLAGS[@]}" \
    --log-interval 1 --eval-interval 1000 --eval-iters 10 \
    --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 500 \
    --exit-signal-handler --distributed-timeout-minutes 30 \
    --metrics-file "$OUT/metrics.jsonl" --tensorboard-dir "$OUT/tensorboard" "$@"
