// GGUF weights multiplied straight from their blocks (llama.cpp's block formats), and the
// embedding rows looked up from them.
//
// A GGUF matrix [N, K] is N rows of K / block_elems blocks of one ggml type, each row the weights
// of one output column. The activations are quantized per 32 elements to int8 with an fp32
// scale dx = max|x| / 127 (rounded to nearest), keeping dx * (sum of the int8 values) of each
// half-block. A weight sub-block of 32 elements is w = dw * (u - offset) + mw with small
// unsigned integers u, so its dot product with an activation block is
//
//     dx * dw * sum(u * q)  +  (mw - offset * dw) * dx * sum(q)
//
// the first term an integer dot product (VNNI `vpdpbusd`, or AVX2 `vpmaddubsw` + `vpmaddwd`)
// scaled in fp32, the second from the kept sums. Signed Q8_0 weights take `vpdpbusd` as
// w + 128 (offset 128); on AVX2 they multiply through the sign trick instead (|w| times x
// with w's sign), because `vpmaddubsw` would saturate on w + 128.
//
// Three paths over one kernel template (gguf_gemm_impl.h): "avx512-vnni", "avx2" and
// "scalar". Each is compiled for its own instructions (`#pragma GCC target`) whatever CPU
// builds the library; the platform picks one at start-up (fastdeploy/platforms/cpu.py) and
// the op refuses a path the CPU cannot run.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"

