// Host API of gigatron's fused kernels: plain structs and launchers, no torch types, so the
// .cu files build with nvcc alone and binding.cpp is the only file that sees torch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace gigatron {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
enum class MaskKind : int { kNone = 0, kTensor = 1, kCausal = 2 };

// Launch variants of the softmax forward (bench_kernels.py --sweep-softmax); same result as 0.
constexpr int kSoftmaxVariants = 5;

// Softmax over the last dim of `rows` rows of length sk; row r is (batch, head, query) =
// (r / (heads * sq), (r / sq) % heads, r % sq). Mask bytes: nonzero = masked out.
struct SoftmaxForwardParams {
  const void* x;
  void* y;
  const uint8_t* mask;  // used when mask_kind == kTensor; last-dim stride 1
  int64_t mask_stride_batch, mask_stride_head, mask_stride_query;
  int64_t rows;
  int sk, sq, heads;
  float scale;
  MaskKind mask_kind;
  int variant;  // forward launch variant, 0 .. kSoftmaxVariants - 1 (softmax.cu); 0 = the default
};

struct SoftmaxBackwardParams {
  const void* dy;
  const void* y;
  void* dx;
  int64_t rows;
  int sk, sq;
  float scale;
  bool causal;  // skip the strict upper triangle, known to be zero
};

// Launch variants of the norm kernels (timed side by side by bench_kernels.py --sweep-norms);
// each computes the same result as variant 0. Out of range: cudaErrorInvalidValue.
constexpr int kNormVariants = 10;

// LayerNorm (rms = false) or RMSNorm (rms = true) over rows of length n. Weight and bias are
// float32; mean (LayerNorm only) and rstd are float32 per row, saved for backward.
struct NormForwardParams {
  const void* x;
  const float* weight;
  const float* bias;  // may be null
  void* y;
  float* mean;  // may be null for RMSNorm
  float* rstd;
  int64_t rows;
  int n;
  float eps;
  bool rms;
  int variant;  // launch variant, 0 .. kNormVariants - 1 (norm_variants.cuh); 0 = the default
};

// Backward: dx, and the float32 weight/bias grads reduced in two stages through
// `partials` (norm_backward_num_partials(...) * n floats for each of weight and bias).
struct NormBackwardParams {
  const void* dy;
  const void* x;
  const float* weight;
  const float* mean;
  const float* rstd;
  void* dx;
  float* dweight;
  float* dbias;  // may be null
  float* partials;  // 2 * num_partials * n floats
  int64_t rows;
  int n;
  bool rms;
  int variant;  // launch variant, as for the forward
};

cudaError_t softmax_forward(const SoftmaxForwardParams& p, DType dtype, cudaStream_t stream);
cudaError_t softmax_backward(const SoftmaxBackwardParams& p, DType dtype, cudaStream_t stream);
cudaError_t norm_forward(const NormForwardParams& p, DType dtype, cudaStream_t stream);
// Whether `variant` runs its own launch for bfloat16 rows of n (16-byte aligned tensors and
// weights) rather than falling back to variant 0.
bool norm_variant_fits(int n, int variant, bool backward);
int norm_backward_num_partials(int64_t rows, int n, DType dtype, int num_sms);
cudaError_t norm_backward(const NormBackwardParams& p, DType dtype, int num_sms,
                          cudaStream_t stream);

}  // namespace gigatron
