// The only file that sees torch: checks tensors, picks the stream and calls the launchers
// declared in gigatron_kernels.h. Python reaches it through gigatron.ops.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdarg>
#include <cstdio>
#include <limits>
#include <tuple>

#include "gigatron_kernels.h"

namespace {

using gigatron::DType;

// Raises RuntimeError with a printf-formatted message unless `ok`. Messages are formatted here,
// never streamed through TORCH_CHECK's variadic form: on the H100 image (torch 2.11.0+cu130,
// bench/results/2026-11-26-h100/diag_throw.log) each of three streamed TORCH_CHECK messages of this
// extension segfaulted the process, while a plain const char* message raised as it should.
void require(bool ok, const char* format, ...) {
  if (ok) return;
  char message[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(message, sizeof(message), format, args);
  va_end(args);
  TORCH_CHECK(false, static_cast<const char*>(message));
}

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      require(false, "gigatron kernels take float32, float16 or bfloat16, got %s", c10::toString(t.scalar_type()));
      return DType::kFloat32;  // not reached
  }
}

void check(cudaError_t err, const char* what) {
  require(err == cudaSuccess, "gigatron %s kernel failed: %s", what, cudaGetErrorString(err));
}

int checked_int(int64_t v, const char* name) {
  require(v <= std::numeric_limits<int>::max(), "%s = %lld exceeds the kernels' int range", name,
          static_cast<long long>(v));
  return static_cast<int>(v);
}

int num_sms(const at::Tensor& t) {
  int count = 0;
  check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, t.get_device()), "SM count");
  return count;
}

void check_variant(int64_t variant) {
  require(variant >= 0 && variant < gigatron::kNormVariants,
          "norm variant must be in [0, %d), got %lld (csrc/norm_variants.cuh lists them)",
          gigatron::kNormVariants, static_cast<long long>(variant));
}

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
}

at::Tensor softmax_forward(const at::Tensor& x, const c10::optional<at::Tensor>& mask, double scale,
                           bool causal, int64_t variant) {
  require(variant >= 0 && variant < gigatron::kSoftmaxVariants,
          "softmax variant must be in [0, %d), got %lld (csrc/softmax.cu lists them)",
          gigatron::kSoftmaxVariants, static_cast<long long>(variant));
  TORCH_CHECK(x.is_cuda(), "softmax input must be a CUDA tensor");
  TORCH_CHECK(x.dim() == (causal ? 3 : 4), causal ? "causal softmax takes x [b*np, sq, sk]"
                                                  : "masked softmax takes x [b, np, sq, sk]");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  gigatron::SoftmaxForwardParams p{};
  p.x = xc.data_ptr();
  p.y = y.data_ptr();
  p.sk = checked_int(x.size(-1), "sk");
  p.sq = checked_int(x.size(-2), "sq");
  p.heads = causal ? 1 : checked_int(x.size(1), "np");
  p.rows = p.sk > 0 ? xc.numel() / p.sk : 0;
  p.scale = static_cast<float>(scale);
  p.mask_kind = causal ? gigatron::MaskKind::kCausal : gigatron::MaskKind::kNone;
  p.variant = static_cast<int>(variant);
  at::Tensor m;
  if (!causal && mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool, "softmax mask must be bool (True = masked out)");
    TORCH_CHECK(mask->dim() <= 4, "softmax mask must broadcast to x [b, np, sq, sk]");
    m = mask->to(x.device()).expand(x.sizes());
    if (m.stride(3) != 1) m = m.contiguous();
    p.mask = reinterpret_cast<const uint8_t*>(m.data_ptr());
    p.mask_stride_batch = m.stride(0);
    p.mask_stride_head = m.stride(1);
    p.mask_stride_query = m.stride(2);
    p.mask_kind = gigatron::MaskKind::kTensor;
  }
  check(gigatron::softmax_forward(p, dtype_of(x), stream_of(x)), "softmax forward");
  return y;
}