namespace fastdeploy_cpu {

namespace {

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The 6-bit scale and min of sub-block j of a Q4_K / Q5_K block, packed in 12 bytes: bytes
// 0-3 hold the scales of 0-3 (and the top bits of 4-7), 4-7 the mins, 8-11 the low bits of 4-7.
struct KScaleMin {
  float scale, min;
};
inline KScaleMin k_scale_min(const uint8_t* s, int j) {
  if (j < 4) return {static_cast<float>(s[j] & 63), static_cast<float>(s[j + 4] & 63)};
  return {static_cast<float>((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4)),
          static_cast<float>((s[j + 4] >> 4) | ((s[j] >> 6) << 4))};
}

// The block types: ggml type id, elements and bytes per block, 32-element sub-blocks per block,
// the offset subtracted from element values, whether the format has a min, whether its
// elements are signed bytes, and whether a sub-block has two scales (one per 16 elements).
struct BlockQ8_0 {
  static constexpr int kType = 8, kElems = 32, kBytes = 34, kSubs = 1, kOffset = 0;
  static constexpr bool kHasMin = false, kSigned = true, kSplitScale = false;
};
struct BlockQ4_0 {
  static constexpr int kType = 2, kElems = 32, kBytes = 18, kSubs = 1, kOffset = 8;
  static constexpr bool kHasMin = false, kSigned = false, kSplitScale = false;
};
struct BlockQ4_1 {
  static constexpr int kType = 3, kElems = 32, kBytes = 20, kSubs = 1, kOffset = 0;
  static constexpr bool kHasMin = true, kSigned = false, kSplitScale = false;
};
struct BlockQ5_0 {
  static constexpr int kType = 6, kElems = 32, kBytes = 22, kSubs = 1, kOffset = 16;
  static constexpr bool kHasMin = false, kSigned = false, kSplitScale = false;
};
struct BlockQ5_1 {
  static constexpr int kType = 7, kElems = 32, kBytes = 24, kSubs = 1, kOffset = 0;
  static constexpr bool kHasMin = true, kSigned = false, kSplitScale = false;
};
struct BlockQ4_K {
  static constexpr int kType = 12, kElems = 256, kBytes = 144, kSubs = 8, kOffset = 0;
  static constexpr bool kHasMin = true, kSigned = false, kSplitScale = false;
};
struct BlockQ5_K {
  static constexpr int kType = 13, kElems = 256, kBytes = 176, kSubs = 8, kOffset = 0;
  static constexpr bool kHasMin = true, kSigned = false, kSplitScale = false;
};
struct BlockQ6_K {
  static constexpr int kType = 14, kElems = 256, kBytes = 210, kSubs = 8, kOffset = 32;
  static constexpr bool kHasMin = false, kSigned = false, kSplitScale = true;
};

// (elements, bytes) per block of a ggml type, {0, 0} for a type without a kernel.
struct BlockShape {
  int elems, bytes;
};
template <class... B>
constexpr BlockShape shape_of(int type) {
  BlockShape found{0, 0};
  ((type == B::kType ? (found = {B::kElems, B::kBytes}, 0) : 0), ...);
  return found;
}
constexpr BlockShape block_shape(int type) {
  return shape_of<BlockQ8_0, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ4_K, BlockQ5_K, BlockQ6_K>(type);
}

// The activations as the kernel sees them: per row, k int8 values, k / 32 scales and
// k / 16 half-block sums (dx * sum of the half's int8 values; rows of half_stride, a multiple
// of 8 padded with zeros).
struct QuantizedActs {
  const int8_t* q;
  const float* d;
  const float* half_sums;
  int64_t half_stride;
};

inline int64_t half_stride(int64_t k) { return (k / 16 + 7) / 8 * 8; }

// One row: dx = max|x| / 127, q = nearbyint(x / dx) (the same float operations as the tests'
// reference), exact in any vectorization.
void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* half_sums) {
  for (int64_t s = 0; s < k / 32; ++s) {
    const float* xb = x + s * 32;
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float dx = amax / 127.0f;
    const float inv = dx != 0.0f ? 1.0f / dx : 0.0f;
    int sums[2] = {0, 0};
    for (int i = 0; i < 32; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
      q[s * 32 + i] = static_cast<int8_t>(v);
      sums[i / 16] += v;
    }
    d[s] = dx;
    half_sums[2 * s] = dx * static_cast<float>(sums[0]);
    half_sums[2 * s + 1] = dx * static_cast<float>(sums[1]);
  }
}

// Portable fp16 -> fp32 (the scalar path; the SIMD paths use F16C).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal, exact
    return sign ? -v : v;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace

// ------------------------------------------------------------------------------ scalar path

namespace gguf_scalar {

struct Ops {
  struct V {
    uint8_t b[32];
  };
  struct I {
    int32_t l[8];
  };
  struct F {
    float f[8];
  };
  static constexpr int kSignedBias = 0;
  static V nibbles16(const uint8_t* p) {
    V v;
    for (int i = 0; i < 16; ++i) {
      v.b[i] = p[i] & 15;
      v.b[i + 16] = p[i] >> 4;
    }
    return v;
  }
  static V nibbles32(const uint8_t* p, int shift) {
    V v;
    for (int i = 0; i < 32; ++i) v.b[i] = (p[i] >> shift) & 15;
    return v;
  }
  static V or_bits(V v, uint32_t bits) {
    for (int i = 0; i < 32; ++i) v.b[i] |= ((bits >> i) & 1u) << 4;
    return v;
  }
  static V or_high(V v, const uint8_t* p, int shift, int mask) {
    for (int i = 0; i < 32; ++i) v.b[i] |= ((p[i] >> shift) & mask) << 4;
    return v;
  }
  static V load(const uint8_t* p) {
    V v;
    std::memcpy(v.b, p, 32);
    return v;
  }
  static void store(const V& v, uint8_t* p) { std::memcpy(p, v.b, 32); }
  struct T {
    V u[8];
  };
  static constexpr int kRows = 4;
  template <bool kSigned>
  static T transpose(const V* u) {
    T t;
    for (int c = 0; c < 8; ++c) t.u[c] = u[c];
    return t;
  }
  template <bool kSigned>
  static void dot(const T& t, const int8_t* x, I& lo, I& hi) {
    for (int c = 0; c < 8; ++c) {
      int32_t sums[2] = {0, 0};
      for (int i = 0; i < 32; ++i) {
        const int32_t w = kSigned ? static_cast<int8_t>(t.u[c].b[i]) : t.u[c].b[i];
        sums[i / 16] += w * x[i];
      }
      lo.l[c] = sums[0];
      hi.l[c] = sums[1];
    }
  }
  static F zero() { return F{}; }
  static F splat(float s) {
    F v;
    for (float& f : v.f) f = s;
    return v;
  }
  static F loadf(const float* p) {
    F v;
    std::memcpy(v.f, p, sizeof(v.f));
    return v;
  }
  static void storef(const F& v, float* p) { std::memcpy(p, v.f, sizeof(v.f)); }
  static F add(F a, const F& b) {
    for (int i = 0; i < 8; ++i) a.f[i] += b.f[i];
    return a;
  }
  static F mul(F a, const F& b) {
    for (int i = 0; i < 8; ++i) a.f[i] *= b.f[i];
    return a;
  }
  static I add_i(I a, const I& b) {
    for (int i = 0; i < 8; ++i) a.l[i] += b.l[i];
    return a;
  }
  static F fma(const I& l, const F& s, F acc) {
    for (int i = 0; i < 8; ++i) acc.f[i] = std::fma(static_cast<float>(l.l[i]), s.f[i], acc.f[i]);
    return acc;
  }
  static F fmaf(const F& a, const F& b, F acc) {
    for (int i = 0; i < 8; ++i) acc.f[i] = std::fma(a.f[i], b.f[i], acc.f[i]);
    return acc;
  }
  static float half(uint16_t h) { return half_to_float(h); }
};

#include "gguf_gemm_impl.h"

}  // namespace gguf_scalar

// ------------------------------------------------------------------------ AVX2 + FMA path

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace gguf_avx2 {

// Byte and float helpers shared by the AVX2 and the VNNI paths (plain AVX2 instructions).
struct Avx2Common {
  using V = __m256i;
  using I = __m256i;
  using F = __m256;
  static V nibbles16(const uint8_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
  }
  static V nibbles32(const uint8_t* p, int shift) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_and_si256(_mm256_srli_epi16(raw, shift), _mm256_set1_epi8(15));
  }
  // Bit i of `bits` -> byte i: each byte picks its bit's byte of `bits`, tests its bit.
  static V or_bits(V v, uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int32_t>(bits)),
        _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(16)));
  }
  static V or_high(V v, const uint8_t* p, int shift, int mask) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i bits = _mm256_and_si256(_mm256_srli_epi16(raw, shift), _mm256_set1_epi8(static_cast<char>(mask)));
    return _mm256_or_si256(v, _mm256_slli_epi16(bits, 4));  // bits <= 3: no carry into the next byte
  }
  static V load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(V v, uint8_t* p) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  // The 8 columns' sub-blocks as 8 registers of 4-byte groups: register g holds bytes 4g..4g+3
  // of every column (column c in lane c), an 8 x 8 transpose of 32-bit elements.
  struct T {
    __m256i g[8];
  };
  static T transpose_bytes(const V* u) {
    __m256i t[8], q[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_epi32(u[2 * i], u[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_epi32(u[2 * i], u[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      q[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      q[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      q[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      q[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    T r;
    for (int g = 0; g < 4; ++g) {
      r.g[g] = _mm256_permute2x128_si256(q[g], q[g + 4], 0x20);
      r.g[g + 4] = _mm256_permute2x128_si256(q[g], q[g + 4], 0x31);
    }
    return r;
  }
  static __m256i group(const int8_t* x, int g) {
    int32_t v;
    std::memcpy(&v, x + 4 * g, sizeof(v));
    return _mm256_set1_epi32(v);
  }
  static F zero() { return _mm256_setzero_ps(); }
  static F splat(float s) { return _mm256_set1_ps(s); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(F v, float* p) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  static F fma(I l, F s, F acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), s, acc); }
  static F fmaf(F a, F b, F acc) { return _mm256_fmadd_ps(a, b, acc); }
  static float half(uint16_t h) { return _cvtsh_ss(h); }
};

struct Ops : Avx2Common {
  static constexpr int kSignedBias = 0;
  static constexpr int kRows = 2;  // 16 registers: the 8 transposed groups and 2 x 2 accumulators
  template <bool kSigned>
  static T transpose(const V* u) {
    return transpose_bytes(u);
  }
  // Unsigned u < 64: a pair of u * x never reaches int16's limit in vpmaddubsw. Signed weights
  // multiply as |w| * (x with w's sign), at most 128 * 127 per product.
  template <bool kSigned>
  static void dot(const T& t, const int8_t* x, I& lo, I& hi) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int g = 0; g < 8; ++g) {
      const __m256i xg = group(x, g);
      const __m256i pairs = kSigned ? _mm256_maddubs_epi16(_mm256_sign_epi8(t.g[g], t.g[g]), _mm256_sign_epi8(xg, t.g[g]))
                                    : _mm256_maddubs_epi16(t.g[g], xg);
      sums[g / 4] = _mm256_add_epi32(sums[g / 4], _mm256_madd_epi16(pairs, ones));
    }
    lo = sums[0];
    hi = sums[1];
  }
};

#include "gguf_gemm_impl.h"

}  // namespace gguf_avx2
#pragma GCC pop_options

// ----------------------------------------------------------------- AVX512-VNNI path (256-bit)

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace gguf_vnni {

struct Ops : gguf_avx2::Avx2Common {
  static constexpr int kSignedBias = 128;
  static constexpr int kRows = 8;  // 32 registers: the 8 transposed groups and 8 x 2 accumulators
  // Signed weights as w + 128 (unsigned); the 128 * sum(x) is taken off with the offset term.
  template <bool kSigned>
  static T transpose(const V* u) {
    if (!kSigned) return transpose_bytes(u);
    V biased[8];
    for (int c = 0; c < 8; ++c) biased[c] = _mm256_xor_si256(u[c], _mm256_set1_epi8(-128));
    return transpose_bytes(biased);
  }
  template <bool kSigned>
  static void dot(const T& t, const int8_t* x, I& lo, I& hi) {
    lo = hi = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) lo = _mm256_dpbusd_epi32(lo, t.g[g], group(x, g));
    for (int g = 4; g < 8; ++g) hi = _mm256_dpbusd_epi32(hi, t.g[g], group(x, g));
  }
};

#include "gguf_gemm_impl.h"

}  // namespace gguf_vnni
#pragma GCC pop_options

// ------------------------------------------------------------------------------ entry points

namespace {

bool isa_supported(int isa) {
  __builtin_cpu_init();
  switch (isa) {
    case kGgufScalar: return true;
    case kGgufAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kGgufAvx512Vnni:
      return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw");
    default: return false;
  }
}

}  // namespace

int64_t gguf_row_bytes(int type, int64_t k) {
  const BlockShape shape = block_shape(type);
  if (shape.elems == 0 || k <= 0 || k % shape.elems != 0) return -1;
  return k / shape.elems * shape.bytes;
}

void gguf_gemm(const float* x, int64_t m, int64_t k, const uint8_t* w, const int64_t* segments, int64_t num_segments,
               const float* bias, int64_t n, int isa, float* out) {
  if (m == 0 || n == 0) return;
  PD_CHECK(isa_supported(isa), "fd_gguf_linear: this CPU cannot run kernel path " + std::to_string(isa) + ".");
  const int64_t subs = k / 32, stride = half_stride(k);
  thread_local std::vector<int8_t> q_buf;
  thread_local std::vector<float> d_buf, sums_buf;
  q_buf.resize(m * k);
  d_buf.resize(m * subs);
  sums_buf.assign(m * stride, 0.0f);
  int8_t* q = q_buf.data();
  float* d = d_buf.data();
  float* sums = sums_buf.data();
#pragma omp parallel for schedule(static) if (m >= 16)
  for (int64_t r = 0; r < m; ++r) quantize_row(x + r * k, k, q + r * k, d + r * subs, sums + r * stride);
  const QuantizedActs acts{q, d, sums, stride};

  // Each thread takes a contiguous range of every segment's columns (in groups of 8, a tile):
  // the weights are read once in all, and which thread computes a column changes nothing in it.
  constexpr int64_t kGroup = 8;
  const int threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), std::max<int64_t>(1, n / 64)));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t col = 0;
    const uint8_t* seg_w = w;
    for (int64_t s = 0; s < num_segments; ++s) {
      const int type = static_cast<int>(segments[2 * s]);
      const int64_t rows = segments[2 * s + 1];
      const int64_t groups = (rows + kGroup - 1) / kGroup;
      const int64_t cb = std::min(rows, groups * t / nt * kGroup), ce = std::min(rows, groups * (t + 1) / nt * kGroup);
      const float* seg_bias = bias != nullptr ? bias + col : nullptr;
      float* seg_out = out + col;
      if (cb < ce) {
        switch (isa) {
          case kGgufAvx512Vnni:
            gguf_vnni::segment_columns(type, acts, m, k, seg_w, cb, ce, seg_bias, seg_out, n);
            break;
          case kGgufAvx2: gguf_avx2::segment_columns(type, acts, m, k, seg_w, cb, ce, seg_bias, seg_out, n); break;
          default: gguf_scalar::segment_columns(type, acts, m, k, seg_w, cb, ce, seg_bias, seg_out, n); break;
        }
      }
      col += rows;
      seg_w += rows * gguf_row_bytes(type, k);
    }
  }
}

