#!/usr/bin/env bash
# CI: compile every csrc/*.cu for sm_80 and sm_90 with nvcc (CUDA headers only, no torch),
# warnings as errors. Skipped, with a note, where nvcc is absent.
set -uo pipefail
cd "$(dirname "$0")"
if ! command -v nvcc >/dev/null 2>&1; then
  echo "nvcc not found: skipping the CUDA kernel compile check"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
start=$SECONDS
pids=()
for f in *.cu; do
  nvcc -std=c++17 -O3 --Werror all-warnings -c "$f" -o "$out/${f%.cu}.o" \
    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
if [ "$rc" -ne 0 ]; then
  echo "CUDA compile check FAILED" >&2
  exit 1
fi
echo "CUDA compile check passed ($(ls *.cu | wc -l) files, sm_80 + sm_90, $((SECONDS - start)) s)"
