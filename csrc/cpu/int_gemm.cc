// Integer weights of a bf16/fp32 checkpoint quantized at load (wint8 / wint4) or stored
// quantized (AWQ / GPTQ), multiplied with fp32 or bf16 activations: W8A16 and W4A16.
//
// The weights stay integers in memory (a quarter or an eighth of fp32's bytes, which is what
// a decode step reads) and are widened in registers, 16 output columns at a time. Layouts and
// the fp32 arithmetic: int_gemm_impl.h.
//
// Five paths, each compiled for its own instructions (`#pragma GCC target`) whatever CPU builds
// the library; the platform picks one at start-up (fastdeploy/platforms/cpu.py,
// FD_CPU_INT_KERNEL) and the op refuses a path the CPU cannot run:
//   "amx-bf16":    the same bf16 pairs multiplied on AMX tiles (pair_gemm_amx.h), 16 rows x 16
//                  columns x 32 K per instruction; int4 groups must be a multiple of 32 rows (the
//                  layer picks "avx512-bf16" for others: int_kernels.path_for_dtype);
//   "avx512-bf16": pairs of K rows widened to bf16 (exact: the integers fit bf16's 8 bits),
//                  `vdpbf16ps` with the activations rounded to bf16 (the model computes in
//                  bf16), on pair_gemm_impl.h (fp8_gemm.cc's template): a prefill's panels are
//                  widened once into a buffer that every row tile reads, so it runs at the bf16
//                  dot products' rate, twice fp32 FMAs';
//   "avx512", "avx2", "scalar": int_gemm_impl.h's fp32 FMAs on fp32 activations, one 512-bit
//                  register, two 256-bit ones or portable C++ per 16 columns.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"

namespace fastdeploy_cpu {

namespace {

// One call's operands (see int_gemm_impl.h for the layouts).
struct IntGemmArgs {
  const float* x;     // [m, k]
  const float* xsum;  // [m, groups]: sum of x over each group (int4)
  int64_t m, k, n, groups, group;
  int64_t kp;  // int8 panel rows: K rounded up to even (the bf16 path reads rows in pairs)
  int bits;
  const uint8_t* w;
  const float* scales;
  const float* mins;
  const float* bias;
  float* out;  // [m, n]
};

}  // namespace

// ------------------------------------------------------------------------------ scalar path

namespace int_scalar {

#include "lanes16_scalar_impl.h"

struct Ops : Lanes16 {
  static constexpr int kChains = 1;  // the compiler vectorises each 16-lane loop on its own
  static F i8(const int8_t* p) {
    F r;
    for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  static void u4(const uint8_t* block, int i, F& lo, F& hi) {
    for (int c = 0; c < 16; ++c) {
      const uint8_t* w = block + 4 * c;  // words 2c, 2c + 1, little-endian
      const unsigned even = w[0] | w[1] << 8, odd = w[2] | w[3] << 8;
      lo.v[c] = static_cast<float>((even >> (4 * i)) & 15);
      hi.v[c] = static_cast<float>((odd >> (4 * i)) & 15);
    }
  }
  static F mul(F a, const F& b) {
    for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i];
    return a;
  }
};

#include "int_gemm_impl.h"

}  // namespace int_scalar

// ------------------------------------------------------------------------ AVX2 + FMA path

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace int_avx2 {

#include "lanes16_avx2_impl.h"

struct Ops : Lanes16 {
  static constexpr int kChains = 4;  // 1 row x 4 panels, 2 x 2 (a few spills of the 16 registers, still faster)
  static __m256 cvt8(__m128i bytes8, bool is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
  }
  static F i8(const int8_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {cvt8(raw, true), cvt8(_mm_srli_si128(raw, 8), true)};
  }
  // Column c's 32-bit lane holds its even row's word and its odd row's: nibble i of each.
  __attribute__((always_inline)) static void u4(const uint8_t* block, int i, F& lo, F& hi) {
    const __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
    const __m256i d1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32));
    const __m256i m = _mm256_set1_epi32(15);
    const auto nib = [&](__m256i d, int sh) { return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(d, sh), m)); };
    lo = {nib(d0, 4 * i), nib(d1, 4 * i)};
    hi = {nib(d0, 16 + 4 * i), nib(d1, 16 + 4 * i)};
  }
  static F mul(const F& x, const F& y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
};

#include "int_gemm_impl.h"

}  // namespace int_avx2
#pragma GCC pop_options

// ------------------------------------------------------------------------------ AVX-512 path

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl")
namespace int_avx512 {

struct Ops {
  static constexpr int kChains = 8;  // 1-2 rows x 4 panels, 3-4 rows x 2: accumulators, parts, weights fit 32
  using F = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F splat(float s) { return _mm512_set1_ps(s); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(F v, float* p) { _mm512_storeu_ps(p, v); }
  static F i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // vpermps reads the low 4 bits of each lane: the nibble shifted down is its own index into a
  // table of 0..15 as floats (no mask, no conversion).
  __attribute__((always_inline)) static void u4(const uint8_t* block, int i, F& lo, F& hi) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i d = _mm512_loadu_si512(block);
    lo = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4 * i), table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 16 + 4 * i), table);
  }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
};

