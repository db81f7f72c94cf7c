// LayerNorm and RMSNorm over the last dimension, forward and backward, one row per block.
// Rows up to blockDim * kCacheElems stay in registers; longer rows stream. Backward fuses
// the weight/bias grads into the dx pass (per-block partials in registers, then a second
// kernel sums the partials); streamed rows use a column kernel for the first stage instead.
#include "common.cuh"
#include "gigatron_kernels.h"
#include "launch_utils.cuh"
#include "norm_variants.cuh"

namespace gigatron {
namespace {

constexpr int kColumnThreads = 256;

// F: variant flags (norm_variants.cuh); LB, MB: the launch bounds. Variant 0 is <K, 1024, 1, 0>.
template <typename T, int VEC, int K, int LB = 1024, int MB = 0, int F = 0>
__global__ void __launch_bounds__(LB, MB) norm_forward_kernel(NormForwardParams p) {
  constexpr bool kVecW = (F & kVecWeight) != 0;
  constexpr bool kRes = (F & kResident) != 0;
  constexpr int KC = K > 0 ? K : 1;
  __shared__ float scratch[32];
  const int stride = blockDim.x * VEC;
  const float inv_n = 1.0f / p.n;
  float w_res[kRes ? KC : 1][VEC], b_res[kRes ? KC : 1][VEC];
  if constexpr (kRes) {
#pragma unroll
    for (int k = 0; k < KC; ++k) {
      const int col = k * stride + threadIdx.x * VEC;
      if (col < p.n) {
        load_f32<VEC, kVecW>(p.weight + col, w_res[k]);
        if (p.bias != nullptr) load_f32<VEC, kVecW>(p.bias + col, b_res[k]);
      }
    }
  }
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.n;
    T* y = static_cast<T*>(p.y) + row * p.n;
    RowCache<T, VEC, KC, (F & kPacked) != 0> cache;
    float v[VEC];
    float s = 0.0f;
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int col = k * stride + threadIdx.x * VEC;
        if (col < p.n) {
          cache.load(k, x + col);
        } else {
          cache.zero(k);
        }
        cache.get(k, v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) s += p.rms ? v[i] * v[i] : v[i];
      }
    } else {
      for (int col = threadIdx.x * VEC; col < p.n; col += stride) {
        load_vec<T, VEC>(x + col, v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) s += p.rms ? v[i] * v[i] : v[i];
      }
    }
    s = block_reduce(s, SumOp(), scratch);
    float mean = 0.0f;
    float rstd;
    if (p.rms) {
      rstd = rsqrtf(s * inv_n + p.eps);
    } else {
      // Two passes (mean, then centred squares) avoid the cancellation of E[x^2] - E[x]^2.
      mean = s * inv_n;
      float var = 0.0f;
      if constexpr (K > 0) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int col = k * stride + threadIdx.x * VEC;
          cache.get(k, v);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float d = col < p.n ? v[i] - mean : 0.0f;
            var += d * d;
          }
        }
      } else {
        for (int col = threadIdx.x * VEC; col < p.n; col += stride) {
          load_vec<T, VEC>(x + col, v);
#pragma unroll
          for (int i = 0; i < VEC; ++i) var += (v[i] - mean) * (v[i] - mean);
        }
      }
      var = block_reduce(var, SumOp(), scratch);
      rstd = rsqrtf(var * inv_n + p.eps);
    }
    if (threadIdx.x == 0) {
      if (p.mean != nullptr) p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
    auto write = [&](int k, int col, float (&in)[VEC]) {
      float w[VEC], b[VEC], out[VEC];
      if constexpr (kRes) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) w[i] = w_res[k][i], b[i] = b_res[k][i];
      } else {
        load_f32<VEC, kVecW>(p.weight + col, w);
        if (p.bias != nullptr) load_f32<VEC, kVecW>(p.bias + col, b);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        out[i] = (in[i] - mean) * rstd * w[i];
        if (p.bias != nullptr) out[i] += b[i];
      }
      store_vec<T, VEC>(y + col, out);
    };
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int col = k * stride + threadIdx.x * VEC;
        cache.get(k, v);
        if (col < p.n) write(k, col, v);
      }
    } else {
      for (int col = threadIdx.x * VEC; col < p.n; col += stride) {
        load_vec<T, VEC>(x + col, v);
        write(0, col, v);
      }
    }
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w (RMSNorm drops mean(g)).
// With K > 0 each block is persistent over rows and accumulates dy * xhat and dy for its
// columns in registers, written once as this block's partial row. Variant 0 is <K, 512, 1, 0>.
template <typename T, int VEC, int K, int LB = 512, int MB = 0, int F = 0>
__global__ void __launch_bounds__(LB, MB) norm_backward_kernel(NormBackwardParams p, int num_partials) {
  constexpr bool kVecW = (F & kVecWeight) != 0;
  constexpr bool kPack = (F & kPacked) != 0;
  constexpr bool kRes = (F & kResident) != 0;
  constexpr int KC = K > 0 ? K : 1;
  __shared__ float2 scratch[32];
  const int stride = blockDim.x * VEC;
  const float inv_n = 1.0f / p.n;
  float acc_w[KC][VEC] = {};
  float acc_b[KC][VEC] = {};
  float w_res[kRes ? KC : 1][VEC];
  if constexpr (kRes) {
#pragma unroll
    for (int k = 0; k < KC; ++k) {
      const int col = k * stride + threadIdx.x * VEC;
      if (col < p.n) load_f32<VEC, kVecW>(p.weight + col, w_res[k]);
    }
  }
  auto weights = [&](int k, int col, float (&w)[VEC]) {
    if constexpr (kRes) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) w[i] = w_res[k][i];
    } else {
      load_f32<VEC, kVecW>(p.weight + col, w);
    }
  };
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t offset = row * p.n;
    const T* x = static_cast<const T*>(p.x) + offset;
    const T* dy = static_cast<const T*>(p.dy) + offset;
    T* dx = static_cast<T*>(p.dx) + offset;
    const float mean = p.rms ? 0.0f : p.mean[row];
    const float rstd = p.rstd[row];
    RowCache<T, VEC, KC, kPack> cx, cg;
    float a[VEC], g[VEC];
    float s1 = 0.0f, s2 = 0.0f;
    auto accumulate = [&](int k, int col, float (&xv)[VEC], float (&gv)[VEC]) {
      float w[VEC];
      weights(k, col, w);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        xv[i] = (xv[i] - mean) * rstd;  // xhat
        const float gw = gv[i] * w[i];
        s1 += gw;
        s2 += gw * xv[i];
      }
    };
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int col = k * stride + threadIdx.x * VEC;
        if (col < p.n) {
          cx.load(k, x + col);
          cg.load(k, dy + col);
          if constexpr (kPack) {
            cx.get(k, a);
            cg.get(k, g);
            accumulate(k, col, a, g);
          } else {
            accumulate(k, col, cx.f[k], cg.f[k]);  // cx now holds xhat
          }
        }
      }
    } else {
      for (int col = threadIdx.x * VEC; col < p.n; col += stride) {
        load_vec<T, VEC>(x + col, a);
        load_vec<T, VEC>(dy + col, g);
        accumulate(0, col, a, g);
      }
    }
    const float2 sums = block_sum2(s1, s2, scratch);
    const float c1 = p.rms ? 0.0f : sums.x * inv_n;
    const float c2 = sums.y * inv_n;
    auto write = [&](int k, int col, const float (&xhat)[VEC], const float (&gv)[VEC]) {
      float w[VEC], out[VEC];
      weights(k, col, w);
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[i] = rstd * (gv[i] * w[i] - c1 - xhat[i] * c2);
      store_vec<T, VEC>(dx + col, out);
    };
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int col = k * stride + threadIdx.x * VEC;
        if (col < p.n) {
          if constexpr (kPack) {
            cx.get(k, a);
            cg.get(k, g);
#pragma unroll
            for (int i = 0; i < VEC; ++i) a[i] = (a[i] - mean) * rstd;
          } else {
#pragma unroll
            for (int i = 0; i < VEC; ++i) a[i] = cx.f[k][i], g[i] = cg.f[k][i];
          }
          write(k, col, a, g);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            acc_w[k][i] += g[i] * a[i];
            acc_b[k][i] += g[i];
          }
        }
      }
    } else {
      for (int col = threadIdx.x * VEC; col < p.n; col += stride) {
        load_vec<T, VEC>(x + col, a);
        load_vec<T, VEC>(dy + col, g);
#pragma unroll
        for (int i = 0; i < VEC; ++i) a[i] = (a[i] - mean) * rstd;
        write(0, col, a, g);
      }
    }
  }
  if constexpr (K > 0) {
    float* part_w = p.partials + static_cast<int64_t>(blockIdx.x) * p.n;
    float* part_b = p.partials + static_cast<int64_t>(num_partials + blockIdx.x) * p.n;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int col = k * stride + threadIdx.x * VEC;
      if (col < p.n) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          part_w[col + i] = acc_w[k][i];
          part_b[col + i] = acc_b[k][i];
        }
      }
    }
  }
}

