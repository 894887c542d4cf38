// RMSNorm, and RMSNorm fused with the residual add (vLLM's fused_add_rms_norm).
//
// out = x / sqrt(mean(x^2) + eps) * weight, per row of the last dimension, in fp32.
// The fused variant works in place like vLLM's: residual <- x + residual, and
// x <- rms_norm(residual) * weight, so a decoder layer allocates nothing for it.
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"

namespace {

// Rows at least this large in total are split across OpenMP threads.
constexpr int64_t kParallelElements = 1 << 14;

inline float inv_rms(const float* row, int64_t h, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < h; ++i) sum += row[i] * row[i];
  return 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
}

inline void scale_row(const float* in, const float* weight, float scale, float* out, int64_t h) {
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) out[i] = in[i] * scale * weight[i];
}

void check_norm_args(const paddle::Tensor& x, const paddle::Tensor& weight) {
  fastdeploy_cpu::check_cpu_contiguous(x, "x");
  fastdeploy_cpu::check_cpu_contiguous(weight, "weight");
  fastdeploy_cpu::check_dtype(x, paddle::DataType::FLOAT32, "x");
  fastdeploy_cpu::check_dtype(weight, paddle::DataType::FLOAT32, "weight");
  PD_CHECK(!x.shape().empty() && weight.numel() == x.shape().back(),
           "rms_norm: weight must have as many elements as the last dimension of x.");
}

}  // namespace

namespace fastdeploy_cpu {

void rms_norm(const float* x, const float* weight, float eps, int64_t rows, int64_t h, float* out) {
#pragma omp parallel for if (rows * h >= kParallelElements) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * h;
    scale_row(row, weight, inv_rms(row, h, eps), out + r * h, h);
  }
}

void fused_add_rms_norm(float* x, float* residual, const float* weight, float eps, int64_t rows, int64_t h) {
#pragma omp parallel for if (rows * h >= kParallelElements) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * h;
    float* rr = residual + r * h;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) rr[i] += xr[i];
    scale_row(rr, weight, inv_rms(rr, h, eps), xr, h);
  }
}

}  // namespace fastdeploy_cpu

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, const paddle::Tensor& weight, float eps) {
  check_norm_args(x, weight);
  const int64_t h = x.shape().back();
  auto out = paddle::empty(x.shape(), paddle::DataType::FLOAT32, x.place());
  fastdeploy_cpu::rms_norm(x.data<float>(), weight.data<float>(), eps, h ? x.numel() / h : 0, h, out.data<float>());
  return {out};
}

void FusedAddRmsNorm(paddle::Tensor& x, paddle::Tensor& residual, const paddle::Tensor& weight, float eps) {
  check_norm_args(x, weight);
  fastdeploy_cpu::check_cpu_contiguous(residual, "residual");
  fastdeploy_cpu::check_dtype(residual, paddle::DataType::FLOAT32, "residual");
  PD_CHECK(residual.numel() == x.numel(), "fused_add_rms_norm: x and residual must have the same size.");
  const int64_t h = x.shape().back();
  fastdeploy_cpu::fused_add_rms_norm(x.data<float>(), residual.data<float>(), weight.data<float>(), eps,
                                     h ? x.numel() / h : 0, h);
}

PD_BUILD_OP(fd_rms_norm)
    .Inputs({"x", "weight"})
    .Outputs({"out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsNorm));

PD_BUILD_OP(fd_fused_add_rms_norm)
    .Inputs({"x", "residual", "weight"})
    .Outputs({"x_out", "residual_out"})
    .SetInplaceMap({{"x", "x_out"}, {"residual", "residual_out"}})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(FusedAddRmsNorm));
