// The register-cached / streaming LayerNorm and RMSNorm kernels, forward and backward, with the
// launch-variant template parameters of norm_variants.cuh. Included once, by norms.cu.
#pragma once

#include "common.cuh"
#include "gigatron_kernels.h"
#include "norm_variants.cuh"

namespace gigatron {
namespace {

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

}  // namespace
}  // namespace gigatron
