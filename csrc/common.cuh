// Shared device helpers for gigatron's fused kernels: dtype conversion, vector loads and
// block reductions. CUDA headers only, so nvcc compile-checks this without torch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace gigatron {

constexpr float kNegInf = -INFINITY;

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Launch variants (norm_variants.cuh, softmax.cu) are instantiated for bfloat16 only.
template <typename T> constexpr bool kIsBFloat16 = false;
template <> constexpr bool kIsBFloat16<__nv_bfloat16> = true;

// VEC elements moved as one aligned access (16 bytes when VEC = 16 / sizeof(T)).
template <typename T, int VEC> struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[VEC]) {
  const Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = to_float<T>(pk.v[i]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[VEC]) {
  Pack<T, VEC> pk;
#pragma unroll
  for (int i = 0; i < VEC; ++i) pk.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, VEC>*>(p) = pk;
}

struct SumOp {
  static constexpr float kIdentity = 0.0f;
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  static constexpr float kIdentity = -INFINITY;
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Reduce over the whole block (blockDim.x a multiple of 32); every thread gets the result.
// `scratch` holds 32 floats; the leading barrier lets callers reuse it back to back.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, Op op, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = warp_reduce(v, op);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : Op::kIdentity;
  return warp_reduce(v, op);
}

// Two sums in one pass over shared memory (LayerNorm backward needs both per row).
__device__ __forceinline__ float2 block_sum2(float a, float b, float2* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  SumOp op;
  a = warp_reduce(a, op);
  b = warp_reduce(b, op);
  __syncthreads();
  if (lane == 0) scratch[warp] = make_float2(a, b);
  __syncthreads();
  float2 p = lane < num_warps ? scratch[lane] : make_float2(0.0f, 0.0f);
  return make_float2(warp_reduce(p.x, op), warp_reduce(p.y, op));
}

}  // namespace gigatron
