// fp8 (e4m3, float8_e4m3fn) weights, widened in the kernel: W8A16 with bf16 or fp32 activations.
//
// The weights stay one byte each in memory (what a decode step reads) and are widened in
// registers, 16 output columns at a time, with a scale per column and group of K rows
// (per channel: one group; DeepSeek-V3's 128x128 blocks: groups of 128). e4m3 has a sign, 4
// exponent bits (bias 7) and 3 mantissa bits; codes 0x7F / 0xFF are NaN and there is no
// infinity; exponent 0 holds the subnormals m * 2^-9. Layout and arithmetic: pair_gemm_impl.h
// (a k pair of 16 columns is 32 codes: column c, half h at byte 2c + h).
//
// Five paths over that one template, each compiled for its own instructions (`#pragma GCC
// target`) whatever CPU builds the library; the platform picks one at start-up
// (fastdeploy/platforms/cpu.py, FD_CPU_FP8_KERNEL) and the op refuses a path the CPU cannot run:
//   "amx-bf16":    the codes decoded as on "avx512-bf16", multiplied on AMX tiles (pair_gemm_amx.h);
//                  block-wise scales need groups of a multiple of 32 rows (the layer picks
//                  "avx512-bf16" for others: int_kernels.path_for_dtype);
//   "avx512-bf16": codes -> bf16 by a 128-entry table lookup (vpermt2w), `vdpbf16ps` with the
//                  activations rounded to bf16 (the model computes in bf16);
//   "avx512":      the same decode, widened to fp32, fp32 FMAs on fp32 activations;
//   "avx2":        codes -> fp16 by shifts (e4m3 is fp16 with a narrower exponent), `vcvtph2ps`,
//                  fp32 FMAs; the values are 2^-8 of the weights, which the group sum undoes exactly;
//   "scalar":      portable C++ through a 256-entry fp32 table.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_utils.h"

namespace fastdeploy_cpu {

enum Fp8Isa : int { kFp8Scalar = 0, kFp8Avx2 = 1, kFp8Avx512 = 2, kFp8Avx512Bf16 = 3, kFp8AmxBf16 = 4 };

namespace {

// The value of an e4m3 code, from the bit definition.
float e4m3_value(int code) {
  const int e = (code >> 3) & 15, m = code & 7;
  if ((code & 0x7F) == 0x7F) return std::nanf("");
  const float mag = e != 0 ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
  return (code & 0x80) != 0 ? -mag : mag;
}

struct E4m3Tables {
  float f32[256];
  uint16_t bf16_mag[128];  // bf16 of codes 0..127 (exact: 3 mantissa bits fit bf16's 7)
  E4m3Tables() {
    for (int c = 0; c < 256; ++c) f32[c] = e4m3_value(c);
    for (int c = 0; c < 128; ++c) {
      uint32_t u;
      std::memcpy(&u, &f32[c], sizeof(u));
      bf16_mag[c] = c == 0x7F ? 0x7FC0 : static_cast<uint16_t>(u >> 16);
    }
  }
};

const E4m3Tables& tables() {
  static const E4m3Tables t;
  return t;
}

}  // namespace

// ------------------------------------------------------------------------------ scalar path

namespace fp8_scalar {

#include "lanes16_scalar_impl.h"

struct Ops : Lanes16 {
  struct W {
    float v[32];  // column c, half h at 2c + h
  };
  using Acc = W;
  using X = float;
  static constexpr int kRows = 4, kPanels = 1;
  static constexpr int64_t kPairBytes = 32;
  const float* table = tables().f32;

