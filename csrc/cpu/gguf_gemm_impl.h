// The GGUF block kernel, written once over an instruction-set policy `Ops`; gguf_gemm.cc
// includes this file once per path, each time inside its own namespace and (for the SIMD
// paths) inside a `#pragma GCC target` region, so every function here is compiled for that
// path's instructions whatever -march the library is built with. No include guard on purpose.
//
// `Ops` (defined by the includer) provides, for 32-element sub-blocks:
//   V  32 weight bytes; T  the sub-blocks of 8 columns transposed; I  8 x int32; F  8 x fp32
//   nibbles16(p)          [p[i] & 15 for i < 16] then [p[i] >> 4 for i < 16]
//   nibbles32(p, shift)   (p[i] >> shift) & 15 for i < 32
//   or_bits(v, bits)      v[i] |= 16 where bit i of `bits` is set
//   or_high(v, p, shift, mask)  v[i] |= ((p[i] >> shift) & mask) << 4
//   load(p), store(v, p)  32 raw bytes
//   transpose<signed>(u[8])  the 8 columns' bytes arranged for dot
//   dot<signed>(t, x, lo, hi)  lane c: sum of u_c[i] * x[i] over i < 16 (lo) and 16 <= i < 32 (hi),
//                         u unsigned (< 64) or signed bytes; signed ones plus kSignedBias * sum(x)
//   zero(), splat(s), loadf(p), storef(v, p), add(a, b), mul(a, b), add_i(a, b)
//   fma(l, s, acc) = acc + float(l) * s, fmaf(a, b, acc) = acc + a * b
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

constexpr int kCols = 8;  // columns per tile: one per lane

// R rows x 8 columns of out, each column in its own lane. Per sub-block, the 8 columns' bytes
// are unpacked once and transposed (Ops::transpose) so that one instruction per 4 elements
// gives all 8 columns' integer dot products with a row; then per row
//     acc = fma(float(dot), dx * dw, acc)     (and, for Q6_K, once per half-block)
//     acc_t = fma(dx * sum(q), mw - offset * dw, acc_t)     (formats with a min or an offset)
// in the order of K, and out = (acc + acc_t) + bias. Every (row, column) is this chain
// whatever tile computes it, so a row's result never depends on the rest of the batch or on
// the thread count. Columns past `ncols` repeat the last one and are not stored.
template <class B, int R>
void tile(const QuantizedActs& a, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t c0,
          int64_t ncols, const float* bias, float* out, int64_t ldo) {
  constexpr int off = offset<B>();
  constexpr bool kTerm = off != 0 || B::kHasMin;
  const int64_t subs = k / 32, stride = a.half_stride;
  typename Ops::F acc[R], acc_t[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = acc_t[r] = Ops::zero();
  const uint8_t* wc[kCols];
  for (int c = 0; c < kCols; ++c) wc[c] = w + (c0 + std::min<int64_t>(c, ncols - 1)) * row_bytes;
  for (int64_t s = 0; s < subs; ++s) {
    const int64_t blk = s / B::kSubs;
    const int j = static_cast<int>(s % B::kSubs);
    typename Ops::V u[kCols];
    alignas(32) float d0[kCols], d1[kCols], cf0[kCols], cf1[kCols];
#pragma GCC unroll 8
    for (int c = 0; c < kCols; ++c) {
      const uint8_t* block = wc[c] + blk * B::kBytes;
      u[c] = bytes(B{}, block, j);
      const SubScales sc = scales(B{}, block, j);
      d0[c] = sc.d0;
      if constexpr (B::kSplitScale) d1[c] = sc.d1;
      if constexpr (kTerm) cf0[c] = sc.m - off * sc.d0;
      if constexpr (kTerm && B::kSplitScale) cf1[c] = sc.m - off * sc.d1;
    }
    const typename Ops::T t = Ops::template transpose<B::kSigned>(u);
    // Only what the format uses is filled and loaded.
    const typename Ops::F d0v = Ops::loadf(d0);
    const typename Ops::F d1v = B::kSplitScale ? Ops::loadf(d1) : d0v;
    const typename Ops::F cf0v = kTerm ? Ops::loadf(cf0) : Ops::zero();
    const typename Ops::F cf1v = kTerm && B::kSplitScale ? Ops::loadf(cf1) : cf0v;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      typename Ops::I lo, hi;
      Ops::template dot<B::kSigned>(t, a.q + row * k + s * 32, lo, hi);
      const typename Ops::F dx = Ops::splat(a.d[row * subs + s]);
      if constexpr (B::kSplitScale) {
        acc[r] = Ops::fma(lo, Ops::mul(dx, d0v), acc[r]);
        acc[r] = Ops::fma(hi, Ops::mul(dx, d1v), acc[r]);
      } else {
        acc[r] = Ops::fma(Ops::add_i(lo, hi), Ops::mul(dx, d0v), acc[r]);
      }
      if constexpr (kTerm) {
        const float* hs = a.half_sums + row * stride + 2 * s;
        if constexpr (B::kSplitScale) {
          acc_t[r] = Ops::fmaf(Ops::splat(hs[0]), cf0v, acc_t[r]);
          acc_t[r] = Ops::fmaf(Ops::splat(hs[1]), cf1v, acc_t[r]);
        } else {
          acc_t[r] = Ops::fmaf(Ops::splat(hs[0] + hs[1]), cf0v, acc_t[r]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    alignas(32) float v[kCols];
    Ops::storef(Ops::add(acc[r], acc_t[r]), v);
    float* dst = out + (r0 + r) * ldo + c0;
    for (int c = 0; c < ncols; ++c) dst[c] = v[c] + (bias != nullptr ? bias[c0 + c] : 0.0f);
  }
}

// `rows` (1 .. R) rows of one 8-column tile.
template <class B, int R>
void tile_rows(int rows, const QuantizedActs& a, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t r0,
               int64_t c0, int64_t ncols, const float* bias, float* out, int64_t ldo) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<B, R - 1>(rows, a, k, w, row_bytes, r0, c0, ncols, bias, out, ldo);
  }
  tile<B, R>(a, k, w, row_bytes, r0, c0, ncols, bias, out, ldo);
}

// Columns [cb, ce) of out for all rows: a chunk of columns (its weights stay in L1) against
// every row tile, then the next chunk.
template <class B>
void columns(const QuantizedActs& a, int64_t m, int64_t k, const uint8_t* w, int64_t cb, int64_t ce,
             const float* bias, float* out, int64_t ldo) {
  const int64_t row_bytes = k / B::kElems * B::kBytes;
  constexpr int64_t kColChunk = 4 * kCols;
  for (int64_t cc = cb; cc < ce; cc += kColChunk) {
    const int64_t cce = std::min(ce, cc + kColChunk);
    for (int64_t r = 0; r < m; r += Ops::kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(Ops::kRows, m - r));
      for (int64_t c = cc; c < cce; c += kCols) {
        tile_rows<B, Ops::kRows>(rows, a, k, w, row_bytes, r, c, std::min<int64_t>(kCols, cce - c), bias, out, ldo);
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
