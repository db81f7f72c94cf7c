#!/usr/bin/env bash
# One device call for issue 44, its five items in priority order, each step under its own
# limit (skipped when less than its minimum is left) inside a total budget (default 540 s):
#   1. cuda-tests        every cuda-marked test (kernels, binding.cpp's error path, the
#                        attention kinds, MoE, cp blocks, offload, restart over NCCL)
#   2. side-by-side-*    Llama-style 1.14B and GPT-3 1.3B, seq 2048, bf16: gigatron eager,
#                        --torch-compile, FP8 tensorwise/delayed, torchtitan, megatron-core
#   3. norm-kernels      the norm kernels at their launch defaults against copy bandwidth
#   4. offload-capacity  --optimizer-cpu-offload up to llama-8b: host bytes/param, step time
#   5. moe-*             Mixtral-like and DeepSeek-V3-like (MLA + MoE) beside dense twins
# Raw outputs go under $GPU_SESSION_WORK (default /tmp/gpu_session); $OUT gets four files:
# session.log (everything), summary.md (each step's status and tables), results.json (each
# step's JSON and result lines) and cuda_tests.xml (junit).
#
#   bash bench/gpu_session.sh                          # on the device machine, repo root
#   GPU_SESSION_STEPS="offload-capacity moe-mixtral" bash bench/gpu_session.sh   # a subset
#   GPU_SESSION_DRY=1 bash bench/gpu_session.sh        # on a CPU: check every step's command
#
# Wheels the device lacks (megatron-core, torchtitan 0.3.0 and its needs) travel in .whl/:
# bash bench/gpu_wheels.sh here first, then name .whl in the device call's carry.
set -u
BUDGET=${BUDGET:-540}
DRY=${GPU_SESSION_DRY:-0}
STEPS=${GPU_SESSION_STEPS:-all}
OUT=${OUT:-bench_out}; mkdir -p "$OUT"; export OUT
WORK=${GPU_SESSION_WORK:-/tmp/gpu_session}; rm -rf "$WORK"; mkdir -p "$WORK"
LOG=$OUT/session.log
START=$SECONDS
N=0
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}

for wheel in megatron_core torchtitan spmd_types torch_checkpointing tyro docstring_parser typeguard; do
  ls .whl/"$wheel"-*.whl >/dev/null 2>&1 ||
    echo "=== warning: .whl/$wheel-*.whl missing (bash bench/gpu_wheels.sh; carry .whl)" | tee -a "$LOG"
