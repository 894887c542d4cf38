// W8A8's arithmetic outside oneDNN: the per-token activation quantization every call starts
// with, the integer-sums-to-fp32 epilogue, and the portable matmul (FD_CPU_INT_KERNEL=scalar, or a
// build without oneDNN). The oneDNN matmul between them is in linear.cc (fd_w8a8_linear).
//
// Activations are asymmetric u8 per row (token): with lo = min(min x, 0), hi = max(max x, 0),
//   s = (hi - lo) / 255,  z = round(-lo / s) in 0..255,  q = clamp(round(x / s) + z, 0, 255),
// so x ~ s (q - z). Against symmetric int8 (s = max|x| / 127) a row whose values are lopsided
// (a few large outliers of one sign, as the inputs of down_proj have) keeps about twice the
// resolution. With int8 weights w ~ ws[c] qw[k, c] per output column c,
//   y[r, c] = s[r] ws[c] (sum_k q[r, k] qw[k, c] - z[r] wsum[c]),  wsum[c] = sum_k qw[k, c],
// where the bracket is exact in int32 (|.| <= 255 * 127 * K, K < 66000), so a row's result does not
// depend on the other rows of the batch. The column sums are computed once at load.
//
// Plain C++ that GCC vectorizes with -O3 -march=native (the extension is built where it runs).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"

namespace fastdeploy_cpu {

void quantize_rows_u8(const float* x, int64_t m, int64_t k, uint8_t* q, float* scale, int32_t* zero) {
#pragma omp parallel for schedule(static) if (m >= 16)
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * k;
    uint8_t* out = q + r * k;
    float lo = 0.0f, hi = 0.0f;
#pragma omp simd reduction(min : lo) reduction(max : hi)
    for (int64_t i = 0; i < k; ++i) {
      lo = row[i] < lo ? row[i] : lo;
      hi = row[i] > hi ? row[i] : hi;
    }
    const float s = (hi - lo) / 255.0f;
    const float inv = s != 0.0f ? 1.0f / s : 0.0f;
    const float zf = std::nearbyint(-lo * inv);
    // -lo * inv is in [0, 255] up to rounding; the clamp keeps z a valid u8 whatever the rounding did.
    const int32_t z = static_cast<int32_t>(zf < 0.0f ? 0.0f : (zf > 255.0f ? 255.0f : zf));
    const float zq = static_cast<float>(z);
    // In fp32 before the conversion: round(x / s) + z is an integer below 2^24, so the sum is exact
    // and the clamp is the same as in integers; GCC vectorizes this form (not the int32 one).
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) {
      float v = std::nearbyint(row[i] * inv) + zq;
      v = v < 0.0f ? 0.0f : (v > 255.0f ? 255.0f : v);
      out[i] = static_cast<uint8_t>(static_cast<int32_t>(v));
    }
    scale[r] = s;
    zero[r] = z;
  }
}

void w8a8_epilogue(const int32_t* acc, int64_t m, int64_t n, const float* xscale, const int32_t* xzero,
                   const float* wscale, const int32_t* wsum, const float* bias, float* out) {
#pragma omp parallel for schedule(static) if (m >= 16)
  for (int64_t r = 0; r < m; ++r) {
    const int32_t* a = acc + r * n;
    float* o = out + r * n;
    const float s = xscale[r];
    const int32_t z = xzero[r];
    // `acc` may be `out` itself (oneDNN writes the int32 sums into the output buffer): element c is
    // read before it is written, and no other element is touched in between.
    if (bias != nullptr) {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] = static_cast<float>(a[c] - z * wsum[c]) * (s * wscale[c]) + bias[c];
    } else {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] = static_cast<float>(a[c] - z * wsum[c]) * (s * wscale[c]);
    }
  }
}