  W decode(const uint8_t* p) const {
    W w;
    for (int i = 0; i < 32; ++i) w.v[i] = table[p[i]];
    return w;
  }
  static Acc zero_acc() { return Acc{}; }
  static void madd(Acc& acc, const float* x, int64_t j, const W& w, int) {
    for (int i = 0; i < 32; ++i) acc.v[i] = std::fma(x[2 * j + (i & 1)], w.v[i], acc.v[i]);
  }
  static F sum(const Acc& acc) {
    F r;
    for (int c = 0; c < 16; ++c) r.v[c] = acc.v[2 * c] + acc.v[2 * c + 1];
    return r;
  }
};

#include "pair_gemm_impl.h"

}  // namespace fp8_scalar

// ------------------------------------------------------------------------ AVX2 + FMA path

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace fp8_avx2 {

#include "lanes16_avx2_impl.h"

struct Ops : Lanes16 {
  struct W {
    __m256 v[4];  // columns 4i .. 4i+3, each as (k0, k1), in units of 2^8
  };
  using Acc = W;
  using X = float;
  static constexpr int kRows = 2, kPanels = 1;
  static constexpr int64_t kPairBytes = 32;

  // 16 codes -> 16 fp16: the byte in the top half, shifted right by one keeping the sign, then the
  // sign's copy cleared; fp16's 5-bit exponent (bias 15) then reads e4m3's (bias 7) times 2^-8,
  // subnormals included (vcvtph2ps widens fp16 subnormals exactly). NaN codes become 0xFFFF.
  static __m256i fp16x16(__m128i codes) {
    __m256i h = _mm256_srai_epi16(_mm256_slli_epi16(_mm256_cvtepu8_epi16(codes), 8), 1);
    h = _mm256_and_si256(h, _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
    const __m256i mag = _mm256_and_si256(h, _mm256_set1_epi16(0x3F80));
    return _mm256_or_si256(h, _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x3F80)));
  }
  W decode(const uint8_t* p) const {
    const __m256i lo = fp16x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i hi = fp16x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    return {{_mm256_cvtph_ps(_mm256_castsi256_si128(lo)), _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1)),
             _mm256_cvtph_ps(_mm256_castsi256_si128(hi)), _mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1))}};
  }
  static Acc zero_acc() { return {{_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}}; }
  static void madd(Acc& acc, const float* x, int64_t j, const W& w, int) {
    // (x[2j], x[2j+1]) in every pair of lanes.
    const __m256 xp = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x + 2 * j)));
    for (int i = 0; i < 4; ++i) acc.v[i] = _mm256_fmadd_ps(xp, w.v[i], acc.v[i]);
  }
  // Lanes (2c, 2c+1) -> column c, times 2^8 (exact).
  static __m256 columns(__m256 a, __m256 b) {
    const __m256 h = _mm256_hadd_ps(a, b);  // c0 c1 c4 c5 | c2 c3 c6 c7
    return _mm256_mul_ps(_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xD8)), _mm256_set1_ps(256.0f));
  }
  static F sum(const Acc& acc) { return {columns(acc.v[0], acc.v[1]), columns(acc.v[2], acc.v[3])}; }
};

#include "pair_gemm_impl.h"

}  // namespace fp8_avx2
#pragma GCC pop_options

// ------------------------------------------------------------------------------ AVX-512 paths

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl")
namespace fp8_avx512_decode {

// 32 codes -> 32 bf16 (k0 in the low half of each 32-bit lane, k1 in the high one): the magnitude
// from the 128-entry table in four registers (vpermt2w picks among 64 words by the low 6 bits;
// bit 6 picks the pair of registers), the sign moved to bit 15.
struct Bf16Decoder {
  __m512i t0, t1, t2, t3;
  Bf16Decoder() {
    const uint16_t* t = tables().bf16_mag;
    t0 = _mm512_loadu_si512(t);
    t1 = _mm512_loadu_si512(t + 32);
    t2 = _mm512_loadu_si512(t + 64);
    t3 = _mm512_loadu_si512(t + 96);
  }
  __m512i bf16x32(const uint8_t* p) const {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i lo = _mm512_permutex2var_epi16(t0, w, t1);
    const __m512i hi = _mm512_permutex2var_epi16(t2, w, t3);
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), lo, hi);
    return _mm512_or_si512(mag, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
  }
};

#include "pair_gemm_avx512.h"

}  // namespace fp8_avx512_decode

namespace fp8_avx512 {

struct Ops : fp8_avx512_decode::Ops512 {
  struct W {
    __m512 k0, k1;
  };
  using X = float;
  static constexpr int64_t kPairBytes = 32;
  fp8_avx512_decode::Bf16Decoder decoder;

  W decode(const uint8_t* p) const {
    const __m512i v = decoder.bf16x32(p);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
  static void madd(Acc& acc, const float* x, int64_t j, const W& w, int chain) {
    acc.c[chain] = _mm512_fmadd_ps(_mm512_set1_ps(x[2 * j]), w.k0, acc.c[chain]);
    acc.c[chain] = _mm512_fmadd_ps(_mm512_set1_ps(x[2 * j + 1]), w.k1, acc.c[chain]);
  }
};

#include "pair_gemm_impl.h"

}  // namespace fp8_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
namespace fp8_avx512_bf16 {

using fp8_avx512_decode::Ops512;
#include "pair_gemm_bf16.h"

struct Ops : OpsBf16 {
  static constexpr int64_t kPairBytes = 32;
  fp8_avx512_decode::Bf16Decoder decoder;