at::Tensor softmax_backward(const at::Tensor& dy, const at::Tensor& y, double scale, bool causal) {
  TORCH_CHECK(dy.is_cuda() && y.is_cuda() && dy.sizes() == y.sizes() && dy.dtype() == y.dtype(),
              "softmax backward takes dy and y of the same CUDA shape and dtype");
  const c10::cuda::CUDAGuard guard(y.device());
  const at::Tensor dyc = dy.contiguous(), yc = y.contiguous();
  at::Tensor dx = at::empty_like(yc);
  gigatron::SoftmaxBackwardParams p{};
  p.dy = dyc.data_ptr();
  p.y = yc.data_ptr();
  p.dx = dx.data_ptr();
  p.sk = checked_int(y.size(-1), "sk");
  p.sq = checked_int(y.size(-2), "sq");
  p.rows = p.sk > 0 ? yc.numel() / p.sk : 0;
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  check(gigatron::softmax_backward(p, dtype_of(y), stream_of(y)), "softmax backward");
  return dx;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_forward(const at::Tensor& x, const at::Tensor& weight,
                                                            const c10::optional<at::Tensor>& bias,
                                                            double eps, bool rms, int64_t variant) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 1, "norm input must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  check_variant(variant);
  const int64_t n = x.size(-1);
  require(weight.numel() == n, "norm weight has %lld elements, hidden size is %lld",
          static_cast<long long>(weight.numel()), static_cast<long long>(n));
  const at::Tensor xc = x.contiguous();
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  at::Tensor b;
  if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
  const int64_t rows = n > 0 ? xc.numel() / n : 0;
  at::Tensor y = at::empty_like(xc);
  const auto fopts = xc.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({rms ? 0 : rows}, fopts);
  at::Tensor rstd = at::empty({rows}, fopts);
  gigatron::NormForwardParams p{};
  p.x = xc.data_ptr();
  p.weight = w.data_ptr<float>();
  p.bias = b.defined() ? b.data_ptr<float>() : nullptr;
  p.y = y.data_ptr();
  p.mean = rms ? nullptr : mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.rows = rows;
  p.n = checked_int(n, "hidden size");
  p.eps = static_cast<float>(eps);
  p.rms = rms;
  p.variant = static_cast<int>(variant);
  check(gigatron::norm_forward(p, dtype_of(x), stream_of(x)), rms ? "RMSNorm forward" : "LayerNorm forward");
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                             const at::Tensor& weight, const at::Tensor& mean,
                                                             const at::Tensor& rstd, bool rms, bool has_bias,
                                                             int64_t variant) {
  TORCH_CHECK(dy.is_cuda() && dy.sizes() == x.sizes() && dy.dtype() == x.dtype(),
              "norm backward takes dy and x of the same CUDA shape and dtype");
  check_variant(variant);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor dyc = dy.contiguous(), xc = x.contiguous();
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n > 0 ? xc.numel() / n : 0;
  const int sms = num_sms(x);
  const DType dtype = dtype_of(x);
  const int num_partials = gigatron::norm_backward_num_partials(rows, checked_int(n, "hidden size"), dtype, sms);
  const auto fopts = xc.options().dtype(at::kFloat);
  at::Tensor dx = at::empty_like(xc);
  at::Tensor dweight = at::empty({n}, fopts);
  at::Tensor dbias = has_bias ? at::empty({n}, fopts) : at::Tensor();
  at::Tensor partials = at::empty({2 * num_partials * n}, fopts);
  gigatron::NormBackwardParams p{};
  p.dy = dyc.data_ptr();
  p.x = xc.data_ptr();
  p.weight = w.data_ptr<float>();
  p.mean = rms ? nullptr : mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.dx = dx.data_ptr();
  p.dweight = dweight.data_ptr<float>();
  p.dbias = has_bias ? dbias.data_ptr<float>() : nullptr;
  p.partials = partials.data_ptr<float>();
  p.rows = rows;
  p.n = static_cast<int>(n);
  p.rms = rms;
  p.variant = static_cast<int>(variant);
  check(gigatron::norm_backward(p, dtype, sms, stream_of(x)), rms ? "RMSNorm backward" : "LayerNorm backward");
  return {dx, dweight, dbias};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gigatron fused kernels: scaled masked/causal softmax, LayerNorm, RMSNorm";
  namespace py = pybind11;
  m.def("softmax_forward", &softmax_forward, "scaled masked or causal softmax forward", py::arg("x"),
        py::arg("mask"), py::arg("scale"), py::arg("causal"), py::arg("variant") = 0);
  m.attr("softmax_variants") = gigatron::kSoftmaxVariants;
  m.def("softmax_backward", &softmax_backward, "scaled masked or causal softmax backward");
  m.def("norm_forward", &norm_forward, "LayerNorm/RMSNorm forward -> (y, mean, rstd)", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("rms"), py::arg("variant") = 0);
  m.def("norm_backward", &norm_backward, "LayerNorm/RMSNorm backward -> (dx, dweight, dbias)", py::arg("dy"),
        py::arg("x"), py::arg("weight"), py::arg("mean"), py::arg("rstd"), py::arg("rms"), py::arg("has_bias"),
        py::arg("variant") = 0);
  m.attr("norm_variants") = gigatron::kNormVariants;
  m.def("norm_variant_fits", &gigatron::norm_variant_fits, "whether a variant runs its own launch for bf16 rows of n",
        py::arg("n"), py::arg("variant"), py::arg("backward"));
}
