// Scaled masked softmax and scaled causal softmax, forward and backward, one row per block.
// Rows up to blockDim * kCacheElems elements stay in registers (one read, one write);
// longer rows stream from global memory. Fully masked rows produce zeros.
#include "common.cuh"
#include "gigatron_kernels.h"
#include "launch_utils.cuh"

namespace gigatron {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

struct RowMask {
  const uint8_t* mask;  // null when no tensor mask
  int limit;            // columns >= limit are masked without reading (causal); else sk
  bool vec;             // mask row aligned for VEC-byte loads
};

__device__ __forceinline__ RowMask row_mask(const SoftmaxForwardParams& p, int64_t row, bool mask_vec) {
  RowMask m{nullptr, p.sk, mask_vec};
  const int64_t q = row % p.sq;
  if (p.mask_kind == MaskKind::kCausal) {
    m.limit = static_cast<int>(q + 1 < p.sk ? q + 1 : p.sk);
  } else if (p.mask_kind == MaskKind::kTensor) {
    const int64_t b = row / (static_cast<int64_t>(p.heads) * p.sq);
    const int64_t h = (row / p.sq) % p.heads;
    m.mask = p.mask + b * p.mask_stride_batch + h * p.mask_stride_head + q * p.mask_stride_query;
  }
  return m;
}

// Loads VEC scaled inputs (log2 domain) at `col`; masked entries become -inf.
template <typename T, int VEC>
__device__ __forceinline__ void load_scores(const T* x, int col, int sk, const RowMask& m,
                                            float scale, float (&v)[VEC]) {
  if (col >= m.limit || col >= sk) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = kNegInf;
    return;
  }
  load_vec<T, VEC>(x + col, v);
  uint8_t mk[VEC];
  if (m.mask != nullptr && m.vec) {
    const Pack<uint8_t, VEC> pk = *reinterpret_cast<const Pack<uint8_t, VEC>*>(m.mask + col);
#pragma unroll
    for (int i = 0; i < VEC; ++i) mk[i] = pk.v[i];
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) mk[i] = m.mask != nullptr ? m.mask[col + i] : 0;
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = (mk[i] || col + i >= m.limit) ? kNegInf : v[i] * scale;
}

__device__ __forceinline__ float exp_shifted(float v, float row_max) {
  return v == kNegInf ? 0.0f : exp2f(v - row_max);
}

// K > 0: K chunks of VEC per thread live in registers; K == 0: stream the row. LB: launch bound.
template <typename T, int VEC, int K, int LB = 1024>
__global__ void __launch_bounds__(LB)
softmax_forward_kernel(SoftmaxForwardParams p, bool mask_vec) {
  __shared__ float scratch[32];
  const float scale = p.scale * kLog2e;
  const int stride = blockDim.x * VEC;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.sk;
    T* y = static_cast<T*>(p.y) + row * p.sk;
    const RowMask m = row_mask(p, row, mask_vec);
    float cache[K > 0 ? K : 1][VEC];
    float v[VEC];
    float row_max = kNegInf;
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        load_scores<T, VEC>(x, k * stride + threadIdx.x * VEC, p.sk, m, scale, cache[k]);
#pragma unroll
        for (int i = 0; i < VEC; ++i) row_max = fmaxf(row_max, cache[k][i]);
      }
    } else {
      for (int col = threadIdx.x * VEC; col < m.limit; col += stride) {
        load_scores<T, VEC>(x, col, p.sk, m, scale, v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) row_max = fmaxf(row_max, v[i]);
      }
    }
    row_max = block_reduce(row_max, MaxOp(), scratch);
    float sum = 0.0f;
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          cache[k][i] = exp_shifted(cache[k][i], row_max);
          sum += cache[k][i];
        }
    } else {
      for (int col = threadIdx.x * VEC; col < m.limit; col += stride) {
        load_scores<T, VEC>(x, col, p.sk, m, scale, v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) sum += exp_shifted(v[i], row_max);
      }
    }
    sum = block_reduce(sum, SumOp(), scratch);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int col = k * stride + threadIdx.x * VEC;
        if (col < p.sk) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) v[i] = cache[k][i] * inv;
          store_vec<T, VEC>(y + col, v);
        }
      }
    } else {
      for (int col = threadIdx.x * VEC; col < p.sk; col += stride) {
        load_scores<T, VEC>(x, col, p.sk, m, scale, v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] = exp_shifted(v[i], row_max) * inv;
        store_vec<T, VEC>(y + col, v);
      }
    }
  }
}

