// GGUF weights multiplied from their blocks (llama.cpp's block formats), and the embedding rows
// looked up from them.
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
// The blocks are repacked once at load (fd_gguf_pack) into the layout the kernel streams:
// tiles of 16 columns, and per tile and 32-element sub-block (in the order of K)
//
//     quants   8 groups x 16 columns x 4 bytes: group g holds elements 4g..4g+3 of each column,
//              so one load is a register of 16 (or, per half, 8) columns' dot-product operands.
//              4-bit formats keep two groups per byte (g in the low nibble, g + 4 in the high):
//              256 bytes; the others one element per byte: 512 bytes.
//     scales   16 columns' d0, then d1 (formats with a scale per 16 elements), then m (formats
//              with a min): fp16 as in the block for the 32-element formats, fp32 (d * the 6-bit
//              sub-block scale, as the block's dequantization computes it) for the K-quants.
//
// Columns past a segment's last pad its last tile with zeros. The 4-bit and 8-bit 32-element
// formats pack into exactly their block bytes; 5-bit ones and the K-quants into more.
// Nothing is unpacked or transposed per call, which is what bounded the kernel before.
//
// Three paths over one kernel template (gguf_gemm_impl.h): "avx512-vnni" (512-bit, a whole
// tile per register), "avx2" and "scalar" (8 columns, half a tile); and "amx-int8"
// (gguf_gemm_amx.h), which multiplies whole 16-row tiles on AMX and leaves the rest to the VNNI
// tiles, with the VNNI path's bits. Each is compiled for its own
// instructions (`#pragma GCC target`) whatever CPU builds the library; the platform picks one
// at start-up (fastdeploy/platforms/cpu.py) and the op refuses a path the CPU cannot run. The
// layout is the same for every path.
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

// Portable fp16 -> fp32 (the scalar path and the block decoding; the SIMD paths use F16C).
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
// the offset subtracted from element values, the largest element magnitude the dot products see
// (unsigned values; |w| of signed ones), whether the format has a min, whether its
// elements are signed bytes, whether a sub-block has two scales (one per 16 elements), whether
// its elements fit a nibble, and whether its scales are the block's fp16 fields.
struct BlockQ8_0 {
  static constexpr int kType = 8, kElems = 32, kBytes = 34, kSubs = 1, kOffset = 0, kMaxU = 128;
  static constexpr bool kHasMin = false, kSigned = true, kSplitScale = false, kNibble = false, kHalfScales = true;
};
struct BlockQ4_0 {
  static constexpr int kType = 2, kElems = 32, kBytes = 18, kSubs = 1, kOffset = 8, kMaxU = 15;
  static constexpr bool kHasMin = false, kSigned = false, kSplitScale = false, kNibble = true, kHalfScales = true;
};
struct BlockQ4_1 {
  static constexpr int kType = 3, kElems = 32, kBytes = 20, kSubs = 1, kOffset = 0, kMaxU = 15;
  static constexpr bool kHasMin = true, kSigned = false, kSplitScale = false, kNibble = true, kHalfScales = true;
};
struct BlockQ5_0 {
  static constexpr int kType = 6, kElems = 32, kBytes = 22, kSubs = 1, kOffset = 16, kMaxU = 31;
  static constexpr bool kHasMin = false, kSigned = false, kSplitScale = false, kNibble = false, kHalfScales = true;
};
struct BlockQ5_1 {
  static constexpr int kType = 7, kElems = 32, kBytes = 24, kSubs = 1, kOffset = 0, kMaxU = 31;
  static constexpr bool kHasMin = true, kSigned = false, kSplitScale = false, kNibble = false, kHalfScales = true;
};
struct BlockQ4_K {
  static constexpr int kType = 12, kElems = 256, kBytes = 144, kSubs = 8, kOffset = 0, kMaxU = 15;
  static constexpr bool kHasMin = true, kSigned = false, kSplitScale = false, kNibble = true, kHalfScales = false;
};
struct BlockQ5_K {
  static constexpr int kType = 13, kElems = 256, kBytes = 176, kSubs = 8, kOffset = 0, kMaxU = 31;
  static constexpr bool kHasMin = true, kSigned = false, kSplitScale = false, kNibble = false, kHalfScales = false;
};
struct BlockQ6_K {
  static constexpr int kType = 14, kElems = 256, kBytes = 210, kSubs = 8, kOffset = 32, kMaxU = 63;
  static constexpr bool kHasMin = false, kSigned = false, kSplitScale = true, kNibble = false, kHalfScales = false;
};

// Calls f(B{}) with the block type of ggml type `type`; false for a type without a kernel.
template <class F>
bool with_block(int type, F&& f) {
  switch (type) {
    case BlockQ8_0::kType: f(BlockQ8_0{}); return true;
    case BlockQ4_0::kType: f(BlockQ4_0{}); return true;
    case BlockQ4_1::kType: f(BlockQ4_1{}); return true;
    case BlockQ5_0::kType: f(BlockQ5_0{}); return true;
    case BlockQ5_1::kType: f(BlockQ5_1{}); return true;
    case BlockQ4_K::kType: f(BlockQ4_K{}); return true;
    case BlockQ5_K::kType: f(BlockQ5_K{}); return true;
    case BlockQ6_K::kType: f(BlockQ6_K{}); return true;
    default: return false;
  }
}