#include "int_gemm_impl.h"

}  // namespace int_avx512
#pragma GCC pop_options

// -------------------------------------------------------------------- AVX512-BF16 path

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
namespace int_avx512_bf16 {

#include "pair_gemm_avx512.h"
#include "pair_gemm_bf16.h"

// Pair j of an int8 panel is its rows 2j and 2j+1, 16 bytes each. A small integer's bf16 is the
// top half of its fp32 (exact), so the pair's lanes are k0's top half shifted down and k1's.
struct Int8Ops : OpsBf16 {
  static constexpr int64_t kPairBytes = 2 * kIntPanel;
  static __m512i fp32_bits(const uint8_t* p) {
    return _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
  }
  W decode(const uint8_t* p) const {
    return {_mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(fp32_bits(p), 16), fp32_bits(p + kIntPanel))};
  }
};

// Pair i of an int4 block (kInt4BlockPairs pairs in 64 bytes) is nibble i of its 32 words, which
// are already the register layout: word 2c + h is column c's row 2i + h. Shifted right by 4i, the
// low 5 bits of each word are that nibble and one bit above it, which vpermw maps through a table of
// the bf16 of 0..15, twice: a pair costs one shift and one lookup (widening the bytes of a 16-byte
// pair to 32-bit lanes first cost ~12% of a one-row GEMM's rate).
struct Int4Ops : OpsBf16 {
  static constexpr int64_t kPairBytes = kIntPanel;  // per pair, in blocks of kPairsPerBlock pairs
  static constexpr int64_t kPairsPerBlock = kInt4BlockPairs;
  static constexpr uint16_t kBf16[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                         0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
                                         0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                         0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  // Loaded in a constructor written here, in this target region: a default member initializer's
  // implicit constructor is compiled for the library's -march and fails to build on AVX2-only CPUs.
  Int4Ops() : table(_mm512_loadu_si512(kBf16)) {}
  __m512i table;
  __attribute__((always_inline)) W decode(const uint8_t* block, int i) const {
    return {_mm512_permutexvar_epi16(_mm512_srli_epi16(_mm512_loadu_si512(block), 4 * i), table)};
  }
};

namespace int8 {
using Ops = Int8Ops;
#include "pair_gemm_impl.h"
#include "pair_gemm_amx.h"
}  // namespace int8

namespace int4 {
using Ops = Int4Ops;
#include "pair_gemm_impl.h"
#include "pair_gemm_amx.h"
}  // namespace int4

}  // namespace int_avx512_bf16
#pragma GCC pop_options

// ------------------------------------------------------------------------------ entry points

namespace {

bool int_isa_supported(int isa) {
  __builtin_cpu_init();
  switch (isa) {
    case kIntScalar: return true;
    case kIntAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kIntAvx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    case kIntAvx512Bf16:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
    case kIntAmxBf16: return int_isa_supported(kIntAvx512Bf16) && amx_bf16_usable();
    default: return false;
  }
}

}  // namespace

int64_t int_packed_bytes(int bits, int64_t k, int64_t n) {
  const int64_t panels = (n + kIntPanel - 1) / kIntPanel;
  return bits == 8 ? panels * (k + (k & 1)) * kIntPanel : panels * int4_panel_bytes(k);
}

namespace {

int64_t int_scale_count(int bits, int64_t k, int64_t n, int64_t group) {
  const int64_t panels = (n + kIntPanel - 1) / kIntPanel;
  return panels * (bits == 4 ? (k + group - 1) / group : 1) * kIntPanel;
}

}  // namespace

int64_t int_linear_bytes(int bits, int64_t k, int64_t n, int64_t group) {
  if (bits != 8 && !(bits == 4 && k % 2 == 0 && group > 0 && group % 2 == 0)) return 0;
  const int64_t floats = int_scale_count(bits, k, n, group) * (bits == 4 ? 2 : 1);
  return int_packed_bytes(bits, k, n) + floats * static_cast<int64_t>(sizeof(float));
}

IntLinearParts int_linear_parts(const uint8_t* buffer, int bits, int64_t k, int64_t n, int64_t group) {
  // The panels' size is a multiple of 16 bytes, so the scales start 16-byte aligned.
  const float* scales = reinterpret_cast<const float*>(buffer + int_packed_bytes(bits, k, n));
  return {buffer, scales, bits == 4 ? scales + int_scale_count(bits, k, n, group) : nullptr};
}

