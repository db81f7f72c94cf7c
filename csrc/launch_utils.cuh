// Host-side launch helpers shared by the kernel files: shapes, alignment and error checks.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace gigatron {

// Each thread keeps up to this many row elements in registers between passes; rows longer
// than threads * kCacheElems take the streaming path that re-reads global memory.
constexpr int kCacheElems = 16;
constexpr int64_t kMaxGrid = 1 << 30;

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }
inline int round_up_warp(int t) { return std::max(32, (t + 31) / 32 * 32); }
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
inline unsigned grid_for(int64_t rows) { return static_cast<unsigned>(std::min(rows, kMaxGrid)); }

// Register-cached chunks of VEC elements per thread (scalar loads keep fewer, avoiding spills).
constexpr int cache_chunks(int vec) { return vec == 1 ? kCacheElems / 2 : kCacheElems / vec; }

// Threads for a row of n elements cached VEC at a time, or 0 if it needs more than max_threads.
inline int cached_threads(int n, int vec, int max_threads) {
  const int chunks_per_thread = cache_chunks(vec);
  const int threads = round_up_warp(ceil_div(ceil_div(n, vec), chunks_per_thread));
  return threads <= max_threads ? threads : 0;
}

// Float32 weight (and bias, when present) 16-byte aligned, for float4 reads.
inline bool weights_aligned(const float* weight, const float* bias) {
  return aligned16(weight) && (bias == nullptr || aligned16(bias));
}

// A persistent grid for `kernel` at `threads` per block: every SM full, at most one block per row.
template <typename Kernel>
unsigned resident_grid(Kernel kernel, int threads, int64_t rows) {
  int device = 0, sms = 1, per_sm = 1;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0);
  return grid_for(std::min<int64_t>(rows, static_cast<int64_t>(sms) * std::max(per_sm, 1)));
}

}  // namespace gigatron
