// SiLU-and-multiply for the fused gate/up projection output: out = silu(x[:, :d]) * x[:, d:].
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"

namespace fastdeploy_cpu {

void silu_and_mul(const float* x, int64_t rows, int64_t d, float* out) {
#pragma omp parallel for if (rows * d >= (1 << 15)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = x + r * 2 * d;
    const float* up = gate + d;
    float* dst = out + r * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
  }
}

}  // namespace fastdeploy_cpu

std::vector<paddle::Tensor> SiluAndMul(const paddle::Tensor& x) {
  fastdeploy_cpu::check_cpu_contiguous(x, "x");
  fastdeploy_cpu::check_dtype(x, paddle::DataType::FLOAT32, "x");
  PD_CHECK(!x.shape().empty() && x.shape().back() % 2 == 0, "silu_and_mul: the last dimension must be even.");
  const int64_t width = x.shape().back();
  std::vector<int64_t> out_shape = x.shape();
  out_shape.back() = width / 2;
  auto out = paddle::empty(out_shape, paddle::DataType::FLOAT32, x.place());
  fastdeploy_cpu::silu_and_mul(x.data<float>(), width ? x.numel() / width : 0, width / 2, out.data<float>());
  return {out};
}

PD_BUILD_OP(fd_silu_and_mul).Inputs({"x"}).Outputs({"out"}).SetKernelFn(PD_KERNEL(SiluAndMul));