// ------------------------------------------------------------------ the packed layout

constexpr int kTileCols = 16;

template <class B>
constexpr int packed_quant_bytes() {
  return B::kNibble ? 256 : 512;
}
template <class B>
constexpr int packed_scale_size() {
  return B::kHalfScales ? 2 : 4;
}
template <class B>
constexpr int packed_sub_bytes() {
  return packed_quant_bytes<B>() + (1 + B::kSplitScale + B::kHasMin) * kTileCols * packed_scale_size<B>();
}
template <class B>
int64_t packed_bytes(int64_t rows, int64_t k) {
  return (rows + kTileCols - 1) / kTileCols * (k / 32) * packed_sub_bytes<B>();
}

// ------------------------------------------------------- decoding a block's sub-block (at load)

struct Quants {
  uint8_t b[32];
};
inline Quants nibbles16(const uint8_t* p) {
  Quants v;
  for (int i = 0; i < 16; ++i) {
    v.b[i] = p[i] & 15;
    v.b[i + 16] = p[i] >> 4;
  }
  return v;
}
inline Quants nibbles32(const uint8_t* p, int shift) {
  Quants v;
  for (int i = 0; i < 32; ++i) v.b[i] = (p[i] >> shift) & 15;
  return v;
}
inline Quants or_bits(Quants v, uint32_t bits) {
  for (int i = 0; i < 32; ++i) v.b[i] |= ((bits >> i) & 1u) << 4;
  return v;
}
inline Quants or_high(Quants v, const uint8_t* p, int shift, int mask) {
  for (int i = 0; i < 32; ++i) v.b[i] |= ((p[i] >> shift) & mask) << 4;
  return v;
}

// Sub-block j's element values u (bytes; signed formats: int8) and its scales: the dequantized
// element is d * (u - offset) + m, d = d0 for elements 0-15 and d1 for 16-31.
struct SubScales {
  float d0, d1, m;
};

inline Quants bytes(BlockQ8_0, const uint8_t* b, int) {
  Quants v;
  std::memcpy(v.b, b + 2, 32);
  return v;
}
inline Quants bytes(BlockQ4_0, const uint8_t* b, int) { return nibbles16(b + 2); }
inline Quants bytes(BlockQ4_1, const uint8_t* b, int) { return nibbles16(b + 4); }
inline Quants bytes(BlockQ5_0, const uint8_t* b, int) { return or_bits(nibbles16(b + 6), load_u32(b + 2)); }
inline Quants bytes(BlockQ5_1, const uint8_t* b, int) { return or_bits(nibbles16(b + 8), load_u32(b + 4)); }
// Q4_K / Q5_K: sub-block j holds the low (even j) or high (odd j) nibbles of 32 bytes of qs.
inline Quants bytes(BlockQ4_K, const uint8_t* b, int j) { return nibbles32(b + 16 + 32 * (j / 2), 4 * (j % 2)); }
inline Quants bytes(BlockQ5_K, const uint8_t* b, int j) {
  return or_high(nibbles32(b + 48 + 32 * (j / 2), 4 * (j % 2)), b + 16, j, 1);
}
// Q6_K: ql[128] qh[64] int8 scales[16] fp16 d. Sub-block j = 4h + g takes the low (g < 2) or
// high nibbles of ql[64h + 32 (g % 2) ...] and bits 2g, 2g+1 of qh[32h ...].
inline Quants bytes(BlockQ6_K, const uint8_t* b, int j) {
  const int h = j / 4, g = j % 4;
  return or_high(nibbles32(b + 64 * h + 32 * (g % 2), 4 * (g / 2)), b + 128 + 32 * h, 2 * g, 3);
}

// The 32-element formats: an fp16 d at byte 0 and (with a min) an fp16 m at byte 2.
template <class B>
inline SubScales scales(B, const uint8_t* b, int) {
  static_assert(B::kHalfScales);
  const float d = half_to_float(load_u16(b));
  return {d, d, B::kHasMin ? half_to_float(load_u16(b + 2)) : 0.0f};
}
inline SubScales k_scales(const uint8_t* b, int j) {
  const KScaleMin sm = k_scale_min(b + 4, j);
  const float d = half_to_float(load_u16(b)) * sm.scale;
  return {d, d, -half_to_float(load_u16(b + 2)) * sm.min};
}
inline SubScales scales(BlockQ4_K, const uint8_t* b, int j) { return k_scales(b, j); }
inline SubScales scales(BlockQ5_K, const uint8_t* b, int j) { return k_scales(b, j); }
inline SubScales scales(BlockQ6_K, const uint8_t* b, int j) {
  const float d = half_to_float(load_u16(b + 208));
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  return {d * sc[2 * j], d * sc[2 * j + 1], 0.0f};
}

// ------------------------------------------------------------- packing and unpacking (scalar)

// Byte of the packed quants that holds element i of column c, and the shift of its nibble.
template <class B>
inline int quant_pos(int c, int i, int& shift) {
  if constexpr (B::kNibble) {
    shift = i < 16 ? 0 : 4;
    return (i % 16) / 4 * 64 + c * 4 + i % 4;
  } else {
    shift = 0;
    return i / 4 * 64 + c * 4 + i % 4;
  }
}