void gguf_dequantize_rows(const uint8_t* w, int type, int64_t k, const int64_t* ids, int64_t count, float* out) {
  const int64_t row_bytes = gguf_row_bytes(type, k);
#pragma omp parallel for schedule(static) if (count >= 64)
  for (int64_t i = 0; i < count; ++i) {
    const uint8_t* row = w + ids[i] * row_bytes;
    float* dst = out + i * k;
    switch (type) {
      case BlockQ8_0::kType: gguf_scalar::dequantize_row<BlockQ8_0>(row, k, dst); break;
      case BlockQ4_0::kType: gguf_scalar::dequantize_row<BlockQ4_0>(row, k, dst); break;
      case BlockQ4_1::kType: gguf_scalar::dequantize_row<BlockQ4_1>(row, k, dst); break;
      case BlockQ5_0::kType: gguf_scalar::dequantize_row<BlockQ5_0>(row, k, dst); break;
      case BlockQ5_1::kType: gguf_scalar::dequantize_row<BlockQ5_1>(row, k, dst); break;
      case BlockQ4_K::kType: gguf_scalar::dequantize_row<BlockQ4_K>(row, k, dst); break;
      case BlockQ5_K::kType: gguf_scalar::dequantize_row<BlockQ5_K>(row, k, dst); break;
      default: gguf_scalar::dequantize_row<BlockQ6_K>(row, k, dst); break;
    }
  }
}

}  // namespace fastdeploy_cpu

