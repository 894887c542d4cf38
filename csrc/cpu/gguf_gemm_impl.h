// The GGUF block kernel, written once over an instruction-set policy `Ops`; gguf_gemm.cc
// includes this file once per path, each time inside its own namespace and (for the SIMD
// paths) inside a `#pragma GCC target` region, so every function here is compiled for that
// path's instructions whatever -march the library is built with. No include guard on purpose.
//
// `Ops` (defined by the includer) provides, for one 32-element sub-block:
//   V  32 weight bytes; I  8 x int32 lanes; F  8 x fp32 lanes
//   nibbles16(p)          [p[i] & 15 for i < 16] then [p[i] >> 4 for i < 16]
//   nibbles32(p, shift)   (p[i] >> shift) & 15 for i < 32
//   or_bits(v, bits)      v[i] |= 16 where bit i of `bits` is set
//   or_high(v, p, shift, mask)  v[i] |= ((p[i] >> shift) & mask) << 4
//   load(p), store(v, p)  32 raw bytes
//   dot_u(u, x)           lane l = sum over i < 4 of u[4l + i] * x[4l + i] (u unsigned, < 64)
//   dot_s(w, x)           the same for signed weights, plus kSignedBias * the same sum of x
//   zero(), splat(s), splat2(s0, s1) (lanes 0-3 s0, 4-7 s1), fma(l, s, acc) = acc + l * s, sum(acc)
//   loadf(p) 8 floats, fmaf(a, b, acc) = acc + a * b
//   half(h)               fp16 bits -> fp32
//
// Block types (the structs of gguf_gemm.cc) give the bytes and scales of each sub-block j of
// a block: w = dw * (u - offset) + mw for element values u; Q6_K has one dw per 16 elements.

// ---------------------------------------------------------------- sub-block bytes and scales

struct SubScales {
  float d0, d1, m;  // scale of elements 0-15, of 16-31, and the min (0 where the format has none)
};

inline typename Ops::V bytes(BlockQ8_0, const uint8_t* b, int) { return Ops::load(b + 2); }
inline SubScales scales(BlockQ8_0, const uint8_t* b, int) {
  const float d = Ops::half(load_u16(b));
  return {d, d, 0.0f};
}

inline typename Ops::V bytes(BlockQ4_0, const uint8_t* b, int) { return Ops::nibbles16(b + 2); }
inline SubScales scales(BlockQ4_0, const uint8_t* b, int) {
  const float d = Ops::half(load_u16(b));
  return {d, d, 0.0f};
}

inline typename Ops::V bytes(BlockQ4_1, const uint8_t* b, int) { return Ops::nibbles16(b + 4); }
inline SubScales scales(BlockQ4_1, const uint8_t* b, int) {
  const float d = Ops::half(load_u16(b));
  return {d, d, Ops::half(load_u16(b + 2))};
}

inline typename Ops::V bytes(BlockQ5_0, const uint8_t* b, int) {
  return Ops::or_bits(Ops::nibbles16(b + 6), load_u32(b + 2));
}
inline SubScales scales(BlockQ5_0, const uint8_t* b, int) {
  const float d = Ops::half(load_u16(b));
  return {d, d, 0.0f};
}

inline typename Ops::V bytes(BlockQ5_1, const uint8_t* b, int) {
  return Ops::or_bits(Ops::nibbles16(b + 8), load_u32(b + 4));
}
inline SubScales scales(BlockQ5_1, const uint8_t* b, int) {
  const float d = Ops::half(load_u16(b));
  return {d, d, Ops::half(load_u16(b + 2))};
}

// Q4_K / Q5_K: sub-block j holds the low (even j) or high (odd j) nibbles of 32 bytes of qs.
inline typename Ops::V bytes(BlockQ4_K, const uint8_t* b, int j) {
  return Ops::nibbles32(b + 16 + 32 * (j / 2), 4 * (j % 2));
}
inline SubScales scales(BlockQ4_K, const uint8_t* b, int j) {
  const KScaleMin sm = k_scale_min(b + 4, j);
  const float d = Ops::half(load_u16(b)) * sm.scale;
  return {d, d, -Ops::half(load_u16(b + 2)) * sm.min};
}