// `rows` rows of blocks of type B (k elements each) -> the packed tiles at `out`.
template <class B>
void pack_segment(const uint8_t* w, int64_t rows, int64_t k, uint8_t* out) {
  const int64_t row_bytes = k / B::kElems * B::kBytes, subs = k / 32;
  std::memset(out, 0, packed_bytes<B>(rows, k));
  for (int64_t col = 0; col < rows; ++col) {
    const int64_t t = col / kTileCols;
    const int c = static_cast<int>(col % kTileCols);
    for (int64_t s = 0; s < subs; ++s) {
      const uint8_t* block = w + col * row_bytes + s / B::kSubs * B::kBytes;
      const int j = static_cast<int>(s % B::kSubs);
      uint8_t* sub = out + (t * subs + s) * packed_sub_bytes<B>();
      const Quants u = bytes(B{}, block, j);
      for (int i = 0; i < 32; ++i) {
        int shift;
        sub[quant_pos<B>(c, i, shift)] |= static_cast<uint8_t>(u.b[i] << shift);
      }
      uint8_t* sc = sub + packed_quant_bytes<B>();
      constexpr int kSize = packed_scale_size<B>(), kMinAt = B::kSplitScale ? 2 : 1;
      if constexpr (B::kHalfScales) {  // the block's own fp16 fields
        std::memcpy(sc + c * kSize, block, 2);
        if constexpr (B::kHasMin) std::memcpy(sc + (kMinAt * kTileCols + c) * kSize, block + 2, 2);
      } else {
        const SubScales v = scales(B{}, block, j);
        std::memcpy(sc + c * kSize, &v.d0, 4);
        if constexpr (B::kSplitScale) std::memcpy(sc + (kTileCols + c) * kSize, &v.d1, 4);
        if constexpr (B::kHasMin) std::memcpy(sc + (kMinAt * kTileCols + c) * kSize, &v.m, 4);
      }
    }
  }
}

template <class B>
inline float packed_scale(const uint8_t* sc, int which, int c) {
  const uint8_t* p = sc + (which * kTileCols + c) * packed_scale_size<B>();
  if constexpr (B::kHalfScales) return half_to_float(load_u16(p));
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// Column `col` of a packed segment of type B as fp32 (the block's dequantization, bit for bit).
template <class B>
void unpack_column(const uint8_t* packed, int64_t col, int64_t k, float* out) {
  const int64_t subs = k / 32, t = col / kTileCols;
  const int c = static_cast<int>(col % kTileCols);
  for (int64_t s = 0; s < subs; ++s) {
    const uint8_t* sub = packed + (t * subs + s) * packed_sub_bytes<B>();
    const uint8_t* sc = sub + packed_quant_bytes<B>();
    const float d0 = packed_scale<B>(sc, 0, c);
    const float d1 = B::kSplitScale ? packed_scale<B>(sc, 1, c) : d0;
    const float m = B::kHasMin ? packed_scale<B>(sc, B::kSplitScale ? 2 : 1, c) : 0.0f;
    for (int i = 0; i < 32; ++i) {
      int shift;
      const uint8_t byte = sub[quant_pos<B>(c, i, shift)];
      const uint8_t u = B::kNibble ? (byte >> shift) & 15 : byte;
      const int q = B::kSigned ? static_cast<int8_t>(u) : static_cast<int>(u) - B::kOffset;
      out[s * 32 + i] = (i < 16 ? d0 : d1) * static_cast<float>(q) + m;
    }
  }
}

// ------------------------------------------------------------------- the activations

// The activations as the kernel sees them: per row, k int8 values, k / 32 scales, k / 16
// half-block sums (dx * sum of the half's int8 values; rows of half_stride, a multiple of 8
// padded with zeros) and k / 32 block sums (the two halves' added, for formats with one scale
// per block; rows of k / 32).
struct QuantizedActs {
  const int8_t* q;
  const float* d;
  const float* half_sums;
  const float* block_sums;
  int64_t half_stride;
};

inline int64_t half_stride(int64_t k) { return (k / 16 + 7) / 8 * 8; }

// One row: dx = max|x| / 127, q = nearbyint(x / dx) (the same float operations as the tests'
// reference), exact in any vectorization.
void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* half_sums, float* block_sums) {
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
    block_sums[s] = half_sums[2 * s] + half_sums[2 * s + 1];
  }
}

}  // namespace

// ------------------------------------------------------------------------------ scalar path