void w8a8_gemm_portable(const uint8_t* q, const float* xscale, const int32_t* xzero, int64_t m, int64_t k,
                        const int8_t* w_nk, const float* wscale, const int32_t* wsum, const float* bias, int64_t n,
                        float* out) {
  std::vector<int32_t> acc(m * n);
#pragma omp parallel for schedule(static) if (m * n >= 4096)
  for (int64_t c = 0; c < n; ++c) {
    const int8_t* wc = w_nk + c * k;
    for (int64_t r = 0; r < m; ++r) {
      const uint8_t* xr = q + r * k;
      int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < k; ++i) sum += static_cast<int32_t>(xr[i]) * static_cast<int32_t>(wc[i]);
      acc[r * n + c] = sum;
    }
  }
  w8a8_epilogue(acc.data(), m, n, xscale, xzero, wscale, wsum, bias, out);
}

}  // namespace fastdeploy_cpu

// The portable W8A8 path: x [..., K] float32, weight int8 [N, K], wscale [N] float32, wsum [N] int32
// (sum over K of each weight row), optional bias [N] -> [..., N] float32.
std::vector<paddle::Tensor> W8A8LinearPortable(const paddle::Tensor& x, const paddle::Tensor& weight,
                                               const paddle::Tensor& wscale, const paddle::Tensor& wsum,
                                               const paddle::optional<paddle::Tensor>& bias) {
  fastdeploy_cpu::check_cpu_contiguous(x, "x");
  fastdeploy_cpu::check_cpu_contiguous(weight, "weight");
  fastdeploy_cpu::check_dtype(x, paddle::DataType::FLOAT32, "x");
  fastdeploy_cpu::check_dtype(weight, paddle::DataType::INT8, "weight");
  const auto& shape = x.shape();
  PD_CHECK(!shape.empty(), "fd_w8a8_linear_portable: x must have at least one dimension.");
  PD_CHECK(weight.shape().size() == 2 && weight.shape()[1] == shape.back(),
           "fd_w8a8_linear_portable: weight must be [N, K].");
  const int64_t k = shape.back(), n = weight.shape()[0];
  const int64_t m = k ? x.numel() / k : 0;
  fastdeploy_cpu::check_w8a8_operands(wscale, wsum, bias, n, "fd_w8a8_linear_portable");
  std::vector<int64_t> out_shape(shape.begin(), shape.end());
  out_shape.back() = n;
  auto out = paddle::empty(out_shape, paddle::DataType::FLOAT32, x.place());
  if (m == 0) return {out};
  std::vector<uint8_t> q(m * k);
  std::vector<float> xs(m);
  std::vector<int32_t> xz(m);
  fastdeploy_cpu::quantize_rows_u8(x.data<float>(), m, k, q.data(), xs.data(), xz.data());
  fastdeploy_cpu::w8a8_gemm_portable(q.data(), xs.data(), xz.data(), m, k, weight.data<int8_t>(),
                                     wscale.data<float>(), wsum.data<int32_t>(),
                                     bias.is_initialized() ? bias->data<float>() : nullptr, n, out.data<float>());
  return {out};
}

PD_BUILD_OP(fd_w8a8_linear_portable)
    .Inputs({"x", "weight", "wscale", "wsum", paddle::Optional("bias")})
    .Outputs({"out"})
    .SetKernelFn(PD_KERNEL(W8A8LinearPortable));

namespace fastdeploy_cpu {

void check_w8a8_operands(const paddle::Tensor& wscale, const paddle::Tensor& wsum,
                         const paddle::optional<paddle::Tensor>& bias, int64_t n, const char* op) {
  const std::string name(op);
  check_cpu_contiguous(wscale, "wscale");
  check_cpu_contiguous(wsum, "wsum");
  check_dtype(wscale, paddle::DataType::FLOAT32, "wscale");
  check_dtype(wsum, paddle::DataType::INT32, "wsum");
  PD_CHECK(wscale.numel() == n, name + ": wscale must have N elements.");
  PD_CHECK(wsum.numel() == n, name + ": wsum must have N elements.");
  if (bias.is_initialized()) {
    check_cpu_contiguous(*bias, "bias");
    check_dtype(*bias, paddle::DataType::FLOAT32, "bias");
    PD_CHECK(bias->numel() == n, name + ": bias must have N elements.");
  }
}

}  // namespace fastdeploy_cpu
