// LayerNorm and RMSNorm over the last dimension, forward and backward, one row per block.
// Rows up to blockDim * kCacheElems stay in registers; longer rows stream. Backward fuses
// the weight/bias grads into the dx pass (per-block partials in registers, then a second
// kernel sums the partials); streamed rows use a column kernel for the first stage instead.
// The row kernels are in norm_kernels.cuh; this file has the weight-grad kernels and launches.
#include "common.cuh"
#include "gigatron_kernels.h"
#include "launch_utils.cuh"
#include "norm_kernels.cuh"
#include "norm_variants.cuh"

namespace gigatron {
namespace {

constexpr int kColumnThreads = 256;

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
  if constexpr (kIsBFloat16<T> && VEC > 1) {
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
  if constexpr (kIsBFloat16<T> && VEC > 1) {
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