// First stage for streamed rows: partial column sums over one chunk of rows per blockIdx.y.
template <typename T>
__global__ void norm_weight_grad_partial_kernel(NormBackwardParams p, int rows_per_chunk,
                                                int num_partials) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= p.n) return;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = begin + rows_per_chunk < p.rows ? begin + rows_per_chunk : p.rows;
  float acc_w = 0.0f, acc_b = 0.0f;
  for (int64_t row = begin; row < end; ++row) {
    const float mean = p.rms ? 0.0f : p.mean[row];
    const float g = to_float<T>(static_cast<const T*>(p.dy)[row * p.n + col]);
    const float xv = to_float<T>(static_cast<const T*>(p.x)[row * p.n + col]);
    acc_w += g * (xv - mean) * p.rstd[row];
    acc_b += g;
  }
  p.partials[static_cast<int64_t>(blockIdx.y) * p.n + col] = acc_w;
  p.partials[static_cast<int64_t>(num_partials + blockIdx.y) * p.n + col] = acc_b;
}

// Second stage: sum the `count` partial rows written by the first stage into the float32
// weight (and bias) grads; bias partials start num_partials rows after the weight partials.
__global__ void norm_weight_grad_final_kernel(NormBackwardParams p, int count, int num_partials) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= p.n) return;
  float acc_w = 0.0f, acc_b = 0.0f;
  for (int i = 0; i < count; ++i) {
    acc_w += p.partials[static_cast<int64_t>(i) * p.n + col];
    acc_b += p.partials[static_cast<int64_t>(num_partials + i) * p.n + col];
  }
  p.dweight[col] = acc_w;
  if (p.dbias != nullptr) p.dbias[col] = acc_b;
}