// dx = scale * y * (dy - sum(dy * y)); causal rows skip the known-zero upper triangle.
template <typename T, int VEC, int K>
__global__ void __launch_bounds__(512)
softmax_backward_kernel(SoftmaxBackwardParams p) {
  __shared__ float scratch[32];
  const int stride = blockDim.x * VEC;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t offset = row * p.sk;
    const T* dy = static_cast<const T*>(p.dy) + offset;
    const T* y = static_cast<const T*>(p.y) + offset;
    T* dx = static_cast<T*>(p.dx) + offset;
    const int64_t q = row % p.sq;
    const int limit = p.causal ? static_cast<int>(q + 1 < p.sk ? q + 1 : p.sk) : p.sk;
    float cy[K > 0 ? K : 1][VEC], cg[K > 0 ? K : 1][VEC];
    float a[VEC], g[VEC];
    float dot = 0.0f;
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int col = k * stride + threadIdx.x * VEC;
        if (col < limit) {
          load_vec<T, VEC>(y + col, cy[k]);
          load_vec<T, VEC>(dy + col, cg[k]);
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) cy[k][i] = cg[k][i] = 0.0f;
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) dot += cy[k][i] * cg[k][i];
      }
    } else {
      for (int col = threadIdx.x * VEC; col < limit; col += stride) {
        load_vec<T, VEC>(y + col, a);
        load_vec<T, VEC>(dy + col, g);
#pragma unroll
        for (int i = 0; i < VEC; ++i) dot += a[i] * g[i];
      }
    }
    dot = block_reduce(dot, SumOp(), scratch);
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int col = k * stride + threadIdx.x * VEC;
        if (col < p.sk) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) a[i] = p.scale * cy[k][i] * (cg[k][i] - dot);
          store_vec<T, VEC>(dx + col, a);
        }
      }
    } else {
      for (int col = threadIdx.x * VEC; col < p.sk; col += stride) {
        if (col < limit) {
          load_vec<T, VEC>(y + col, a);
          load_vec<T, VEC>(dy + col, g);
#pragma unroll
          for (int i = 0; i < VEC; ++i) a[i] = p.scale * a[i] * (g[i] - dot);
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) a[i] = 0.0f;
        }
        store_vec<T, VEC>(dx + col, a);
      }
    }
  }
}

// Launch variants of the cached forward, for bfloat16 on the vectorized path (timed side by side
// by bench_kernels.py --sweep-softmax; the same math as variant 0, whose launch is kept):
//   0  K = 2 chunks of 8 per thread, __launch_bounds__(1024)   (today's launch)
//   1  K = 1 (threads per row = sk / 8),  __launch_bounds__(1024): sk <= 8192
//   2  K = 4 (threads per row = sk / 32), __launch_bounds__(512):  sk <= 16384
//   3  K = 8 (threads per row = sk / 64), __launch_bounds__(256):  sk <= 16384
//   4  K = 2, __launch_bounds__(512): sk <= 8192 (variant 0 keeps an 8-byte stack frame, i.e.
//      local memory, on sm_90 at 32 registers; does a different register budget remove it?)
// A row longer than the variant holds, other dtypes and the scalar path run variant 0.
template <typename T, int VEC, int K, int LB>
bool launch_forward_variant(const SoftmaxForwardParams& p, bool mask_vec, cudaStream_t stream) {
  const int threads = round_up_warp(ceil_div(ceil_div(p.sk, VEC), K));
  if (threads > LB) return false;
  softmax_forward_kernel<T, VEC, K, LB><<<grid_for(p.rows), threads, 0, stream>>>(p, mask_vec);
  return true;
}

