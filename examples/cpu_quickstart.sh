#!/usr/bin/env bash
# The README's main job, on any machine with Python and torch (no GPU, no download):
#   1. train a SentencePiece tokenizer on the Python standard library's source,
#   2. tokenize that source into Megatron .bin/.idx files,
#   3. train a small GPT on NPROC CPU processes (default 8: tp=2, pp=2, dp=2) with torchrun
#      and gloo until the validation loss has clearly fallen; metrics and the checkpoint land
#      in $OUT,
#   4. charts of the run (gigatron plot) when matplotlib is installed, else the command for them.
# Re-running starts over. Settable from the environment:
#   OUT (default runs/quickstart), ITERS (training iterations, default 120),
#   NPROC (ranks, default 8), TP and PP (tensor / pipeline sizes; default 2 each while NPROC
#   allows, the rest is data parallel), GLOBAL_BATCH (default 32, rounded up to a multiple of
#   4 x the data-parallel size), e.g. NPROC=2 ITERS=40 bash examples/cpu_quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/quickstart}
ITERS=${ITERS:-120}
NPROC=${NPROC:-8}
TP=${TP:-$(( NPROC % 2 == 0 ? 2 : 1 ))}
PP=${PP:-$(( NPROC % (TP * 2) == 0 ? 2 : 1 ))}
if (( NPROC < 1 || TP < 1 || PP < 1 || NPROC % (TP * PP) != 0 )); then
    echo "NPROC=$NPROC is not a multiple of TP x PP = $TP x $PP: set NPROC, TP and PP so that" \
        "TP x PP divides NPROC (e.g. NPROC=4 TP=2 PP=2)" >&2
    exit 2
fi
DP=$(( NPROC / (TP * PP) ))
MICRO=4
GLOBAL_BATCH=${GLOBAL_BATCH:-32}
GLOBAL_BATCH=$(( (GLOBAL_BATCH + MICRO * DP - 1) / (MICRO * DP) * MICRO * DP ))
STDLIB=$(python -c "import os; print(os.path.dirname(os.__file__))")
rm -rf "$OUT"
mkdir -p "$OUT"
export OMP_NUM_THREADS=1

echo "== [1/3] SentencePiece tokenizer (vocab 4000) on $STDLIB/*.py"
python tools/train_tokenizer.py --input "$STDLIB"/*.py --model-prefix "$OUT/spm" \
    --vocab-size 4000 --input-sentence-size 200000

echo "== [2/3] tokenizing the same files into Megatron .bin/.idx"
python tools/preprocess_data.py --input "$STDLIB"/*.py --output-prefix "$OUT/stdlib" \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/spm.model" \
    --append-eod --workers 2 --log-interval 100

echo "== [3/3] training a 4-layer GPT on $NPROC CPU rank(s): tp=$TP x pp=$PP x dp=$DP"
torchrun --nproc-per-node "$NPROC" pretrain_gpt.py \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --hidden-dropout 0 --attention-dropout 0 \
    --micro-batch-size "$MICRO" --global-batch-size "$GLOBAL_BATCH" --train-iters "$ITERS" \
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 10 \
    --weight-decay 0.01 --clip-grad 1.0 \
    --data-path "$OUT/stdlib_text_document" --split 94,4,2 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/spm.model" \
    --log-interval 10 --eval-interval 20 --eval-iters 4 \
    --save "$OUT/checkpoints" --save-interval 60 --metrics-file "$OUT/metrics.jsonl"

python - "$OUT/metrics.jsonl" <<'EOF'
import json, math, sys
records = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in records if r["type"] == "train"]
valid = [r for r in records if r["type"] == "eval" and r["split"] == "valid"]
if len(valid) < 2:
    sys.exit(f"only {len(valid)} validation result(s) in {sys.argv[1]}: set ITERS to 40 or "
             f"more (validation runs every 20 iterations) to see the loss fall")
first, last = valid[0], valid[-1]
print(f"\nvalidation loss fell from {first['lm loss']:.3f} (iteration {first['iteration']}) to "
      f"{last['lm loss']:.3f} (iteration {last['iteration']}); an untrained model scores "
      f"ln(4000) = {math.log(4000):.2f}, train loss at iteration {train[0]['iteration']}: "
      f"{train[0]['lm loss']:.3f}")
if not last["lm loss"] < first["lm loss"] - 0.3:
    sys.exit("the validation loss did not fall clearly: something is wrong")
EOF

if python -c "import matplotlib" 2>/dev/null; then
    python -m gigatron plot "$OUT/metrics.jsonl"
else
    echo "charts of this run: pip install 'gigatron[plot]' (matplotlib), then" \
        "gigatron plot $OUT/metrics.jsonl"
fi
