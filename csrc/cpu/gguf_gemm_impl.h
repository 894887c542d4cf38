// The GGUF block kernel, written once over an instruction-set policy `Ops`; gguf_gemm.cc
// includes this file once per path, each time inside its own namespace and (for the SIMD
// paths) inside a `#pragma GCC target` region, so every function here is compiled for that
// path's instructions whatever -march the library is built with. No include guard on purpose.
//
// The weights are in the packed layout of gguf_gemm.cc (tiles of kTileCols columns, per
// 32-element sub-block the columns' quants in 4-byte groups, then the scale vectors), which
// the kernel streams linearly. A path works on kLanes columns at once (a register of fp32
// lanes): the VNNI path on a whole 16-column tile, AVX2 and scalar on its two halves.
//
// `Ops` (defined by the includer) provides:
//   T  the 8 groups of a sub-block (group g: bytes 4g..4g+3 of every column, column c in lane c)
//   I  kLanes x int32; F  kLanes x fp32
//   load_tile<nibble, signed>(q, h)  the groups of half h of the packed quants q
//   dot<signed, max_u>(t, x, lo, hi)  lane c: sum of u_c[i] * x[i] over i < 16 (lo) and 16 <= i < 32
//                         (hi), u unsigned (<= max_u < 64) or signed bytes (|u| <= max_u); signed ones
//                         plus kSignedBias * sum(x)
//   dot_all<signed, max_u>(t, x)  lo + hi in one chain (formats with one scale per sub-block)
//   loadh(p) fp16 -> fp32 lanes, loadf(p), storef(v, p), zero(), splat(s), add(a, b), mul(a, b),
//   add_i(a, b), fma(l, s, acc) = acc + float(l) * s, fmaf(a, b, acc) = acc + a * b

// The integer offset subtracted from every element value (signed formats: the dot's bias).
template <class B>
constexpr int offset() {
  return B::kSigned ? Ops::kSignedBias : B::kOffset;
}

// Scale vector `which` (0: d0, 1: d1 or m, 2: m) of half h of a packed sub-block.
template <class B>
inline typename Ops::F load_scale(const uint8_t* sub, int which, int h) {
  const uint8_t* p = sub + packed_quant_bytes<B>() + (which * kTileCols + h * Ops::kLanes) * packed_scale_size<B>();
  if constexpr (B::kHalfScales) {
    return Ops::loadh(reinterpret_cast<const uint16_t*>(p));
  } else {
    return Ops::loadf(reinterpret_cast<const float*>(p));
  }
}

// R rows x kLanes columns of out (half h of one packed tile `tw`), each column in its own lane.
// Per sub-block one instruction per 4 elements gives all columns' integer dot products with a
// row; then per row
//     acc = fma(float(dot), dx * dw, acc)     (and, for Q6_K, once per half-block)
//     acc_t = fma(dx * sum(q), mw - offset * dw, acc_t)     (formats with a min or an offset)
// in the order of K, and out = (acc + acc_t) + bias. Every (row, column) is this chain
// whatever tile computes it, so a row's result never depends on the rest of the batch or on
// the thread count. Columns from `ncols` on are padding and are not stored.
// How far ahead of the sub-block being multiplied its weights' lines are asked for, when they do.
constexpr int64_t kPrefetchBytes = 8192;
// Batches of up to kPrefetchMaxRows rows prefetch their weights (see tile); one row included: from
// memory it streamed 13% (VNNI) to 21% (AVX2) faster with them (30 layers of Q4_1 weights, AVX512
// EPYC). Larger batches spend their time on rows of weights already in L1.
constexpr int64_t kPrefetchMaxRows = 32;

