// W8A8's arithmetic outside oneDNN: the per-token activation quantization every call starts
// with, the integer-sums-to-fp32 epilogue, and the portable matmul (FD_CPU_INT_KERNEL=scalar, or a
// build without oneDNN). The oneDNN matmul between them is in linear.cc (fd_w8a8_linear).
//
// K is cut into G = ceil(K / group) groups of `group` columns (the last one may be part-filled).
// Each token's group is quantized to asymmetric u8 on its own: with lo = min(min x, 0),
// hi = max(max x, 0) over the group,
//   s = (hi - lo) / 255,  z = round(-lo / s) in 0..255,  q = clamp(round(x / s) + z, 0, 255),
// so x ~ s (q - z). A few large outliers (the SwiGLU outputs down_proj reads) then coarsen only
// their own group, not the whole row; against one scale per row this halves SmolLM2-135M's
// perplexity loss. The int8 weights have a scale per (group, output column): w ~ ws[g, c] qw[k, c],
//   y[r, c] = sum_g s[r, g] ws[g, c] (sum_{k in g} q[r, k] qw[k, c] - z[r, g] wsum[g, c]),
// wsum[g, c] = sum_{k in g} qw[k, c] (computed at load). Each bracket is exact in int32
// (|.| <= 255 * 127 * group) and the groups are added in a fixed order, so a row's result does not
// depend on the other rows of the batch.
//
// Layouts: the quantized activations are [G, M, group] (the batched matmul's source; the columns
// past K of the last group hold its zero point, which the zero-padded weights ignore), their
// scales and zero points [M, G], the int32 sums [G, M, N].
//
// Plain C++ that GCC vectorizes with -O3 -march=native (the extension is built where it runs); the
// activation quantization also has AVX-512 loops with the same operations, so the same values.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_utils.h"
#include "kernels.h"

namespace fastdeploy_cpu {

int64_t w8a8_groups(int64_t k, int64_t group) { return group > 0 ? (k + group - 1) / group : 0; }

namespace {

// A group's range, widened to hold 0: (min(min x, 0), max(max x, 0)).
std::pair<float, float> group_range(const float* in, int64_t len) {
  float lo = 0.0f, hi = 0.0f;
  int64_t i = 0;
#if defined(__AVX512F__)
  // Four accumulators each: one min chain and one max chain (what GCC made of the loop below) wait
  // on their own latency every 16 values. Min and max are exact, so the order changes nothing.
  __m512 vlo[4], vhi[4];
  for (int a = 0; a < 4; ++a) vlo[a] = vhi[a] = _mm512_setzero_ps();
  for (; i + 64 <= len; i += 64) {
    for (int a = 0; a < 4; ++a) {
      const __m512 v = _mm512_loadu_ps(in + i + 16 * a);
      vlo[a] = _mm512_min_ps(vlo[a], v);
      vhi[a] = _mm512_max_ps(vhi[a], v);
    }
  }
  for (; i + 16 <= len; i += 16) {
    const __m512 v = _mm512_loadu_ps(in + i);
    vlo[0] = _mm512_min_ps(vlo[0], v);
    vhi[0] = _mm512_max_ps(vhi[0], v);
  }
  lo = _mm512_reduce_min_ps(_mm512_min_ps(_mm512_min_ps(vlo[0], vlo[1]), _mm512_min_ps(vlo[2], vlo[3])));
  hi = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(vhi[0], vhi[1]), _mm512_max_ps(vhi[2], vhi[3])));
#endif
  for (; i < len; ++i) {
    lo = in[i] < lo ? in[i] : lo;
    hi = in[i] > hi ? in[i] : hi;
  }
  return {lo, hi};
}

}  // namespace

void quantize_rows_u8(const float* x, int64_t m, int64_t k, int64_t group, uint8_t* q, float* scale,
                      int32_t* zero) {
  const int64_t groups = w8a8_groups(k, group);
#pragma omp parallel for schedule(static) if (m >= 16)
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t begin = g * group, len = std::min(group, k - begin);
      const float* in = x + r * k + begin;
      uint8_t* out = q + (g * m + r) * group;
      const auto [lo, hi] = group_range(in, len);
      const float s = (hi - lo) / 255.0f;
      const float inv = s != 0.0f ? 1.0f / s : 0.0f;
      const float zf = std::nearbyint(-lo * inv);
      // -lo * inv is in [0, 255] up to rounding; the clamp keeps z a valid u8 whatever the rounding did.
      const int32_t z = static_cast<int32_t>(zf < 0.0f ? 0.0f : (zf > 255.0f ? 255.0f : zf));
      const float zq = static_cast<float>(z);
      int64_t i = 0;
#if defined(__AVX512F__)
      // The loop below's operations on 16 lanes (GCC ran it 8 wide, packing bytes with permutes).
      const __m512 vinv = _mm512_set1_ps(inv), vz = _mm512_set1_ps(zq), v0 = _mm512_setzero_ps(),
                   v255 = _mm512_set1_ps(255.0f);
      for (; i + 16 <= len; i += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(in + i), vinv),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, vz), v0), v255);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v)));
      }