namespace gguf_scalar {

struct Ops {
  static constexpr int kLanes = 8, kRows = 4, kSignedBias = 0;
  struct I {
    int32_t l[8];
  };
  struct F {
    float f[8];
  };
  struct T {
    uint8_t g[8][32];  // group g: 4 bytes of each of the 8 columns
  };
  template <bool kNibble, bool kSigned>
  static T load_tile(const uint8_t* q, int h) {
    T t;
    for (int g = 0; g < (kNibble ? 4 : 8); ++g) {
      const uint8_t* src = q + g * 64 + h * 32;
      for (int i = 0; i < 32; ++i) {
        t.g[g][i] = kNibble ? src[i] & 15 : src[i];
        if (kNibble) t.g[g + 4][i] = src[i] >> 4;
      }
    }
    return t;
  }
  template <bool kSigned, int kMaxU>
  static void dot(const T& t, const int8_t* x, I& lo, I& hi) {
    for (int c = 0; c < 8; ++c) {
      int32_t sums[2] = {0, 0};
      for (int g = 0; g < 8; ++g) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t u = t.g[g][4 * c + i];
          sums[g / 4] += (kSigned ? static_cast<int8_t>(u) : static_cast<int32_t>(u)) * x[4 * g + i];
        }
      }
      lo.l[c] = sums[0];
      hi.l[c] = sums[1];
    }
  }
  template <bool kSigned, int kMaxU>
  static I dot_all(const T& t, const int8_t* x) {
    I lo, hi;
    dot<kSigned, kMaxU>(t, x, lo, hi);
    return add_i(lo, hi);
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
  static F loadh(const uint16_t* p) {
    F v;
    for (int i = 0; i < 8; ++i) v.f[i] = half_to_float(p[i]);
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
};

#include "gguf_gemm_impl.h"

}  // namespace gguf_scalar

// ------------------------------------------------------------------------ AVX2 + FMA path

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace gguf_avx2 {

struct Ops {
  static constexpr int kLanes = 8, kSignedBias = 0;
  // 16 registers hold the 8 groups and 2 x 2 accumulators; 4 rows spill some, yet each tile's
  // groups serve twice the rows (with the int16 sums: benchmarks/results/
  // gguf_rows_avx2_int16_sums_ab_epyc_avx2_2026-12-07.json).
  static constexpr int kRows = 4;
  using I = __m256i;
  using F = __m256;
  struct T {
    __m256i g[8];
  };
  template <bool kNibble, bool kSigned>
  static T load_tile(const uint8_t* q, int h) {
    T t;
    for (int g = 0; g < (kNibble ? 4 : 8); ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * 64 + h * 32));
      if (kNibble) {
        t.g[g] = _mm256_and_si256(v, _mm256_set1_epi8(15));
        t.g[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
      } else {
        t.g[g] = v;
      }
    }
    return t;
  }
  static __m256i group(const int8_t* x, int g) {
    int32_t v;
    std::memcpy(&v, x + 4 * g, sizeof(v));
    return _mm256_set1_epi32(v);
  }
  // Group g's products in int16 pairs (vpmaddubsw): unsigned u <= kMaxU < 64 never reaches int16's
  // limit; signed weights multiply as |w| * (x with w's sign), at most 128 * 127 per product.
  template <bool kSigned>
  static __m256i pairs(const T& t, const int8_t* x, int g) {
    const __m256i xg = group(x, g);
    return kSigned ? _mm256_maddubs_epi16(_mm256_sign_epi8(t.g[g], t.g[g]), _mm256_sign_epi8(xg, t.g[g]))
                   : _mm256_maddubs_epi16(t.g[g], xg);
  }
  // Groups [g0, g1) summed exactly: runs of groups whose int16 pairs cannot overflow when added
  // (each pair is at most 2 * 127 * kMaxU: eight runs of 4-bit values, four of 5-bit, two of 6-bit)
  // are added in int16 and widened once (vpmaddwd with ones). The widening is a second multiply,
  // and vector multiplies issue on fewer ports than adds: 4-bit formats take 9 multiplies per
  // sub-block and row instead of 16. Integer sums: the result is the same whatever the grouping.
  template <bool kSigned, int kMaxU>
  static __m256i sum_groups(const T& t, const int8_t* x, int g0, int g1) {
    constexpr int kRun = 32767 / (2 * 127 * kMaxU);
    static_assert(kRun >= 1, "a pair of products must fit int16");
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sum = _mm256_setzero_si256();
    for (int g = g0; g < g1; g += kRun) {
      __m256i run = pairs<kSigned>(t, x, g);
      for (int j = g + 1; j < std::min(g1, g + kRun); ++j) run = _mm256_add_epi16(run, pairs<kSigned>(t, x, j));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(run, ones));
    }
    return sum;
  }
  template <bool kSigned, int kMaxU>
  static void dot(const T& t, const int8_t* x, I& lo, I& hi) {
    lo = sum_groups<kSigned, kMaxU>(t, x, 0, 4);
    hi = sum_groups<kSigned, kMaxU>(t, x, 4, 8);
  }
  template <bool kSigned, int kMaxU>
  static I dot_all(const T& t, const int8_t* x) {
    return sum_groups<kSigned, kMaxU>(t, x, 0, 8);
  }
  static F zero() { return _mm256_setzero_ps(); }
  static F splat(float s) { return _mm256_set1_ps(s); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F loadh(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void storef(F v, float* p) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  static F fma(I l, F s, F acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), s, acc); }
  static F fmaf(F a, F b, F acc) { return _mm256_fmadd_ps(a, b, acc); }
};

#include "gguf_gemm_impl.h"

#include "reduce_rows8_avx2_impl.h"