template <class B, int R>
void tile(const QuantizedActs& a, int64_t k, const uint8_t* tw, int h, int64_t r0, int64_t c0, int64_t ncols,
          const float* bias, float* out, int64_t ldo, bool prefetch) {
  constexpr int off = offset<B>();
  constexpr bool kTerm = off != 0 || B::kHasMin;
  const int64_t subs = k / 32, stride = a.half_stride;
  typename Ops::F acc[R], acc_t[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = acc_t[r] = Ops::zero();
  for (int64_t s = 0; s < subs; ++s) {
    const uint8_t* sub = tw + s * packed_sub_bytes<B>();
    // The weights stream from memory in 4 KB pages and the hardware prefetcher stops at each page's
    // end: with a few rows per sub-block the kernel then waits on each new page's first lines
    // (2x at 4-6 rows, measured). Asking L2 for the lines kPrefetchBytes ahead crosses the pages.
    if (prefetch) {
      for (int64_t line = 0; line < packed_sub_bytes<B>(); line += 64) __builtin_prefetch(sub + kPrefetchBytes + line, 0, 2);
    }
    const typename Ops::T t = Ops::template load_tile<B::kNibble, B::kSigned>(sub, h);
    // Only what the format uses is loaded.
    const typename Ops::F d0v = load_scale<B>(sub, 0, h);
    const typename Ops::F d1v = B::kSplitScale ? load_scale<B>(sub, 1, h) : d0v;
    typename Ops::F cf0v = Ops::zero(), cf1v = Ops::zero();
    if constexpr (kTerm) {
      const typename Ops::F mv = B::kHasMin ? load_scale<B>(sub, B::kSplitScale ? 2 : 1, h) : Ops::zero();
      cf0v = Ops::fmaf(Ops::splat(static_cast<float>(-off)), d0v, mv);
      cf1v = B::kSplitScale ? Ops::fmaf(Ops::splat(static_cast<float>(-off)), d1v, mv) : cf0v;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int8_t* x = a.q + row * k + s * 32;
      const typename Ops::F dx = Ops::splat(a.d[row * subs + s]);
      if constexpr (B::kSplitScale || R > 2) {
        // Two chains of dot instructions: with many rows in flight one chain of 8 is latency-bound.
        typename Ops::I lo, hi;
        Ops::template dot<B::kSigned, B::kMaxU>(t, x, lo, hi);
        if constexpr (B::kSplitScale) {
          acc[r] = Ops::fma(lo, Ops::mul(dx, d0v), acc[r]);
          acc[r] = Ops::fma(hi, Ops::mul(dx, d1v), acc[r]);
        } else {
          acc[r] = Ops::fma(Ops::add_i(lo, hi), Ops::mul(dx, d0v), acc[r]);
        }
      } else {  // the same integer sum in one chain, one instruction fewer (decode's few rows)
        acc[r] = Ops::fma(Ops::template dot_all<B::kSigned, B::kMaxU>(t, x), Ops::mul(dx, d0v), acc[r]);
      }
      if constexpr (kTerm) {
        if constexpr (B::kSplitScale) {
          const float* hs = a.half_sums + row * stride + 2 * s;
          acc_t[r] = Ops::fmaf(Ops::splat(hs[0]), cf0v, acc_t[r]);
          acc_t[r] = Ops::fmaf(Ops::splat(hs[1]), cf1v, acc_t[r]);
        } else {
          acc_t[r] = Ops::fmaf(Ops::splat(a.block_sums[row * subs + s]), cf0v, acc_t[r]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    alignas(64) float v[Ops::kLanes];
    Ops::storef(Ops::add(acc[r], acc_t[r]), v);
    float* dst = out + (r0 + r) * ldo + c0;
    for (int c = 0; c < ncols; ++c) dst[c] = v[c] + (bias != nullptr ? bias[c0 + c] : 0.0f);
  }
}

// `rows` (1 .. R) rows of one half tile.
template <class B, int R>
void tile_rows(int rows, const QuantizedActs& a, int64_t k, const uint8_t* tw, int h, int64_t r0, int64_t c0,
               int64_t ncols, const float* bias, float* out, int64_t ldo, bool prefetch) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<B, R - 1>(rows, a, k, tw, h, r0, c0, ncols, bias, out, ldo, prefetch);
  }
  tile<B, R>(a, k, tw, h, r0, c0, ncols, bias, out, ldo, prefetch);
}

// Tiles [tb, te) of a segment of `n` columns, for all rows: a chunk of tiles (its weights stay
// in L1) against every row tile, then the next chunk.
template <class B>
void tiles(const QuantizedActs& a, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t tb, int64_t te,
           const float* bias, float* out, int64_t ldo) {
  const int64_t tile_bytes = k / 32 * packed_sub_bytes<B>();
  const int64_t chunk = std::max<int64_t>(1, (24 << 10) / tile_bytes);
  for (int64_t tc = tb; tc < te; tc += chunk) {
    const int64_t tce = std::min(te, tc + chunk);
    for (int64_t r = 0; r < m; r += Ops::kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(Ops::kRows, m - r));
      // Only the first row tile reads the chunk from memory; the others find it in L1.
      const bool prefetch = r == 0 && m <= kPrefetchMaxRows;
      for (int64_t t = tc; t < tce; ++t) {
        for (int h = 0; h < kTileCols / Ops::kLanes; ++h) {
          const int64_t c0 = t * kTileCols + h * Ops::kLanes;
          if (c0 >= n) break;
          tile_rows<B, Ops::kRows>(rows, a, k, w + t * tile_bytes, h, r, c0, std::min<int64_t>(Ops::kLanes, n - c0),
                                   bias, out, ldo, prefetch);
        }
      }
    }
  }
}

// One segment (columns of one block type) of the packed weight, tiles [tb, te) of it.
inline void segment_tiles(int type, const QuantizedActs& a, int64_t m, int64_t k, const uint8_t* w, int64_t n,
                          int64_t tb, int64_t te, const float* bias, float* out, int64_t ldo) {
  switch (type) {
    case BlockQ8_0::kType: return tiles<BlockQ8_0>(a, m, k, w, n, tb, te, bias, out, ldo);
    case BlockQ4_0::kType: return tiles<BlockQ4_0>(a, m, k, w, n, tb, te, bias, out, ldo);
    case BlockQ4_1::kType: return tiles<BlockQ4_1>(a, m, k, w, n, tb, te, bias, out, ldo);
    case BlockQ5_0::kType: return tiles<BlockQ5_0>(a, m, k, w, n, tb, te, bias, out, ldo);
    case BlockQ5_1::kType: return tiles<BlockQ5_1>(a, m, k, w, n, tb, te, bias, out, ldo);
    case BlockQ4_K::kType: return tiles<BlockQ4_K>(a, m, k, w, n, tb, te, bias, out, ldo);
    case BlockQ5_K::kType: return tiles<BlockQ5_K>(a, m, k, w, n, tb, te, bias, out, ldo);
    case BlockQ6_K::kType: return tiles<BlockQ6_K>(a, m, k, w, n, tb, te, bias, out, ldo);
    default: PD_THROW("fd_gguf_linear: no kernel for ggml type " + std::to_string(type) + ".");
  }
}