namespace {

// The weight's rows per segment and its byte size, checked against K; returns the total rows.
int64_t check_segments(const std::vector<int64_t>& segments, int64_t k, int64_t bytes, const char* op) {
  PD_CHECK(!segments.empty() && segments.size() % 2 == 0, std::string(op) + ": segments are (type, rows) pairs.");
  int64_t rows = 0, expected = 0;
  for (size_t s = 0; s < segments.size(); s += 2) {
    const int64_t row_bytes = fastdeploy_cpu::gguf_row_bytes(static_cast<int>(segments[s]), k);
    PD_CHECK(row_bytes > 0, std::string(op) + ": ggml type " + std::to_string(segments[s]) +
                                " has no kernel or K = " + std::to_string(k) + " is not a multiple of its block.");
    PD_CHECK(segments[s + 1] > 0, std::string(op) + ": a segment has no rows.");
    rows += segments[s + 1];
    expected += segments[s + 1] * row_bytes;
  }
  PD_CHECK(bytes == expected, std::string(op) + ": the weight has " + std::to_string(bytes) + " bytes, its segments " +
                                  std::to_string(expected) + ".");
  return rows;
}

}  // namespace

// x [..., K] float32, weight uint8 (the blocks of the segments' rows, one after the other),
// segments (ggml type, rows) pairs in output order, optional bias [N] -> [..., N] float32.
std::vector<paddle::Tensor> GgufLinear(const paddle::Tensor& x, const paddle::Tensor& weight,
                                       const paddle::optional<paddle::Tensor>& bias,
                                       const std::vector<int64_t>& segments, int isa) {
  fastdeploy_cpu::check_cpu_contiguous(x, "x");
  fastdeploy_cpu::check_cpu_contiguous(weight, "weight");
  fastdeploy_cpu::check_dtype(x, paddle::DataType::FLOAT32, "x");
  fastdeploy_cpu::check_dtype(weight, paddle::DataType::UINT8, "weight");
  const auto& shape = x.shape();
  PD_CHECK(!shape.empty(), "fd_gguf_linear: x must have at least one dimension.");
  const int64_t k = shape.back();
  const int64_t m = k ? x.numel() / k : 0;
  const int64_t n = check_segments(segments, k, weight.numel(), "fd_gguf_linear");
  std::vector<int64_t> out_shape(shape.begin(), shape.end());
  out_shape.back() = n;
  auto out = paddle::empty(out_shape, paddle::DataType::FLOAT32, x.place());
  const float* bias_data = nullptr;
  if (bias.is_initialized()) {
    fastdeploy_cpu::check_cpu_contiguous(*bias, "bias");
    PD_CHECK(bias->numel() == n, "fd_gguf_linear: bias must have N elements.");
    bias_data = bias->data<float>();
  }
  fastdeploy_cpu::gguf_gemm(x.data<float>(), m, k, weight.data<uint8_t>(), segments.data(),
                            static_cast<int64_t>(segments.size() / 2), bias_data, n, isa, out.data<float>());
  return {out};
}