// quantize_row 8 blocks at a time, with the same float operations on each block, so the same
// values. The scalar loop (nearbyint per element, a horizontal max and two sums per block) was
// 7% of the engine's time at 16 streams on an AVX2 EPYC
// (benchmarks/results/profile_c16_epyc_avx2_2026-12-07.json).
void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* half_sums, float* block_sums) {
  const auto max_op = [](__m256 a, __m256 b) { return _mm256_max_ps(a, b); };
  const auto add_op = [](__m256 a, __m256 b) {
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(a), _mm256_castps_si256(b)));
  };
  const __m256 sign = _mm256_set1_ps(-0.0f);
  // packs_epi32 then packs_epi16 leave each 128-bit lane's four 4-byte groups in the order
  // (a, b, c, d) of the four source registers; this puts the 8 groups back in element order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int64_t subs = k / 32;
  for (int64_t s0 = 0; s0 < subs; s0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, subs - s0));
    const float* xs = x + s0 * 32;
    __m256 v[8];
    for (int j = 0; j < 8; ++j) {
      v[j] = _mm256_setzero_ps();
      for (int i = 0; j < n && i < 4; ++i) v[j] = _mm256_max_ps(v[j], _mm256_andnot_ps(sign, _mm256_loadu_ps(xs + j * 32 + 8 * i)));
    }
    const __m256 dx = _mm256_div_ps(reduce_rows8(v, max_op), _mm256_set1_ps(127.0f));
    const __m256 nonzero = _mm256_cmp_ps(dx, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    alignas(32) float dx_s[8], inv_s[8];
    _mm256_store_ps(dx_s, dx);
    _mm256_store_ps(inv_s, _mm256_and_ps(nonzero, _mm256_div_ps(_mm256_set1_ps(1.0f), dx)));
    __m256 lo[8], hi[8];  // each block's two halves of q, as int32 lanes
    for (int j = 0; j < 8; ++j) {
      if (j >= n) {
        lo[j] = hi[j] = _mm256_setzero_ps();
        continue;
      }
      const __m256 iv = _mm256_set1_ps(inv_s[j]);
      __m256i qi[4];
      for (int i = 0; i < 4; ++i) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xs + j * 32 + 8 * i), iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        qi[i] = _mm256_cvtps_epi32(r);
      }
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + (s0 + j) * 32), _mm256_permutevar8x32_epi32(packed, order));
      lo[j] = _mm256_castsi256_ps(_mm256_add_epi32(qi[0], qi[1]));
      hi[j] = _mm256_castsi256_ps(_mm256_add_epi32(qi[2], qi[3]));
    }
    alignas(32) int32_t lo_s[8], hi_s[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lo_s), _mm256_castps_si256(reduce_rows8(lo, add_op)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(hi_s), _mm256_castps_si256(reduce_rows8(hi, add_op)));
    for (int j = 0; j < n; ++j) {
      const int64_t s = s0 + j;
      d[s] = dx_s[j];
      half_sums[2 * s] = dx_s[j] * static_cast<float>(lo_s[j]);
      half_sums[2 * s + 1] = dx_s[j] * static_cast<float>(hi_s[j]);
      block_sums[s] = half_sums[2 * s] + half_sums[2 * s + 1];
    }
  }
}

}  // namespace gguf_avx2
#pragma GCC pop_options

// ------------------------------------------------------------------ AVX512-VNNI path (512-bit)

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace gguf_vnni {

struct Ops {
  static constexpr int kLanes = 16, kSignedBias = 128;
  static constexpr int kRows = 6;  // 32 registers: the 8 groups, the scales and 6 x 2 accumulators
  using I = __m512i;
  using F = __m512;
  struct T {
    __m512i g[8];
  };
  // Signed weights as w + 128 (unsigned); the 128 * sum(x) is taken off with the offset term.
  template <bool kNibble, bool kSigned>
  static T load_tile(const uint8_t* q, int) {
    T t;
    for (int g = 0; g < (kNibble ? 4 : 8); ++g) {
      const __m512i v = _mm512_loadu_si512(q + g * 64);
      if (kNibble) {
        t.g[g] = _mm512_and_si512(v, _mm512_set1_epi8(15));
        t.g[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
      } else {
        t.g[g] = kSigned ? _mm512_xor_si512(v, _mm512_set1_epi8(-128)) : v;
      }
    }
    return t;
  }
  // acc += dot of w's bytes with x's 4-byte group g broadcast as a memory operand ({1to16}) of
  // vpdpbusd itself: GCC emits a separate vpbroadcastd for _mm512_set1_epi32, one more vector
  // instruction per dot instruction on the ports the dot products need.
  static void dpbusd_bcast(__m512i& acc, __m512i w, const int8_t* x, int g) {
    asm("vpdpbusd %[x]%{1to16%}, %[w], %[acc]"
        : [acc] "+v"(acc)
        : [w] "v"(w), [x] "m"(*reinterpret_cast<const int32_t*>(x + 4 * g)));
  }
  template <bool kSigned, int kMaxU>
  static void dot(const T& t, const int8_t* x, I& lo, I& hi) {
    lo = hi = _mm512_setzero_si512();
    for (int g = 0; g < 4; ++g) dpbusd_bcast(lo, t.g[g], x, g);
    for (int g = 4; g < 8; ++g) dpbusd_bcast(hi, t.g[g], x, g);
  }
  // One chain of 8 (no add of the halves: one instruction fewer per row and sub-block).
  template <bool kSigned, int kMaxU>
  static I dot_all(const T& t, const int8_t* x) {
    I acc = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) dpbusd_bcast(acc, t.g[g], x, g);
    return acc;
  }
  static F zero() { return _mm512_setzero_ps(); }
  static F splat(float s) { return _mm512_set1_ps(s); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F loadh(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void storef(F v, float* p) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
  static F fma(I l, F s, F acc) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), s, acc); }
  static F fmaf(F a, F b, F acc) { return _mm512_fmadd_ps(a, b, acc); }
};