void int_gemm(const float* x, int64_t m, int64_t k, const uint8_t* w, int bits, int64_t group, const float* scales,
              const float* mins, const float* bias, int64_t n, int isa, float* out) {
  if (m == 0 || n == 0) return;
  PD_CHECK(int_isa_supported(isa), "fd_int_linear: this CPU cannot run kernel path " + std::to_string(isa) + ".");
  const int64_t groups = bits == 4 ? (k + group - 1) / group : 1;
  thread_local std::vector<float> xsum_buf;
  xsum_buf.assign(bits == 4 ? m * groups : 0, 0.0f);
  // The bf16 paths multiply the activations rounded to bf16, in pairs (rounded once here).
  const int64_t kh = (k + 1) / 2, group_pairs = bits == 4 ? group / 2 : kh;
  const bool amx = isa == kIntAmxBf16, bf16 = isa == kIntAvx512Bf16 || amx;
  PD_CHECK(!amx || int_avx512_bf16::int8::amx::fits(groups, group_pairs),
           "fd_int_linear: amx-bf16 needs one group or groups of a multiple of 32 rows (path_for_dtype picks "
           "avx512-bf16 for the others).");
  thread_local std::vector<uint32_t> xb;
  const int64_t ldx = bf16 ? int_avx512_bf16::int8::amx::prepare_pairs(x, m, k, amx, xb) : kh;
  // Sum of each group's activations (the min term of int4 weights), of the values the path
  // multiplies.
  for (int64_t r = 0; r < m && bits == 4; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + r * k + g * group;
      const int64_t len = std::min(k, (g + 1) * group) - g * group;
      float s = 0.0f;
      if (bf16) {
        s = bf16_rounded_sum(xg, len);
      } else {
        for (int64_t i = 0; i < len; ++i) s += xg[i];
      }
      xsum_buf[r * groups + g] = s;
    }
  }
  if (bf16) {
    namespace b = int_avx512_bf16;
    const auto run = bits == 8 ? (amx ? b::int8::amx::gemm : b::int8::gemm) : (amx ? b::int4::amx::gemm : b::int4::gemm);
    run(xb.data(), m, ldx, kh, w, groups, group_pairs, scales, bits == 4 ? mins : nullptr,
        bits == 4 ? xsum_buf.data() : nullptr, bias, n, out);
    return;
  }
  const IntGemmArgs args{x, xsum_buf.data(), m, k, n, groups, group, k + (k & 1), bits, w, scales, mins, bias, out};
  // Each thread takes a contiguous range of panels: the weights are read once in all, and which
  // thread computes a column changes nothing in it.
  const int64_t panels = (n + kIntPanel - 1) / kIntPanel;
  const int threads = team_size(panels / 4);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t pb = panels * t / nt, pe = panels * (t + 1) / nt;
    if (pb < pe) {
      switch (isa) {
        case kIntAvx512: int_avx512::panels(args, pb, pe); break;
        case kIntAvx2: int_avx2::panels(args, pb, pe); break;
        default: int_scalar::panels(args, pb, pe); break;
      }
    }
  }
}

}  // namespace fastdeploy_cpu

// x [..., K] float32, packed uint8 (int_linear_parts' buffer: int_gemm_impl.h's panels, scales and,
// int4, mins), optional bias [N] -> [..., N] float32.
std::vector<paddle::Tensor> IntLinear(const paddle::Tensor& x, const paddle::Tensor& packed,
                                      const paddle::optional<paddle::Tensor>& bias, int64_t n, int bits,
                                      int64_t group, int isa) {
  fastdeploy_cpu::check_cpu_contiguous(packed, "packed");
  fastdeploy_cpu::check_dtype(packed, paddle::DataType::UINT8, "packed");
  const auto [m, k] = fastdeploy_cpu::check_linear_x(x, "fd_int_linear");
  PD_CHECK(bits == 8 || bits == 4, "fd_int_linear: bits must be 8 or 4.");
  PD_CHECK(bits == 8 || (k % 2 == 0 && group > 0 && group % 2 == 0), "fd_int_linear: int4 needs an even K and group.");
  PD_CHECK(packed.numel() == fastdeploy_cpu::int_linear_bytes(bits, k, n, group),
           "fd_int_linear: packed does not match [K, N] = [" + std::to_string(k) + ", " + std::to_string(n) + "].");
  const auto parts = fastdeploy_cpu::int_linear_parts(packed.data<uint8_t>(), bits, k, n, group);
  auto out = fastdeploy_cpu::linear_output(x, n);
  fastdeploy_cpu::int_gemm(x.data<float>(), m, k, parts.w, bits, group, parts.scales, parts.mins,
                           fastdeploy_cpu::optional_bias(bias, n, "fd_int_linear"), n, isa, out.data<float>());
  return {out};
}

PD_BUILD_OP(fd_int_linear)
    .Inputs({"x", "packed", paddle::Optional("bias")})
    .Outputs({"out"})
    .Attrs({"n: int64_t", "bits: int", "group: int64_t", "isa: int"})
    .SetKernelFn(PD_KERNEL(IntLinear));