#endif
      // In fp32 before the conversion: round(x / s) + z is an integer below 2^24, so the sum is exact
      // and the clamp is the same as in integers; GCC vectorizes this form (not the int32 one).
#pragma omp simd
      for (int64_t j = i; j < len; ++j) {
        float v = std::nearbyint(in[j] * inv) + zq;
        v = v < 0.0f ? 0.0f : (v > 255.0f ? 255.0f : v);
        out[j] = static_cast<uint8_t>(static_cast<int32_t>(v));
      }
      std::fill(out + len, out + group, static_cast<uint8_t>(z));  // x = 0 there
      scale[r * groups + g] = s;
      zero[r * groups + g] = z;
    }
  }
}

void w8a8_epilogue(const int32_t* acc, int64_t m, int64_t n, int64_t groups, const float* xscale,
                   const int32_t* xzero, const float* wscale, const int32_t* wsum, const float* bias, float* out) {
  // Blocks of columns whose sums over the groups stay in registers: each group's int32 sums are read
  // once and the output written once, whatever G is.
  constexpr int64_t kBlock = 64;
#pragma omp parallel for schedule(static) if (m >= 16)
  for (int64_t r = 0; r < m; ++r) {
    const float* xs = xscale + r * groups;
    const int32_t* xz = xzero + r * groups;
    int64_t c0 = 0;
#if defined(__AVX512F__)
    // The loops below on whole registers, 64 columns (4 x 16 lanes) a block, the last block's
    // columns past n masked: the same integer and float operations (GCC ran them 8 lanes wide).
    for (; c0 < n; c0 += kBlock) {
      __mmask16 mask[4];
      for (int v = 0; v < 4; ++v) {
        const int64_t left = std::clamp<int64_t>(n - c0 - 16 * v, 0, 16);
        mask[v] = static_cast<__mmask16>((1u << left) - 1u);
      }
      __m512 sum[4];
      for (int v = 0; v < 4; ++v) sum[v] = _mm512_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const int32_t* a = acc + (g * m + r) * n + c0;
        const float* ws = wscale + g * n + c0;
        const int32_t* wz = wsum + g * n + c0;
        const __m512 s = _mm512_set1_ps(xs[g]);
        const __m512i z = _mm512_set1_epi32(xz[g]);
        for (int v = 0; v < 4; ++v) {
          const __m512i d = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(mask[v], a + 16 * v),
                                             _mm512_mullo_epi32(z, _mm512_maskz_loadu_epi32(mask[v], wz + 16 * v)));
          sum[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mask[v], ws + 16 * v)),
                                   sum[v]);
        }
      }
      float* o = out + r * n + c0;
      for (int v = 0; v < 4; ++v) {
        const __m512 y = bias != nullptr ? _mm512_add_ps(sum[v], _mm512_maskz_loadu_ps(mask[v], bias + c0 + 16 * v)) : sum[v];
        _mm512_mask_storeu_ps(o + 16 * v, mask[v], y);
      }
    }
#endif
    for (; c0 < n; c0 += kBlock) {
      const int64_t len = std::min(kBlock, n - c0);
      float sum[kBlock];
#pragma omp simd
      for (int64_t c = 0; c < kBlock; ++c) sum[c] = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const int32_t* a = acc + (g * m + r) * n + c0;
        const float* ws = wscale + g * n + c0;
        const int32_t* wz = wsum + g * n + c0;
        const float s = xs[g];
        const int32_t z = xz[g];
#pragma omp simd
        for (int64_t c = 0; c < len; ++c) sum[c] += static_cast<float>(a[c] - z * wz[c]) * (s * ws[c]);
      }
      // With one group `acc` may be `out` itself (oneDNN writes the int32 sums into the output
      // buffer): this block's sums were all read above, and no other block is touched.
      float* o = out + r * n + c0;
      if (bias != nullptr) {
#pragma omp simd
        for (int64_t c = 0; c < len; ++c) o[c] = sum[c] + bias[c0 + c];
      } else {
#pragma omp simd
        for (int64_t c = 0; c < len; ++c) o[c] = sum[c];
      }
    }
  }
}