#include "gguf_gemm_impl.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
#include "gguf_gemm_amx.h"
#pragma GCC pop_options

// Lane i of the result: v[i]'s 16 lanes combined by `op`, which must not depend on the order
// (max, integer addition). A tree of 30 shuffles and 15 ops for 16 rows, where 16 horizontal
// reductions take 64 of each.
template <class Op>
inline __m512 reduce_rows16(const __m512 v[16], Op op) {
  __m512 a[8], b[4], c[2];
  // a[i], per 128-bit lane: v[2i] and v[2i + 1] reduced to two lanes each, interleaved.
  for (int i = 0; i < 8; ++i) a[i] = op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // b[i], per 128-bit lane: that lane's total of v[4i] .. v[4i + 3].
  for (int i = 0; i < 4; ++i) {
    b[i] = op(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // c[i]: 128-bit lanes 0|1 and 2|3 combined, for b[2i] then b[2i + 1].
  for (int i = 0; i < 2; ++i) {
    c[i] = op(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return op(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// quantize_row in 512-bit registers, 16 blocks at a time: the same float operations on each block
// (the maxima and integer sums are exact in any order), so the same values. One block's horizontal
// max and two sums per block took ~12 ns, 5% of a 256-token prefill.
void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* half_sums, float* block_sums) {
  const auto max_op = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  const auto add_op = [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  };
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const int64_t subs = k / 32;
  for (int64_t s0 = 0; s0 < subs; s0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, subs - s0));
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    const float* xs = x + s0 * 32;
    __m512 v[16];
    for (int j = 0; j < 16; ++j) {
      v[j] = j < n ? _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xs + j * 32)), _mm512_abs_ps(_mm512_loadu_ps(xs + j * 32 + 16)))
                   : _mm512_setzero_ps();
    }
    const __m512 dx = _mm512_div_ps(reduce_rows16(v, max_op), _mm512_set1_ps(127.0f));
    const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(dx, _mm512_setzero_ps(), _CMP_NEQ_UQ), _mm512_set1_ps(1.0f), dx);
    alignas(64) float inv_s[16];
    _mm512_store_ps(inv_s, inv);
    __m512 lo[16], hi[16];  // each block's two halves of q, as int32 lanes
    for (int j = 0; j < 16; ++j) {
      if (j >= n) {
        lo[j] = hi[j] = _mm512_setzero_ps();
        continue;
      }
      const __m512 iv = _mm512_set1_ps(inv_s[j]);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xs + j * 32), iv), kNearest));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xs + j * 32 + 16), iv), kNearest));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + (s0 + j) * 32), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + (s0 + j) * 32 + 16), _mm512_cvtepi32_epi8(qb));
      lo[j] = _mm512_castsi512_ps(qa);
      hi[j] = _mm512_castsi512_ps(qb);
    }
    const __m512 h0 = _mm512_mul_ps(dx, _mm512_cvtepi32_ps(_mm512_castps_si512(reduce_rows16(lo, add_op))));
    const __m512 h1 = _mm512_mul_ps(dx, _mm512_cvtepi32_ps(_mm512_castps_si512(reduce_rows16(hi, add_op))));
    _mm512_mask_storeu_ps(d + s0, valid, dx);
    _mm512_mask_storeu_ps(block_sums + s0, valid, _mm512_add_ps(h0, h1));
    // (h0, h1) pairs in order: lanes 0-7 of each interleaved, then lanes 8-15.
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    _mm512_mask_storeu_ps(half_sums + 2 * s0, static_cast<__mmask16>(n >= 8 ? 0xffff : (1u << (2 * n)) - 1u),
                          _mm512_permutex2var_ps(h0, first, h1));
    if (n > 8) {
      _mm512_mask_storeu_ps(half_sums + 2 * s0 + 16, static_cast<__mmask16>((1u << (2 * (n - 8))) - 1u),
                            _mm512_permutex2var_ps(h0, second, h1));
    }
  }
}

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
    case kGgufAmxInt8: return isa_supported(kGgufAvx512Vnni) && amx_int8_usable();
    default: return false;
  }
}

}  // namespace

int64_t gguf_row_bytes(int type, int64_t k) {
  int64_t bytes = -1;
  with_block(type, [&](auto b) {
    using B = decltype(b);
    if (k > 0 && k % B::kElems == 0) bytes = k / B::kElems * B::kBytes;
  });
  return bytes;
}

int64_t gguf_packed_bytes(int type, int64_t rows, int64_t k) {
  int64_t bytes = -1;
  with_block(type, [&](auto b) {
    using B = decltype(b);
    if (k > 0 && k % B::kElems == 0 && rows > 0) bytes = packed_bytes<B>(rows, k);
  });
  return bytes;
}

