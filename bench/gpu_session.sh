#!/usr/bin/env bash
# One device call that builds, checks and times everything the GPU issues ask for (28, 30,
# 32, 33), most important first, each step under its own time limit inside a total budget
# (default 560 s), so that a slow step costs only itself; the kernel build runs beside steps
# that need no fused kernel. Everything is logged to $OUT/session.log; the benches write
# their JSON (and gigatron's profiler trace) under $OUT: at most 8 files come back.
#
#   bash bench/gpu_session.sh            # on the device machine, from the repository root
#
# The megatron-core wheel for the device's Python travels in .whl/ (docs/PERFORMANCE.md).
set -u
BUDGET=${BUDGET:-560}
OUT=${OUT:-bench_out}; mkdir -p "$OUT"; export OUT
LOG=$OUT/session.log
START=$SECONDS
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}

# gigatron importable without an install, laid out as setup.py installs it (package/ is
# gigatron itself, with its __main__; the top-level folders and csrc/ are its subpackages)
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/gigatron
for f in package/* parallel models ops training data engine cli csrc; do
  ln -sfn "$PWD/$f" /tmp/pkg/gigatron/
done
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}

left() { echo $((BUDGET - (SECONDS - START))); }
# step NAME MIN_SECONDS MAX_SECONDS COMMAND...: skipped when under MIN_SECONDS remain
step() {
  local name=$1 need=$2 cap=$3; shift 3
  local remain; remain=$(left)
  if [ "$remain" -lt "$need" ]; then
    echo "=== $name: SKIPPED ($remain s left, needs $need)" | tee -a "$LOG"; return
  fi
  [ "$cap" -gt "$remain" ] && cap=$remain
  echo "=== $name (limit ${cap} s, t=$((SECONDS - START)) s)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 5 "$cap" "$@" 2>&1 | tee -a "$LOG"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$LOG"
}

{ python3 -c "import sys,torch;print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  nproc; free -g | head -2; } 2>&1 | tee -a "$LOG"

# the JIT kernel build runs on the CPU while the GPU measures its ceilings and runs the tests
# that need no fused kernel
( python3 -m gigatron.ops --build > /tmp/build.log 2>&1; echo "build exit $?" >> /tmp/build.log ) &
BUILD=$!
step ceilings 20 40 python3 bench/ceilings.py
# issues 28 (cp block kernels on CUDA) and 30 (torchrun restart over NCCL), MoE's grouped GEMM
step moe-cp-restart-cuda-tests 40 150 python3 -m pytest -q -p no:cacheprovider \
  tests/test_moe_cuda.py tests/test_cp_kernels_cuda.py tests/test_restart_cuda.py
# issue 32: the planner's GEMM and attention model against this GPU, at the published shapes
step plan-kernels 30 90 python3 bench/bench_plan_kernels.py --iters 10
wait $BUILD; tail -15 /tmp/build.log | tee -a "$LOG"
step cuda-tests 60 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_ops_cuda.py \
  tests/test_train_cuda.py tests/test_recompute.py tests/test_report.py tests/test_zero.py
step bench-kernels 30 90 python3 bench/bench_kernels.py --iters 30
# the launch variants of the bf16 norms and the softmax forward, to choose their defaults
step kernel-sweep 40 100 python3 bench/bench_kernels.py --iters 20 --sweep-norms --sweep-softmax \
  --json "$OUT/kernel_sweep.json"
mkdir -p "$OUT/gpt" "$OUT/llama"
step train-gpt3-1.3b 100 200 python3 bench/bench_train_gpu.py --sizes gpt3-1.3b \
  --micro-batches 8 --paths gigatron plain megatron --warmup 2 --iters 6 --out "$OUT/gpt"
step train-llama-1b 60 120 python3 bench/bench_train_gpu.py --sizes llama-1b \
  --micro-batches 8 --paths gigatron --warmup 2 --iters 6 --no-profile --out "$OUT/llama"
# issue 42: the 1.14B Llama-style model in gigatron (eager, compiled, FP8), torchtitan 0.3.0 and
# megatron-core, each contender in its own process (torchtitan's wheels travel in .whl/ too:
# docs/PERFORMANCE.md, "Side by side"); alone: python3 bench/bench_side_by_side.py
mkdir -p "$OUT/side"
step side-by-side-1b 150 420 python3 bench/bench_side_by_side.py --warmup 2 --iters 6 \
  --contender-timeout 100 --out "$OUT/side"
echo "=== session done at t=$((SECONDS - START)) s" | tee -a "$LOG"