// ids [T] int64 into the rows of weight [rows, row_bytes] of `ggml_type` -> [T, k] float32.
std::vector<paddle::Tensor> GgufEmbedding(const paddle::Tensor& ids, const paddle::Tensor& weight, int ggml_type,
                                          int64_t k) {
  fastdeploy_cpu::check_cpu_contiguous(ids, "ids");
  fastdeploy_cpu::check_cpu_contiguous(weight, "weight");
  fastdeploy_cpu::check_dtype(ids, paddle::DataType::INT64, "ids");
  fastdeploy_cpu::check_dtype(weight, paddle::DataType::UINT8, "weight");
  const int64_t row_bytes = fastdeploy_cpu::gguf_row_bytes(ggml_type, k);
  PD_CHECK(row_bytes > 0, "fd_gguf_embedding: ggml type " + std::to_string(ggml_type) + " has no kernel for rows of " +
                              std::to_string(k) + ".");
  PD_CHECK(weight.numel() % row_bytes == 0, "fd_gguf_embedding: the weight is not whole rows.");
  const int64_t rows = weight.numel() / row_bytes;
  const int64_t count = ids.numel();
  const int64_t* id = ids.data<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    PD_CHECK(id[i] >= 0 && id[i] < rows, "fd_gguf_embedding: token id " + std::to_string(id[i]) +
                                             " is outside the table (" + std::to_string(rows) + " rows).");
  }
  std::vector<int64_t> out_shape = ids.shape();
  out_shape.push_back(k);
  auto out = paddle::empty(out_shape, paddle::DataType::FLOAT32, ids.place());
  fastdeploy_cpu::gguf_dequantize_rows(weight.data<uint8_t>(), ggml_type, k, id, count, out.data<float>());
  return {out};
}

PD_BUILD_OP(fd_gguf_linear)
    .Inputs({"x", "weight", paddle::Optional("bias")})
    .Outputs({"out"})
    .Attrs({"segments: std::vector<int64_t>", "isa: int"})
    .SetKernelFn(PD_KERNEL(GgufLinear));

// Paddle infers an op's output from its first input unless told: here the output is fp32 rows.
std::vector<std::vector<int64_t>> GgufEmbeddingShape(const std::vector<int64_t>& ids_shape,
                                                     const std::vector<int64_t>&, int, int64_t k) {
  std::vector<int64_t> shape(ids_shape);
  shape.push_back(k);
  return {shape};
}

std::vector<paddle::DataType> GgufEmbeddingDtype(const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fd_gguf_embedding)
    .Inputs({"ids", "weight"})
    .Outputs({"out"})
    .Attrs({"ggml_type: int", "k: int64_t"})
    .SetKernelFn(PD_KERNEL(GgufEmbedding))
    .SetInferShapeFn(PD_INFER_SHAPE(GgufEmbeddingShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GgufEmbeddingDtype));