template <typename T, int VEC>
bool forward_variant(const SoftmaxForwardParams& p, bool mask_vec, cudaStream_t stream) {
  switch (p.variant) {
    case 1: return launch_forward_variant<T, VEC, 1, 1024>(p, mask_vec, stream);
    case 2: return launch_forward_variant<T, VEC, 4, 512>(p, mask_vec, stream);
    case 3: return launch_forward_variant<T, VEC, 8, 256>(p, mask_vec, stream);
    case 4: return launch_forward_variant<T, VEC, 2, 512>(p, mask_vec, stream);
    default: return false;
  }
}

template <typename T, int VEC>
void launch_forward(const SoftmaxForwardParams& p, bool mask_vec, cudaStream_t stream) {
  if constexpr (kIsBFloat16<T> && VEC > 1) {
    if (p.variant > 0 && forward_variant<T, VEC>(p, mask_vec, stream)) return;
  }
  const int threads = cached_threads(p.sk, VEC, 1024);
  if (threads > 0) {
    softmax_forward_kernel<T, VEC, cache_chunks(VEC)><<<grid_for(p.rows), threads, 0, stream>>>(p, mask_vec);
  } else {
    softmax_forward_kernel<T, VEC, 0><<<grid_for(p.rows), 1024, 0, stream>>>(p, mask_vec);
  }
}

template <typename T>
void forward_dtype(const SoftmaxForwardParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = p.sk % kVec == 0 && aligned16(p.x) && aligned16(p.y);
  const bool mask_vec = p.mask_kind == MaskKind::kTensor &&
                        reinterpret_cast<uintptr_t>(p.mask) % kVec == 0 &&
                        p.mask_stride_batch % kVec == 0 && p.mask_stride_head % kVec == 0 &&
                        p.mask_stride_query % kVec == 0;
  if (vec) {
    launch_forward<T, kVec>(p, mask_vec, stream);
  } else {
    launch_forward<T, 1>(p, false, stream);
  }
}

template <typename T, int VEC>
void launch_backward(const SoftmaxBackwardParams& p, cudaStream_t stream) {
  const int threads = cached_threads(p.sk, VEC, 512);
  if (threads > 0) {
    softmax_backward_kernel<T, VEC, cache_chunks(VEC)><<<grid_for(p.rows), threads, 0, stream>>>(p);
  } else {
    softmax_backward_kernel<T, VEC, 0><<<grid_for(p.rows), 512, 0, stream>>>(p);
  }
}

template <typename T>
void backward_dtype(const SoftmaxBackwardParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (p.sk % kVec == 0 && aligned16(p.dy) && aligned16(p.y) && aligned16(p.dx)) {
    launch_backward<T, kVec>(p, stream);
  } else {
    launch_backward<T, 1>(p, stream);
  }
}

}  // namespace

cudaError_t softmax_forward(const SoftmaxForwardParams& p, DType dtype, cudaStream_t stream) {
  if (p.variant < 0 || p.variant >= kSoftmaxVariants) return cudaErrorInvalidValue;
  if (p.rows == 0 || p.sk == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: forward_dtype<float>(p, stream); break;
    case DType::kFloat16: forward_dtype<__half>(p, stream); break;
    case DType::kBFloat16: forward_dtype<__nv_bfloat16>(p, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t softmax_backward(const SoftmaxBackwardParams& p, DType dtype, cudaStream_t stream) {
  if (p.rows == 0 || p.sk == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: backward_dtype<float>(p, stream); break;
    case DType::kFloat16: backward_dtype<__half>(p, stream); break;
    case DType::kBFloat16: backward_dtype<__nv_bfloat16>(p, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace gigatron
