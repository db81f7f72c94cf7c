// Launch variants of the register-cached LayerNorm/RMSNorm kernels (norms.cu), chosen by
// NormForwardParams::variant / NormBackwardParams::variant so one GPU run can time them side by
// side. They change only how the same arithmetic is laid out, never the math: every variant
// gives the results of variant 0 up to float summation order in the block reductions.
//
// Variants apply to bfloat16 inputs on the vectorized path (n % 8 == 0, 16-byte aligned x/y/dy/dx
// and, where kVecWeight is set, 16-byte aligned weight/bias); rows longer than the variant's
// cache, float32/float16 inputs and the scalar path run variant 0 (float32 already reaches
// 80-86% of copy bandwidth; float16 would double the instantiations, and compile time).
//   0  the first launch (the binding's default): K = 2 chunks of 8 per thread, scalar float
//      weight/bias reads, __launch_bounds__(1024) forward / (512) backward, one row per block
// gigatron's autograd functions run 7 forward and 4 backward (ops/kernel_functions.py
// NORM_VARIANTS: the fastest over the H100 sweep, bench/results/2026-11-26-h100).
//   1  K = 1 (threads per row = n / 8),   scalar weight/bias
//   2  K = 4 (threads per row = n / 32),  scalar weight/bias
//   3  K = 8 (threads per row = n / 64),  scalar weight/bias
//   4  K = 1, weight/bias read as float4
//   5  K = 2, weight/bias read as float4
//   6  K = 4, weight/bias read as float4
//   7  K = 8, weight/bias read as float4
//   8  hypothesis "registers limit occupancy" (variant 0 uses 56 registers forward on sm_90,
//      so only 4 blocks of 256 threads = 4 rows = 32 KiB in flight per SM at hidden 4096):
//      K = 2, float4 weight/bias, the register cache holds the raw 16-bit packs (4 registers
//      per 8 elements instead of 8), and forward __launch_bounds__(512, 3) (<= 40 registers:
//      6 blocks of 256 threads per SM; n <= 8192). Backward: packed cache only (a register
//      cap spills its 32 floats of per-column grad sums)
//   9  hypothesis "per-row weight reloads and block launches": K = 2, float4 weight/bias,
//      packed cache, a persistent grid (forward: SMs x resident blocks) whose threads load
//      their weight/bias columns into registers once and reuse them for every row;
//      __launch_bounds__(512) (n <= 8192) so the resident weights do not spill
// Variants 1-7 size __launch_bounds__ to their K (table below), so K = 4 and 8 get more
// registers per thread than the 64 that __launch_bounds__(1024) allows.
#pragma once

#include "common.cuh"
#include "gigatron_kernels.h"

namespace gigatron {

constexpr int kVecWeight = 1;  // weight/bias as float4 loads
constexpr int kPacked = 2;     // register cache keeps raw 16-bit packs
constexpr int kResident = 4;   // persistent grid, weight/bias held in registers across rows

struct NormVariant {
  int chunks;  // K: chunks of VEC elements cached per thread
  int flags;
  int bound, min_blocks;          // forward __launch_bounds__(bound, min_blocks)
  int bwd_bound, bwd_min_blocks;  // backward
};

// Bounds: the most threads a row up to 16384 bf16 needs at K (K = 1: n <= 8192), and at
// most 512 backward (K = 2 backward holds 64 floats of x, dy and grad sums per thread); K = 4
// backward 256 (n <= 8192) for 255 registers. K = 8 backward (256 floats) spills regardless.
// min_blocks 0 leaves it unspecified, as variant 0 does: ptxas allocates registers
// differently for __launch_bounds__(1024, 1) than for __launch_bounds__(1024).
constexpr NormVariant kNormVariantTable[] = {
    {2, 0, 1024, 0, 512, 0},  // 0: documentation only, the default path launches it
    {1, 0, 1024, 0, 1024, 0},
    {4, 0, 512, 0, 256, 0},
    {8, 0, 256, 0, 256, 0},
    {1, kVecWeight, 1024, 0, 1024, 0},
    {2, kVecWeight, 1024, 0, 512, 0},
    {4, kVecWeight, 512, 0, 256, 0},
    {8, kVecWeight, 256, 0, 256, 0},
    {2, kVecWeight | kPacked, 512, 3, 512, 0},
    {2, kVecWeight | kPacked | kResident, 512, 0, 512, 0}};
static_assert(sizeof(kNormVariantTable) / sizeof(NormVariant) == kNormVariants,
              "kNormVariants (gigatron_kernels.h) must match the variant table");

// `VEC` float32 values from `p` (VEC-aligned offset): float4 loads when VECW, else scalar.
template <int VEC, bool VECW>
__device__ __forceinline__ void load_f32(const float* p, float (&out)[VEC]) {
  if constexpr (VECW && VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC / 4; ++i) {
      const float4 v = reinterpret_cast<const float4*>(p)[i];
      out[4 * i] = v.x;
      out[4 * i + 1] = v.y;
      out[4 * i + 2] = v.z;
      out[4 * i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = p[i];
  }
}

// Row chunk cache: K chunks of VEC elements, as floats or (PACKED) as the raw input packs.
template <typename T, int VEC, int K, bool PACKED>
struct RowCache {
  float f[PACKED ? 1 : K][VEC];
  Pack<T, VEC> raw[PACKED ? K : 1];

  __device__ __forceinline__ void load(int k, const T* src) {
    if constexpr (PACKED) {
      raw[k] = *reinterpret_cast<const Pack<T, VEC>*>(src);
    } else {
      load_vec<T, VEC>(src, f[k]);
    }
  }
  __device__ __forceinline__ void zero(int k) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if constexpr (PACKED) {
        raw[k].v[i] = from_float<T>(0.0f);
      } else {
        f[k][i] = 0.0f;
      }
    }
  }
  __device__ __forceinline__ void get(int k, float (&out)[VEC]) const {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if constexpr (PACKED) {
        out[i] = to_float<T>(raw[k].v[i]);
      } else {
        out[i] = f[k][i];
      }
    }
  }
};

}  // namespace gigatron