inline typename Ops::V bytes(BlockQ5_K, const uint8_t* b, int j) {
  return Ops::or_high(Ops::nibbles32(b + 48 + 32 * (j / 2), 4 * (j % 2)), b + 16, j, 1);
}
inline SubScales scales(BlockQ5_K, const uint8_t* b, int j) {
  const KScaleMin sm = k_scale_min(b + 4, j);
  const float d = Ops::half(load_u16(b)) * sm.scale;
  return {d, d, -Ops::half(load_u16(b + 2)) * sm.min};
}

// Q6_K: ql[128] qh[64] int8 scales[16] fp16 d. Sub-block j = 4h + g takes the low (g < 2) or
// high nibbles of ql[64h + 32 (g % 2) ...] and bits 2g, 2g+1 of qh[32h ...].
inline typename Ops::V bytes(BlockQ6_K, const uint8_t* b, int j) {
  const int h = j / 4, g = j % 4;
  return Ops::or_high(Ops::nibbles32(b + 64 * h + 32 * (g % 2), 4 * (g / 2)), b + 128 + 32 * h, 2 * g, 3);
}
inline SubScales scales(BlockQ6_K, const uint8_t* b, int j) {
  const float d = Ops::half(load_u16(b + 208));
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  return {d * sc[2 * j], d * sc[2 * j + 1], 0.0f};
}

// The integer offset subtracted from every element value (signed formats: the dot's bias).
template <class B>
constexpr int offset() {
  return B::kSigned ? Ops::kSignedBias : B::kOffset;
}

// ---------------------------------------------------------------- the GEMM