// Threads per block of variant v for rows of n elements, VEC per chunk; 0 if a row does not fit.
int variant_threads(const NormVariant& v, int n, int vec, bool backward) {
  const int threads = round_up_warp(ceil_div(ceil_div(n, vec), v.chunks));
  return threads <= (backward ? v.bwd_bound : v.bound) ? threads : 0;
}

// Launches variant V (>= 1) of the cached forward; false where it does not apply to p.
template <typename T, int VEC, int V>
bool launch_forward_variant(const NormForwardParams& p, cudaStream_t stream) {
  constexpr NormVariant v = kNormVariantTable[V];
  const int threads = variant_threads(v, p.n, VEC, false);
  if (threads == 0 || ((v.flags & kVecWeight) && !weights_aligned(p.weight, p.bias))) return false;
  const auto kernel = norm_forward_kernel<T, VEC, v.chunks, v.bound, v.min_blocks, v.flags>;
  const unsigned grid = (v.flags & kResident) ? resident_grid(kernel, threads, p.rows) : grid_for(p.rows);
  kernel<<<grid, threads, 0, stream>>>(p);
  return true;
}

// Launches variant p.variant (>= V); false where it does not apply.
template <typename T, int VEC, int V = 1>
bool forward_variant(const NormForwardParams& p, cudaStream_t stream) {
  if constexpr (V < kNormVariants) {
    return p.variant == V ? launch_forward_variant<T, VEC, V>(p, stream) : forward_variant<T, VEC, V + 1>(p, stream);
  } else {
    return false;
  }
}

template <typename T, int VEC>
void launch_forward(const NormForwardParams& p, cudaStream_t stream) {
  if constexpr (kHasVariants<T> && VEC > 1) {
    if (p.variant > 0 && forward_variant<T, VEC>(p, stream)) return;
  }
  const int threads = cached_threads(p.n, VEC, 1024);
  if (threads > 0) {
    norm_forward_kernel<T, VEC, cache_chunks(VEC)><<<grid_for(p.rows), threads, 0, stream>>>(p);
  } else {
    norm_forward_kernel<T, VEC, 0><<<grid_for(p.rows), 1024, 0, stream>>>(p);
  }
}

template <typename T>
void forward_dtype(const NormForwardParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (p.n % kVec == 0 && aligned16(p.x) && aligned16(p.y)) {
    launch_forward<T, kVec>(p, stream);
  } else {
    launch_forward<T, 1>(p, stream);
  }
}