void gguf_pack(const uint8_t* w, const int64_t* segments, int64_t num_segments, int64_t k, uint8_t* out) {
  for (int64_t s = 0; s < num_segments; ++s) {
    const int type = static_cast<int>(segments[2 * s]);
    const int64_t rows = segments[2 * s + 1];
    with_block(type, [&](auto b) { pack_segment<decltype(b)>(w, rows, k, out); });
    w += rows * gguf_row_bytes(type, k);
    out += gguf_packed_bytes(type, rows, k);
  }
}

void gguf_gemm(const float* x, int64_t m, int64_t k, const uint8_t* w, const int64_t* segments, int64_t num_segments,
               const float* bias, int64_t n, int isa, float* out) {
  if (m == 0 || n == 0) return;
  PD_CHECK(isa_supported(isa), "fd_gguf_linear: this CPU cannot run kernel path " + std::to_string(isa) + ".");
  const int64_t subs = k / 32, stride = half_stride(k);
  // Too few rows for a tile take the VNNI tiles alone (the same bits either way).
  if (isa == kGgufAmxInt8 && gguf_vnni::amx::amx_rows(m) == 0) isa = kGgufAvx512Vnni;
  // The rows the activation buffers hold: AMX's part-filled last tile reads zero rows past m.
  const int64_t rows_held = isa == kGgufAmxInt8 ? std::max(m, gguf_vnni::amx::amx_rows(m)) : m;
  thread_local std::vector<int8_t> q_buf;
  thread_local std::vector<float> d_buf, sums_buf, block_buf;
  q_buf.resize(rows_held * k);
  d_buf.resize(rows_held * subs);
  sums_buf.assign(rows_held * stride, 0.0f);
  block_buf.resize(rows_held * subs);
  std::fill(q_buf.begin() + m * k, q_buf.begin() + rows_held * k, int8_t{0});
  std::fill(d_buf.begin() + m * subs, d_buf.begin() + rows_held * subs, 0.0f);
  std::fill(block_buf.begin() + m * subs, block_buf.begin() + rows_held * subs, 0.0f);
  int8_t* q = q_buf.data();
  float* d = d_buf.data();
  float* sums = sums_buf.data();
  float* blocks = block_buf.data();
#pragma omp parallel for schedule(static) if (m >= 16 && !omp_in_parallel())
  for (int64_t r = 0; r < m; ++r) {
    auto* quantize = isa == kGgufAvx512Vnni || isa == kGgufAmxInt8 ? gguf_vnni::quantize_row
                     : isa == kGgufAvx2                             ? gguf_avx2::quantize_row
                                                                    : quantize_row;
    quantize(x + r * k, k, q + r * k, d + r * subs, sums + r * stride, blocks + r * subs);
  }
  const QuantizedActs acts{q, d, sums, blocks, stride};

  // Each thread takes a contiguous range of every segment's tiles: the weights are read once in
  // all, and which thread computes a column changes nothing in it.
  const int threads = team_size(n / 64);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t col = 0;
    const uint8_t* seg_w = w;
    for (int64_t s = 0; s < num_segments; ++s) {
      const int type = static_cast<int>(segments[2 * s]);
      const int64_t rows = segments[2 * s + 1];
      const int64_t num_tiles = (rows + kTileCols - 1) / kTileCols;
      const int64_t tb = num_tiles * t / nt, te = num_tiles * (t + 1) / nt;
      const float* seg_bias = bias != nullptr ? bias + col : nullptr;
      float* seg_out = out + col;
      if (tb < te) {
        switch (isa) {
          case kGgufAmxInt8:
            gguf_vnni::amx::segment_tiles(type, acts, m, k, seg_w, rows, tb, te, seg_bias, seg_out, n);
            break;
          case kGgufAvx512Vnni: gguf_vnni::segment_tiles(type, acts, m, k, seg_w, rows, tb, te, seg_bias, seg_out, n); break;
          case kGgufAvx2: gguf_avx2::segment_tiles(type, acts, m, k, seg_w, rows, tb, te, seg_bias, seg_out, n); break;
          default: gguf_scalar::segment_tiles(type, acts, m, k, seg_w, rows, tb, te, seg_bias, seg_out, n); break;
        }
      }
      col += rows;
      seg_w += gguf_packed_bytes(type, rows, k);
    }
  }
}

void gguf_dequantize_rows(const uint8_t* w, int type, int64_t k, const int64_t* ids, int64_t count, float* out) {
#pragma omp parallel for schedule(static) if (count >= 64)
  for (int64_t i = 0; i < count; ++i) {
    with_block(type, [&](auto b) { unpack_column<decltype(b)>(w, ids[i], k, out + i * k); });
  }
}

}  // namespace fastdeploy_cpu

namespace {

// The weight's rows per segment and its byte size (as blocks, or packed), checked against K;
// returns the total rows.
int64_t check_segments(const std::vector<int64_t>& segments, int64_t k, int64_t bytes, bool packed, const char* op) {
  PD_CHECK(!segments.empty() && segments.size() % 2 == 0, std::string(op) + ": segments are (type, rows) pairs.");
  int64_t rows = 0, expected = 0;
  for (size_t s = 0; s < segments.size(); s += 2) {
    const int type = static_cast<int>(segments[s]);
    PD_CHECK(fastdeploy_cpu::gguf_row_bytes(type, k) > 0,
             std::string(op) + ": ggml type " + std::to_string(segments[s]) + " has no kernel or K = " +
                 std::to_string(k) + " is not a multiple of its block.");
    PD_CHECK(segments[s + 1] > 0, std::string(op) + ": a segment has no rows.");
    rows += segments[s + 1];
    expected += packed ? fastdeploy_cpu::gguf_packed_bytes(type, segments[s + 1], k)
                       : segments[s + 1] * fastdeploy_cpu::gguf_row_bytes(type, k);
  }
  PD_CHECK(bytes == expected, std::string(op) + ": the weight has " + std::to_string(bytes) + " bytes, its segments " +
                                  std::to_string(expected) + ".");
  return rows;
}

}  // namespace