// R rows x C columns of out. Every (row, column) is the same chain whatever tile computes it,
// so a row's result never depends on the rest of the batch or on the thread count: 8 fp32
// lanes accumulate the scaled integer dot products over the sub-blocks of K in order and are
// summed, then the min / offset term is added as one dot product over the half-blocks
// (coefficients of the column, in `coef`, times the row's half-block sums).
template <class B, int R, int C>
void tile(const QuantizedActs& a, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t c0,
          const float* bias, float* out, int64_t ldo, float* coef) {
  constexpr int off = offset<B>();
  constexpr bool kTerm = off != 0 || B::kHasMin;
  const int64_t subs = k / 32, stride = a.half_stride;
  typename Ops::F acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = Ops::zero();
  const uint8_t* wc[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    wc[c] = w + (c0 + c) * row_bytes;
    if constexpr (kTerm) std::fill(coef + c * stride + 2 * subs, coef + (c + 1) * stride, 0.0f);
  }
  for (int64_t s = 0; s < subs; ++s) {
    const int64_t blk = s / B::kSubs;
    const int j = static_cast<int>(s % B::kSubs);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const uint8_t* block = wc[c] + blk * B::kBytes;
      const typename Ops::V u = bytes(B{}, block, j);
      const SubScales sc = scales(B{}, block, j);
      if constexpr (kTerm) {
        coef[c * stride + 2 * s] = sc.m - off * sc.d0;
        coef[c * stride + 2 * s + 1] = sc.m - off * sc.d1;
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int8_t* x = a.q + row * k + s * 32;
        const typename Ops::I l = B::kSigned ? Ops::dot_s(u, x) : Ops::dot_u(u, x);
        const float dx = a.d[row * subs + s];
        const typename Ops::F scale = B::kSplitScale ? Ops::splat2(dx * sc.d0, dx * sc.d1) : Ops::splat(dx * sc.d0);
        acc[r][c] = Ops::fma(l, scale, acc[r][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const int64_t col = c0 + c;
      float term = 0.0f;
      if constexpr (kTerm) {
        typename Ops::F t = Ops::zero();
        const float* hs = a.half_sums + (r0 + r) * stride;
        for (int64_t i = 0; i < stride; i += 8) t = Ops::fmaf(Ops::loadf(coef + c * stride + i), Ops::loadf(hs + i), t);
        term = Ops::sum(t);
      }
      out[(r0 + r) * ldo + col] = Ops::sum(acc[r][c]) + term + (bias != nullptr ? bias[col] : 0.0f);
    }
}

// Columns per tile for R rows: enough independent chains for one row, registers for more.
template <int R>
constexpr int cols_for_rows() {
  return R == 1 ? 4 : 2;
}

template <class B, int R>
void row_block(const QuantizedActs& a, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t cb,
               int64_t ce, const float* bias, float* out, int64_t ldo, float* coef) {
  constexpr int C = cols_for_rows<R>();
  int64_t c = cb;
  for (; c + C <= ce; c += C) tile<B, R, C>(a, k, w, row_bytes, r0, c, bias, out, ldo, coef);
  for (; c < ce; ++c) tile<B, R, 1>(a, k, w, row_bytes, r0, c, bias, out, ldo, coef);
}

constexpr int kMaxTileRows = 4;

// Columns [cb, ce) of out for all rows: one column group at a time (its weights stay in L1)
// against every row tile.
template <class B>
void columns(const QuantizedActs& a, int64_t m, int64_t k, const uint8_t* w, int64_t cb, int64_t ce,
             const float* bias, float* out, int64_t ldo) {
  const int64_t row_bytes = k / B::kElems * B::kBytes;
  constexpr int64_t kColChunk = 16;
  // The min / offset coefficients of the columns of one tile (at most 4), per half-block.
  thread_local std::vector<float> coef_buf;
  coef_buf.resize(4 * a.half_stride);
  float* coef = coef_buf.data();
  for (int64_t cc = cb; cc < ce; cc += kColChunk) {
    const int64_t cce = std::min(ce, cc + kColChunk);
    for (int64_t r = 0; r < m; r += kMaxTileRows) {
      switch (std::min<int64_t>(kMaxTileRows, m - r)) {
        case 1: row_block<B, 1>(a, k, w, row_bytes, r, cc, cce, bias, out, ldo, coef); break;
        case 2: row_block<B, 2>(a, k, w, row_bytes, r, cc, cce, bias, out, ldo, coef); break;
        case 3: row_block<B, 3>(a, k, w, row_bytes, r, cc, cce, bias, out, ldo, coef); break;
        default: row_block<B, 4>(a, k, w, row_bytes, r, cc, cce, bias, out, ldo, coef); break;
      }
    }
  }
}

// One segment (rows of one block type) of the weight, columns [cb, ce) of it.
inline void segment_columns(int type, const QuantizedActs& a, int64_t m, int64_t k, const uint8_t* w, int64_t cb,
                            int64_t ce, const float* bias, float* out, int64_t ldo) {
  switch (type) {
    case BlockQ8_0::kType: return columns<BlockQ8_0>(a, m, k, w, cb, ce, bias, out, ldo);
    case BlockQ4_0::kType: return columns<BlockQ4_0>(a, m, k, w, cb, ce, bias, out, ldo);
    case BlockQ4_1::kType: return columns<BlockQ4_1>(a, m, k, w, cb, ce, bias, out, ldo);
    case BlockQ5_0::kType: return columns<BlockQ5_0>(a, m, k, w, cb, ce, bias, out, ldo);
    case BlockQ5_1::kType: return columns<BlockQ5_1>(a, m, k, w, cb, ce, bias, out, ldo);
    case BlockQ4_K::kType: return columns<BlockQ4_K>(a, m, k, w, cb, ce, bias, out, ldo);
    case BlockQ5_K::kType: return columns<BlockQ5_K>(a, m, k, w, cb, ce, bias, out, ldo);
    case BlockQ6_K::kType: return columns<BlockQ6_K>(a, m, k, w, cb, ce, bias, out, ldo);
    default: PD_THROW("fd_gguf_linear: no kernel for ggml type " + std::to_string(type) + ".");
  }
}

// Element values of row `w` (k elements of block type B) as fp32.
template <class B>
void dequantize_row(const uint8_t* w, int64_t k, float* out) {
  for (int64_t s = 0; s < k / 32; ++s) {
    const uint8_t* block = w + s / B::kSubs * B::kBytes;
    const int j = static_cast<int>(s % B::kSubs);
    alignas(32) uint8_t u[32];
    Ops::store(bytes(B{}, block, j), u);
    const SubScales sc = scales(B{}, block, j);
    for (int i = 0; i < 32; ++i) {
      const int q = B::kSigned ? static_cast<int8_t>(u[i]) : static_cast<int>(u[i]) - B::kOffset;
      out[s * 32 + i] = (i < 16 ? sc.d0 : sc.d1) * static_cast<float>(q) + sc.m;
    }
  }
}