// Launches variant V (>= 1) of the cached backward over num_partials persistent blocks.
template <typename T, int VEC, int V>
bool launch_backward_variant(const NormBackwardParams& p, int num_partials, cudaStream_t stream) {
  constexpr NormVariant v = kNormVariantTable[V];
  const int threads = variant_threads(v, p.n, VEC, true);
  if (threads == 0 || ((v.flags & kVecWeight) && !weights_aligned(p.weight, nullptr))) return false;
  norm_backward_kernel<T, VEC, v.chunks, v.bwd_bound, v.bwd_min_blocks, v.flags><<<num_partials, threads, 0, stream>>>(p, num_partials);
  return true;
}

template <typename T, int VEC, int V = 1>
bool backward_variant(const NormBackwardParams& p, int num_partials, cudaStream_t stream) {
  if constexpr (V < kNormVariants) {
    return p.variant == V ? launch_backward_variant<T, VEC, V>(p, num_partials, stream)
                          : backward_variant<T, VEC, V + 1>(p, num_partials, stream);
  } else {
    return false;
  }
}

template <typename T, int VEC>
void launch_backward(const NormBackwardParams& p, int num_sms, cudaStream_t stream) {
  const int num_partials = norm_backward_num_partials(p.rows, p.n, DType::kFloat32, num_sms);
  const int threads = cached_threads(p.n, VEC, 512);
  int count = num_partials;
  bool launched = false;
  if constexpr (kHasVariants<T> && VEC > 1) {
    launched = p.variant > 0 && backward_variant<T, VEC>(p, num_partials, stream);
  }
  if (launched) {
  } else if (threads > 0) {
    norm_backward_kernel<T, VEC, cache_chunks(VEC)><<<num_partials, threads, 0, stream>>>(p, num_partials);
  } else {
    norm_backward_kernel<T, VEC, 0><<<grid_for(p.rows), 512, 0, stream>>>(p, num_partials);
    const int rows_per_chunk = ceil_div(p.rows, num_partials);
    count = ceil_div(p.rows, rows_per_chunk);  // may be fewer than num_partials
    const dim3 grid(ceil_div(p.n, kColumnThreads), count);
    norm_weight_grad_partial_kernel<T><<<grid, kColumnThreads, 0, stream>>>(p, rows_per_chunk, num_partials);
  }
  norm_weight_grad_final_kernel<<<ceil_div(p.n, kColumnThreads), kColumnThreads, 0, stream>>>(p, count, num_partials);
}

template <typename T>
void backward_dtype(const NormBackwardParams& p, int num_sms, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (p.n % kVec == 0 && aligned16(p.x) && aligned16(p.dy) && aligned16(p.dx)) {
    launch_backward<T, kVec>(p, num_sms, stream);
  } else {
    launch_backward<T, 1>(p, num_sms, stream);
  }
}

}  // namespace

cudaError_t norm_forward(const NormForwardParams& p, DType dtype, cudaStream_t stream) {
  if (p.variant < 0 || p.variant >= kNormVariants) return cudaErrorInvalidValue;
  if (p.rows == 0 || p.n == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: forward_dtype<float>(p, stream); break;
    case DType::kFloat16: forward_dtype<__half>(p, stream); break;
    case DType::kBFloat16: forward_dtype<__nv_bfloat16>(p, stream); break;
  }
  return cudaGetLastError();
}

bool norm_variant_fits(int n, int variant, bool backward) {
  if (variant <= 0 || variant >= kNormVariants) return variant == 0;
  return n % 8 == 0 && variant_threads(kNormVariantTable[variant], n, 8, backward) > 0;
}

int norm_backward_num_partials(int64_t rows, int n, DType /*dtype*/, int num_sms) {
  // About 1024 resident threads per SM: enough blocks to fill the GPU, few partial rows.
  const int64_t target = static_cast<int64_t>(num_sms > 0 ? num_sms : 1) * 4;
  (void)n;
  return static_cast<int>(rows < target ? (rows > 0 ? rows : 1) : target);
}

cudaError_t norm_backward(const NormBackwardParams& p, DType dtype, int num_sms, cudaStream_t stream) {
  if (p.variant < 0 || p.variant >= kNormVariants) return cudaErrorInvalidValue;
  if (p.n == 0) return cudaSuccess;
  if (p.rows == 0) {
    cudaMemsetAsync(p.dweight, 0, sizeof(float) * p.n, stream);
    if (p.dbias != nullptr) cudaMemsetAsync(p.dbias, 0, sizeof(float) * p.n, stream);
    return cudaGetLastError();
  }
  switch (dtype) {
    case DType::kFloat32: backward_dtype<float>(p, num_sms, stream); break;
    case DType::kFloat16: backward_dtype<__half>(p, num_sms, stream); break;
    case DType::kBFloat16: backward_dtype<__nv_bfloat16>(p, num_sms, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace gigatron