void w8a8_gemm_portable(const uint8_t* q, const float* xscale, const int32_t* xzero, int64_t m, int64_t k,
                        int64_t group, const int8_t* w_nk, const float* wscale, const int32_t* wsum,
                        const float* bias, int64_t n, float* out) {
  const int64_t groups = w8a8_groups(k, group);
  std::vector<int32_t> acc(groups * m * n);
#pragma omp parallel for schedule(static) if (m * n >= 4096)
  for (int64_t c = 0; c < n; ++c) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t begin = g * group, len = std::min(group, k - begin);
      const int8_t* wc = w_nk + c * k + begin;
      for (int64_t r = 0; r < m; ++r) {
        const uint8_t* xr = q + (g * m + r) * group;
        int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < len; ++i) sum += static_cast<int32_t>(xr[i]) * static_cast<int32_t>(wc[i]);
        acc[(g * m + r) * n + c] = sum;
      }
    }
  }
  w8a8_epilogue(acc.data(), m, n, groups, xscale, xzero, wscale, wsum, bias, out);
}

}  // namespace fastdeploy_cpu

// The portable W8A8 path: x [..., K] float32, weight int8 [N, K], wscale [G, N] float32, wsum [G, N]
// int32 (each group's sums over its K rows), optional bias [N] -> [..., N] float32, with
// G = ceil(K / group).
std::vector<paddle::Tensor> W8A8LinearPortable(const paddle::Tensor& x, const paddle::Tensor& weight,
                                               const paddle::Tensor& wscale, const paddle::Tensor& wsum,
                                               const paddle::optional<paddle::Tensor>& bias, int64_t group) {
  fastdeploy_cpu::check_cpu_contiguous(weight, "weight");
  fastdeploy_cpu::check_dtype(weight, paddle::DataType::INT8, "weight");
  const auto [m, k] = fastdeploy_cpu::check_linear_x(x, "fd_w8a8_linear_portable");
  PD_CHECK(weight.shape().size() == 2 && weight.shape()[1] == k, "fd_w8a8_linear_portable: weight must be [N, K].");
  const int64_t n = weight.shape()[0];
  fastdeploy_cpu::check_w8a8_operands(wscale, wsum, bias, k, n, group, "fd_w8a8_linear_portable");
  auto out = fastdeploy_cpu::linear_output(x, n);
  if (m == 0) return {out};
  const int64_t groups = fastdeploy_cpu::w8a8_groups(k, group);
  std::vector<uint8_t> q(groups * m * group);
  std::vector<float> xs(m * groups);
  std::vector<int32_t> xz(m * groups);
  fastdeploy_cpu::quantize_rows_u8(x.data<float>(), m, k, group, q.data(), xs.data(), xz.data());
  fastdeploy_cpu::w8a8_gemm_portable(q.data(), xs.data(), xz.data(), m, k, group, weight.data<int8_t>(),
                                     wscale.data<float>(), wsum.data<int32_t>(),
                                     bias.is_initialized() ? bias->data<float>() : nullptr, n, out.data<float>());
  return {out};
}

PD_BUILD_OP(fd_w8a8_linear_portable)
    .Inputs({"x", "weight", "wscale", "wsum", paddle::Optional("bias")})
    .Outputs({"out"})
    .Attrs({"group: int64_t"})
    .SetKernelFn(PD_KERNEL(W8A8LinearPortable));

namespace fastdeploy_cpu {

void check_w8a8_operands(const paddle::Tensor& wscale, const paddle::Tensor& wsum,
                         const paddle::optional<paddle::Tensor>& bias, int64_t k, int64_t n, int64_t group,
                         const char* op) {
  const std::string name(op);
  PD_CHECK(group > 0 && group <= std::max<int64_t>(k, 1), name + ": group must be in 1..K.");
  const int64_t groups = w8a8_groups(k, group);
  check_cpu_contiguous(wscale, "wscale");
  check_cpu_contiguous(wsum, "wsum");
  check_dtype(wscale, paddle::DataType::FLOAT32, "wscale");
  check_dtype(wsum, paddle::DataType::INT32, "wsum");
  PD_CHECK(wscale.numel() == groups * n, name + ": wscale must have G * N elements (G = ceil(K / group)).");
  PD_CHECK(wsum.numel() == groups * n, name + ": wsum must have G * N elements (G = ceil(K / group)).");
  optional_bias(bias, n, name);
}

}  // namespace fastdeploy_cpu