done
if [ "$DRY" != 1 ]; then
  # gigatron importable without an install, laid out as setup.py installs it (package/ is
  # gigatron itself; the top-level folders and csrc/ are its subpackages)
  rm -rf /tmp/pkg && mkdir -p /tmp/pkg/gigatron
  for f in package/* parallel models ops training data engine cli csrc; do
    ln -sfn "$PWD/$f" /tmp/pkg/gigatron/
  done
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG"
  fi
  export PYTHONPATH=/tmp/site:/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}
fi

left() { echo $((BUDGET - (SECONDS - START))); }
wanted() { [ "$STEPS" = all ] || [[ " $STEPS " == *" $1 "* ]]; }
# step NAME MIN_SECONDS MAX_SECONDS COMMAND...: skipped when under MIN_SECONDS remain; its
# output in $WORK/NAME.log, its files in $WORK/NAME/, its status a line of $WORK/steps.tsv
step() {
  local name=$1 need=$2 cap=$3; shift 3
  wanted "$name" || return 0
  mkdir -p "$WORK/$name"
  N=$((N + 1))
  if [ "$DRY" = 1 ]; then
    printf '%s\0' "$name" "$@" > "$WORK/cmd_$(printf %02d $N)"
    printf '%s\tchecked\t0\t%s\n' "$name" "$(printf '%q ' "$@")" >> "$WORK/steps.tsv"
    return 0
  fi
  local remain; remain=$(left)
  if [ "$remain" -lt "$need" ]; then
    echo "=== $name: SKIPPED ($remain s left, needs $need)" | tee -a "$LOG"
    printf '%s\tskipped\t0\t%s\n' "$name" "$(printf '%q ' "$@")" >> "$WORK/steps.tsv"
    return 0
  fi
  [ "$cap" -gt "$remain" ] && cap=$remain
  echo "=== $name (limit ${cap} s, t=$((SECONDS - START)) s): $(printf '%q ' "$@")" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 5 "$cap" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  cat "$WORK/$name.log" >> "$LOG"; tail -25 "$WORK/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  printf '%s\texit %s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$(printf '%q ' "$@")" \
    >> "$WORK/steps.tsv"
}

if [ "$DRY" != 1 ]; then
  { python3 -c "import sys,torch;print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    nproc; free -g | head -2; } 2>&1 | tee -a "$LOG"
fi
BUILD=
if [ "$DRY" != 1 ] && { wanted cuda-tests || wanted norm-kernels; }; then
  # the JIT kernel build runs on the CPU while the GPU measures its ceilings
  ( python3 -m gigatron.ops --build > "$WORK/build.log" 2>&1; echo "build exit $?" >> "$WORK/build.log" ) &
  BUILD=$!
fi
step ceilings 20 40 python3 bench/ceilings.py
if [ -n "$BUILD" ]; then wait "$BUILD"; tail -15 "$WORK/build.log" | tee -a "$LOG"; fi
if [ "$DRY" = 1 ]; then step kernel-build 0 0 python3 -m gigatron.ops --build; fi

# 1. every file with cuda-marked tests (found by their marker, so new ones join by themselves);
# one xdist worker: a test that kills its process (the extension's error path segfaulted on
# the H100 before csrc/binding.cpp's fix) fails alone and a fresh worker runs the rest
CUDA_FILES=$(grep -l "pytest.mark.cuda" tests/test_*.py | tr '\n' ' ')
# shellcheck disable=SC2086
step cuda-tests 60 170 python3 -m pytest -q -p no:cacheprovider -n 1 -m cuda -rfEs --durations=10 \
  --junitxml="$WORK/cuda-tests/cuda_tests.xml" $CUDA_FILES

# 2. side by side: the contenders that decide the target first (a time limit cuts the last)
FIRST=("gigatron compiled" "torchtitan compiled" "megatron-core" "gigatron eager"
       "gigatron fp8 tensorwise" "gigatron fp8 delayed" "torchtitan")
step side-by-side-llama-1b 120 190 python3 bench/bench_side_by_side.py --model llama-1b \
  --warmup 2 --iters 5 --contender-timeout 80 --contenders "${FIRST[@]}" \
  --out "$WORK/side-by-side-llama-1b"
step side-by-side-gpt3-1.3b 90 150 python3 bench/bench_side_by_side.py --model gpt3-1.3b \
  --warmup 2 --iters 5 --contender-timeout 80 --contenders "gigatron compiled" megatron-core \
  "gigatron eager" "gigatron fp8 tensorwise" "gigatron fp8 delayed" \
  --out "$WORK/side-by-side-gpt3-1.3b"

# 3. the norms at their launch defaults (bf16 at every shape, 7B's hidden 4096 among them)
step norm-kernels 25 60 python3 bench/bench_kernels.py --norms-only --iters 30 \
  --json "$WORK/norm-kernels/norm_kernels.json"

# 4. offload capacity: each size in its own process, ascending, stops at the first that fails
step offload-capacity 90 240 python3 bench/bench_train_gpu.py --capacity \
  --sizes llama-1b llama-8b --size-timeout 170 --out "$WORK/offload-capacity"

# 5. MoE at model level beside the dense model of the same active size (seq 2048, bf16)
step moe-mixtral 45 90 python3 bench/bench_moe.py --parts train --train-models mixtral-like \
  --train-layers 4 --train-hidden 2048 --train-expert-ffn 7168 --train-experts 8 \
  --train-topk 2 --train-micro-batch 4 --seq-length 2048 --warmup 2 --iters 5 \
  --out "$WORK/moe-mixtral"
step moe-deepseek 45 90 python3 bench/bench_moe.py --parts train --train-models deepseek-v3-like \
  --train-layers 4 --train-hidden 2048 --train-expert-ffn 1408 --train-experts 64 \
  --train-topk 6 --train-micro-batch 4 --seq-length 2048 --warmup 2 --iters 5 \
  --out "$WORK/moe-deepseek"

RC=0
if [ "$DRY" = 1 ]; then
  python3 bench/gpu_session.py check "$WORK"/cmd_* 2>&1 | tee -a "$LOG"
  RC=${PIPESTATUS[0]}
fi
python3 bench/gpu_session.py collect "$WORK" "$OUT"
cp "$WORK/cuda-tests/cuda_tests.xml" "$OUT/" 2>/dev/null
echo "=== session done at t=$((SECONDS - START)) s (steps: $STEPS)" | tee -a "$LOG"
cat "$OUT/summary.md"
exit $RC
