#!/usr/bin/env bash
# GPT-2 small (124M, the zoo's gpt2-124m) on one GPU, bf16, Megatron's GPT-2 recipe.
#   DATA=my-data/owt_text_document VOCAB=gpt2-vocab.json MERGES=gpt2-merges.txt \
#       bash examples/gpt2_124m_single_gpu.sh
# Without DATA it trains on --mock-data (synthetic tokens of the right shapes), which checks
# the setup and measures throughput/MFU. Prepare DATA with tools/preprocess_data.py
# (--tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ... --append-eod).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpt2-124m}
if [ -n "${DATA:-}" ]; then
  DATA_FLAGS=(--data-path "$DATA" --split 949,50,1 --tokenizer-type GPT2BPETokenizer
              --vocab-file "$VOCAB" --merge-file "$MERGES")
else
  DATA_FLAGS=(--mock-data)
fi
torchrun --nproc-per-node 1 pretrain_gpt.py \
    --model gpt2-124m --seq-length 1024 --bf16 \
    --micro-batch-size 16 --global-batch-size 512 --train-iters 20000 \
    --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 700 \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
    "${DATA_FLAGS[@]}" \
    --log-interval 10 --eval-interval 500 --eval-iters 20 \
    --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 1000 \
    --exit-signal-handler --metrics-file "$OUT/metrics.jsonl" \
    --tensorboard-dir "$OUT/tensorboard" --timing-log-level 1 "$@"