  W decode(const uint8_t* p) const { return {decoder.bf16x32(p)}; }
};

#include "pair_gemm_impl.h"
#include "pair_gemm_amx.h"

}  // namespace fp8_avx512_bf16
#pragma GCC pop_options

// ------------------------------------------------------------------------------ entry points

namespace {

bool fp8_isa_supported(int isa) {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  switch (isa) {
    case kFp8Scalar: return true;
    case kFp8Avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kFp8Avx512: return avx512;
    case kFp8Avx512Bf16: return avx512 && __builtin_cpu_supports("avx512bf16");
    case kFp8AmxBf16: return avx512 && __builtin_cpu_supports("avx512bf16") && amx_bf16_usable();
    default: return false;
  }
}

}  // namespace

// out[m, n] = x[m, k] @ W (+ bias), W in pair_gemm_impl.h's layout with `group` (even) rows of K per scale.
void fp8_gemm(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t group, const float* scales,
              const float* bias, int64_t n, int isa, float* out) {
  if (m == 0 || n == 0) return;
  PD_CHECK(fp8_isa_supported(isa), "fd_fp8_linear: this CPU cannot run kernel path " + std::to_string(isa) + ".");
  const int64_t kh = (k + 1) / 2, group_pairs = group / 2, groups = (kh + group_pairs - 1) / group_pairs;
  if (isa == kFp8Avx512Bf16 || isa == kFp8AmxBf16) {
    namespace b = fp8_avx512_bf16;
    const bool amx = isa == kFp8AmxBf16;
    PD_CHECK(!amx || b::amx::fits(groups, group_pairs),
             "fd_fp8_linear: amx-bf16 needs one group or groups of a multiple of 32 rows (path_for_dtype picks "
             "avx512-bf16 for the others).");
    thread_local std::vector<uint32_t> xb;
    const int64_t ldx = b::amx::prepare_pairs(x, m, k, amx, xb);
    (amx ? b::amx::gemm : b::gemm)(xb.data(), m, ldx, kh, w, groups, group_pairs, scales, nullptr, nullptr, bias, n,
                                  out);
    return;
  }
  const float* xs = x;
  thread_local std::vector<float> padded;
  if (k % 2 != 0) {  // the kernels read x in pairs
    padded.assign(m * 2 * kh, 0.0f);
    for (int64_t r = 0; r < m; ++r) std::memcpy(&padded[r * 2 * kh], x + r * k, k * sizeof(float));
    xs = padded.data();
  }
  switch (isa) {
    case kFp8Avx512: fp8_avx512::gemm(xs, m, 2 * kh, kh, w, groups, group_pairs, scales, nullptr, nullptr, bias, n, out); break;
    case kFp8Avx2: fp8_avx2::gemm(xs, m, 2 * kh, kh, w, groups, group_pairs, scales, nullptr, nullptr, bias, n, out); break;
    default: fp8_scalar::gemm(xs, m, 2 * kh, kh, w, groups, group_pairs, scales, nullptr, nullptr, bias, n, out); break;
  }
}

namespace {

// The e4m3 codes' bytes at the front of an fp8 buffer: a k pair of 16 columns is 32 codes.
int64_t fp8_codes_bytes(int64_t k, int64_t n) { return (n + 15) / 16 * ((k + 1) / 2) * 32; }

}  // namespace

int64_t fp8_weight_bytes(int64_t k, int64_t n, int64_t group) {
  if (k <= 0 || n <= 0 || group <= 0 || group % 2 != 0) return -1;
  const int64_t panels = (n + 15) / 16, kh = (k + 1) / 2, groups = (kh + group / 2 - 1) / (group / 2);
  return fp8_codes_bytes(k, n) + panels * groups * 16 * static_cast<int64_t>(sizeof(float));
}

void fp8_forward(const float* x, int64_t m, int64_t k, const uint8_t* weight, int64_t group, const float* bias,
                 int64_t n, int isa, float* out) {
  fp8_gemm(x, m, k, weight, group, reinterpret_cast<const float*>(weight + fp8_codes_bytes(k, n)), bias, n, isa, out);
}

}  // namespace fastdeploy_cpu

// x [..., K] float32, weight uint8: the e4m3 codes [ceil(N/16) * ceil(K/2) * 32] then the fp32 scales
// [ceil(N/16) * G * 16] (pack_fp8's buffer), optional bias [N] -> [..., N] float32.
std::vector<paddle::Tensor> Fp8Linear(const paddle::Tensor& x, const paddle::Tensor& weight,
                                      const paddle::optional<paddle::Tensor>& bias, int64_t n, int64_t group, int isa) {
  fastdeploy_cpu::check_cpu_contiguous(weight, "weight");
  fastdeploy_cpu::check_dtype(weight, paddle::DataType::UINT8, "weight");
  const auto [m, k] = fastdeploy_cpu::check_linear_x(x, "fd_fp8_linear");
  PD_CHECK(group > 0 && group % 2 == 0, "fd_fp8_linear: group must be even and positive.");
  PD_CHECK(weight.numel() == fastdeploy_cpu::fp8_weight_bytes(k, n, group),
           "fd_fp8_linear: the weight does not match [K, N] = [" + std::to_string(k) + ", " + std::to_string(n) +
               "] in groups of " + std::to_string(group) + " rows.");
  const float* bias_data = fastdeploy_cpu::optional_bias(bias, n, "fd_fp8_linear");
  auto out = fastdeploy_cpu::linear_output(x, n);
  fastdeploy_cpu::fp8_forward(x.data<float>(), m, k, weight.data<uint8_t>(), group, bias_data, n, isa,
                              out.data<float>());
  return {out};
}

PD_BUILD_OP(fd_fp8_linear)
    .Inputs({"x", "weight", paddle::Optional("bias")})
    .Outputs({"out"})
    .Attrs({"n: int64_t", "group: int64_t", "isa: int"})
    .SetKernelFn(PD_KERNEL(Fp8Linear));