// x [..., K] float32, weight uint8 (the segments packed by fd_gguf_pack, one after the other),
// segments (ggml type, rows) pairs in output order, optional bias [N] -> [..., N] float32.
std::vector<paddle::Tensor> GgufLinear(const paddle::Tensor& x, const paddle::Tensor& weight,
                                       const paddle::optional<paddle::Tensor>& bias,
                                       const std::vector<int64_t>& segments, int isa) {
  fastdeploy_cpu::check_cpu_contiguous(weight, "weight");
  fastdeploy_cpu::check_dtype(weight, paddle::DataType::UINT8, "weight");
  const auto [m, k] = fastdeploy_cpu::check_linear_x(x, "fd_gguf_linear");
  const int64_t n = check_segments(segments, k, weight.numel(), true, "fd_gguf_linear");
  auto out = fastdeploy_cpu::linear_output(x, n);
  const float* bias_data = fastdeploy_cpu::optional_bias(bias, n, "fd_gguf_linear");
  fastdeploy_cpu::gguf_gemm(x.data<float>(), m, k, weight.data<uint8_t>(), segments.data(),
                            static_cast<int64_t>(segments.size() / 2), bias_data, n, isa, out.data<float>());
  return {out};
}

// weight uint8: the blocks of the segments' rows (k elements each), one after the other ->
// the packed layout of the kernel (one uint8 tensor).
std::vector<paddle::Tensor> GgufPack(const paddle::Tensor& weight, const std::vector<int64_t>& segments, int64_t k) {
  fastdeploy_cpu::check_cpu_contiguous(weight, "weight");
  fastdeploy_cpu::check_dtype(weight, paddle::DataType::UINT8, "weight");
  check_segments(segments, k, weight.numel(), false, "fd_gguf_pack");
  int64_t bytes = 0;
  for (size_t s = 0; s < segments.size(); s += 2) {
    bytes += fastdeploy_cpu::gguf_packed_bytes(static_cast<int>(segments[s]), segments[s + 1], k);
  }
  auto out = paddle::empty({bytes}, paddle::DataType::UINT8, weight.place());
  fastdeploy_cpu::gguf_pack(weight.data<uint8_t>(), segments.data(), static_cast<int64_t>(segments.size() / 2), k,
                            out.data<uint8_t>());
  return {out};
}

// ids [T] int64 into the `rows` rows (of k elements of `ggml_type`) of a table packed by
// fd_gguf_pack -> [T, k] float32.
std::vector<paddle::Tensor> GgufEmbedding(const paddle::Tensor& ids, const paddle::Tensor& weight, int ggml_type,
                                          int64_t rows, int64_t k) {
  fastdeploy_cpu::check_cpu_contiguous(ids, "ids");
  fastdeploy_cpu::check_cpu_contiguous(weight, "weight");
  fastdeploy_cpu::check_dtype(ids, paddle::DataType::INT64, "ids");
  fastdeploy_cpu::check_dtype(weight, paddle::DataType::UINT8, "weight");
  PD_CHECK(fastdeploy_cpu::gguf_row_bytes(ggml_type, k) > 0, "fd_gguf_embedding: ggml type " +
                                                                  std::to_string(ggml_type) +
                                                                  " has no kernel for rows of " + std::to_string(k) + ".");
  PD_CHECK(weight.numel() == fastdeploy_cpu::gguf_packed_bytes(ggml_type, rows, k),
           "fd_gguf_embedding: the weight is not a packed table of " + std::to_string(rows) + " rows.");
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
                                                     const std::vector<int64_t>&, int, int64_t, int64_t k) {
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
    .Attrs({"ggml_type: int", "rows: int64_t", "k: int64_t"})
    .SetKernelFn(PD_KERNEL(GgufEmbedding))
    .SetInferShapeFn(PD_INFER_SHAPE(GgufEmbeddingShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GgufEmbeddingDtype));

std::vector<std::vector<int64_t>> GgufPackShape(const std::vector<int64_t>&, const std::vector<int64_t>& segments,
                                                int64_t k) {
  int64_t bytes = 0;
  for (size_t s = 0; s + 1 < segments.size(); s += 2) {
    bytes += fastdeploy_cpu::gguf_packed_bytes(static_cast<int>(segments[s]), segments[s + 1], k);
  }
  return {{bytes}};
}

PD_BUILD_OP(fd_gguf_pack)
    .Inputs({"weight"})
    .Outputs({"out"})
    .Attrs({"segments: std::vector<int64_t>", "k: int64_t"})
    .SetKernelFn(PD_KERNEL(GgufPack))
    .SetInferShapeFn(PD_INFER_SHAPE(GgufPackShape));
