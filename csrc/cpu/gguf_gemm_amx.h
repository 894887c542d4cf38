// The GGUF block kernel's rows on AMX tiles (AMX-INT8), included inside gguf_gemm.cc's VNNI
// namespace after gguf_gemm_impl.h, in a region compiled for AMX-INT8 as well.
//
// The packed layout already is a B tile: a sub-block's group g (elements 4g..4g+3 of 16
// columns, 4 bytes each) is one 64-byte tile row, so a 32-element sub-block is 8 rows (two 4-row
// halves for the formats with a scale per 16 elements) once the nibbles are split and signed
// weights offset by 128, as the VNNI path's registers hold them. `tdpbsud` multiplies 16
// activation rows (signed int8) by such a tile (unsigned) in one instruction: the same int32 sums
// as the VNNI path's `vpdpbusd` chains, exactly (integer additions, no saturation). The fp32 steps
// after them are the VNNI path's, in its order (per row acc = fma(float(sum), dx * dw, acc) per
// scale unit in the order of K, the offset and min terms as their own chain, then acc + acc_t +
// bias), so a row's result has the same bits on either path: 16-row tiles go to AMX (a part-filled
// last one with zero rows, see amx_rows) and the rest of the rows to the VNNI tiles, and no row
// depends on which.
//
// Tiles: tmm0 / tmm1 activations, tmm2 / tmm3 weights, tmm4..7 sums, used in turn so that the
// next units' multiplies run while one unit's sums are stored and another's scaled.

namespace amx {

constexpr int kTileRows = 16;
// A part-filled last tile of at least kPadRows rows runs on AMX too, its missing rows zeros. A
// decode step's rows are one call's: up to 12 the VNNI tiles are faster, at 13 level, from 14 AMX
// is faster (`benchmarks/benchmark_gguf_rows.py`, Sapphire Rapids, one thread, the default model's
// 30 layers of Q4_1, 66 MB streamed past L2 as a step streams them, + its Q8_0 LM head, ms VNNI /
// AMX: 12 rows 14.1 + 2.2 either way, 13 15.2 + 2.5 / 14.9 + 2.7, 14 15.4 + 2.7 / 14.4 + 2.8, 16
// 16.5 + 2.8 / 14.8 + 2.8, 48 36.9 + 9.9 / 27.8 + 7.3; results/gguf_rows_spr_2026-12-06.json). A
// tail of 8 beside whole tiles was slower padded than on VNNI (24 rows: 23.3 + 5.3 vs 21.9 + 4.9,
// results/gguf_rows_pad8_spr_2026-12-06.json).
constexpr int64_t kPadRows = 13;

// The rows of a call of m rows multiplied on AMX (0: none, the call runs on the VNNI tiles).
inline int64_t amx_rows(int64_t m) {
  const int64_t tail = m % kTileRows;
  return m - tail + (tail >= kPadRows ? kTileRows : 0);
}

constexpr int64_t kSubDecoded = 512;  // a sub-block's quants as 8 tile rows of 64 bytes

// Elements one weight scale covers: what one tile multiply sums.
template <class B>
constexpr int unit_elems() {
  return B::kSplitScale ? 16 : 32;
}

template <class B>
void configure() {
  constexpr int kUnit = unit_elems<B>();
  TileConfig cfg;
  for (int t = 0; t < 2; ++t) {
    cfg.colsb[t] = kUnit;  // 16 rows of a unit's activations
    cfg.rows[t] = kTileRows;
    cfg.colsb[2 + t] = 64;  // the unit's groups of 4 elements x 16 columns
    cfg.rows[2 + t] = kUnit / 4;
  }
  for (int t = 4; t < 8; ++t) {
    cfg.colsb[t] = 64;  // 16 rows x 16 columns of int32
    cfg.rows[t] = kTileRows;
  }
  _tile_loadconfig(&cfg);
}

// Tile `tw`'s sub-blocks decoded into tile rows at dst (subs x kSubDecoded bytes).
template <class B>
void decode_tile(const uint8_t* tw, int64_t subs, uint8_t* dst) {
  for (int64_t s = 0; s < subs; ++s) {
    const uint8_t* sub = tw + s * packed_sub_bytes<B>();
    // The weights stream from memory once: ask for them ahead, across pages (as the VNNI tiles do).
    for (int64_t line = 0; line < packed_sub_bytes<B>(); line += 64) __builtin_prefetch(sub + kPrefetchBytes + line, 0, 2);
    const typename Ops::T t = Ops::template load_tile<B::kNibble, B::kSigned>(sub, 0);
    for (int g = 0; g < 8; ++g) _mm512_storeu_si512(dst + s * kSubDecoded + g * 64, t.g[g]);
  }
}

// A 16-row tile's activation scales and offset-term sums, transposed so that one pointer and
// constant offsets reach every row's: dx [subs][16], and the term's sums [terms][16] (block sums,
// or for split-scale formats half-block sums, 2 per sub-block).
struct RowTileActs {
  const int8_t* q;
  const float* dx;
  const float* term;
};

template <class B>
constexpr int terms_per_sub() {
  return B::kSplitScale ? 2 : 1;
}

// Rows [r0, r0 + 16) of the activations as a RowTileActs in buf (subs * (1 + terms_per_sub) * 16 floats).
template <class B>
RowTileActs transpose_row_tile(const QuantizedActs& a, int64_t k, int64_t r0, float* buf) {
  const int64_t subs = k / 32, terms = subs * terms_per_sub<B>();
  float* dx = buf;
  float* term = buf + subs * kTileRows;
  for (int r = 0; r < kTileRows; ++r) {
    for (int64_t s = 0; s < subs; ++s) dx[s * kTileRows + r] = a.d[(r0 + r) * subs + s];
    for (int64_t t = 0; t < terms; ++t) {
      term[t * kTileRows + r] = B::kSplitScale ? a.half_sums[(r0 + r) * a.half_stride + t] : a.block_sums[(r0 + r) * subs + t];
    }
  }
  return {a.q + r0 * k, dx, term};
}

// Rows [r0, r0 + 16) (prepared in `ra`) x the 16 columns of tile `tw` (decoded in `dec`).
template <class B>
void row_tile(const RowTileActs& ra, int64_t k, const uint8_t* tw, const uint8_t* dec, int64_t r0, int64_t valid,
              int64_t c0, int64_t ncols, const float* bias, float* out, int64_t ldo) {
  constexpr int off = offset<B>();
  constexpr bool kTerm = off != 0 || B::kHasMin;
  constexpr int kUnit = unit_elems<B>(), kUnits = 32 / kUnit;
  const int64_t subs = k / 32, units = subs * kUnits;
  const int8_t* x = ra.q;
  alignas(64) int32_t sums[2][kTileRows][16];
// Unit u's multiply from activation tile `at` and weight tile `wt` into sums tile `st`: a macro,
// as the tile instructions take their register numbers as literal immediates.
#define FD_GGUF_AMX_UNIT(at, wt, st, u)                                                                 \
  do {                                                                                                  \
    _tile_zero(st);                                                                                     \
    _tile_loadd(at, x + (u) * kUnit, k);                                                                \
    _tile_loadd(wt, dec + (u) / kUnits * kSubDecoded + (u) % kUnits * (kUnit / 4) * 64, 64);           \
    _tile_dpbsud(st, at, wt);                                                                           \
  } while (0)
  typename Ops::F acc[kTileRows];
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) acc[r] = Ops::zero();
  // Two units multiply ahead of the one whose sums are stored, and the sums scaled are the unit
  // before that: a tile store waits for its multiply, and a vector load of a tile store's bytes
  // for the store to reach the cache; either right after the other stalled every unit (~3x).
  // Units u and u + 2 share their activation and weight tiles, u and u + 4 their sums tile.
  FD_GGUF_AMX_UNIT(0, 2, 4, 0);
  if (units > 1) FD_GGUF_AMX_UNIT(1, 3, 5, 1);
  for (int64_t u = 0; u <= units; ++u) {
    if (u < units) {
      const bool next = u + 2 < units;
      switch (u & 3) {
        case 0:
          _tile_stored(4, sums[0], 64);
          if (next) FD_GGUF_AMX_UNIT(0, 2, 6, u + 2);
          break;
        case 1:
          _tile_stored(5, sums[1], 64);
          if (next) FD_GGUF_AMX_UNIT(1, 3, 7, u + 2);
          break;
        case 2:
          _tile_stored(6, sums[0], 64);
          if (next) FD_GGUF_AMX_UNIT(0, 2, 4, u + 2);
          break;
        default:
          _tile_stored(7, sums[1], 64);
          if (next) FD_GGUF_AMX_UNIT(1, 3, 5, u + 2);
          break;
      }
    }
    if (u == 0) continue;
    const int64_t v = u - 1, s = v / kUnits;  // unit v's sums, stored one step ago, scaled into acc
    const typename Ops::F dv = load_scale<B>(tw + s * packed_sub_bytes<B>(), static_cast<int>(v % kUnits), 0);
    const int32_t(*sv)[16] = sums[v & 1];
    const float* dx = ra.dx + s * kTileRows;
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      acc[r] = Ops::fma(_mm512_load_si512(sv[r]), Ops::mul(Ops::splat(dx[r]), dv), acc[r]);
    }
  }
#undef FD_GGUF_AMX_UNIT
  // The offset and min terms: their own chain, as in the VNNI tile.
  alignas(64) float total[kTileRows][16];
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) Ops::storef(acc[r], total[r]);
  if constexpr (kTerm) {
    typename Ops::F acc_t[kTileRows];
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) acc_t[r] = Ops::zero();
    for (int64_t s = 0; s < subs; ++s) {
      const uint8_t* sub = tw + s * packed_sub_bytes<B>();
      const typename Ops::F d0v = load_scale<B>(sub, 0, 0);
      const typename Ops::F mv = B::kHasMin ? load_scale<B>(sub, B::kSplitScale ? 2 : 1, 0) : Ops::zero();
      const typename Ops::F cf0v = Ops::fmaf(Ops::splat(static_cast<float>(-off)), d0v, mv);
      if constexpr (B::kSplitScale) {
        const typename Ops::F cf1v = Ops::fmaf(Ops::splat(static_cast<float>(-off)), load_scale<B>(sub, 1, 0), mv);
        const float* hs = ra.term + 2 * s * kTileRows;
#pragma GCC unroll 16
        for (int r = 0; r < kTileRows; ++r) {
          acc_t[r] = Ops::fmaf(Ops::splat(hs[r]), cf0v, acc_t[r]);
          acc_t[r] = Ops::fmaf(Ops::splat(hs[kTileRows + r]), cf1v, acc_t[r]);
        }
      } else {
        const float* bs = ra.term + s * kTileRows;
#pragma GCC unroll 16
        for (int r = 0; r < kTileRows; ++r) acc_t[r] = Ops::fmaf(Ops::splat(bs[r]), cf0v, acc_t[r]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) Ops::storef(Ops::add(Ops::loadf(total[r]), acc_t[r]), total[r]);
  }
  // + bias (or + 0, as the VNNI tile adds), the columns past ncols masked off.
  const __mmask16 cols = static_cast<__mmask16>((1u << ncols) - 1);
  const typename Ops::F b = bias != nullptr ? _mm512_maskz_loadu_ps(cols, bias + c0) : Ops::zero();
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    if (r < valid) _mm512_mask_storeu_ps(out + (r0 + r) * ldo + c0, cols, Ops::add(Ops::loadf(total[r]), b));
  }
}

// Tiles [tb, te) of a segment for all rows: each tile decoded once, then every 16-row tile of
// amx_rows(m) against it on AMX (the activation buffers hold that many rows, zeros past m; only
// rows below m are stored) and the remaining rows on the VNNI tiles. (Chunks of 2-5 tiles decoded
// together, so that a row tile's activations are reused across them in L1, measured no faster.)
template <class B>
void tiles(const QuantizedActs& a, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t tb, int64_t te,
           const float* bias, float* out, int64_t ldo) {
  const int64_t subs = k / 32, tile_bytes = subs * packed_sub_bytes<B>();
  const int64_t m_amx = amx_rows(m), num_row_tiles = m_amx / kTileRows;
  thread_local std::vector<uint8_t> decoded;
  if (static_cast<int64_t>(decoded.size()) < subs * kSubDecoded) decoded.resize(subs * kSubDecoded);
  // Every row tile's scales and sums transposed once per call (per tile they took a sixth of the time).
  thread_local std::vector<float> transposed;
  thread_local std::vector<RowTileActs> row_tiles;
  const int64_t per_tile = subs * (1 + terms_per_sub<B>()) * kTileRows;
  if (static_cast<int64_t>(transposed.size()) < num_row_tiles * per_tile) transposed.resize(num_row_tiles * per_tile);
  row_tiles.resize(num_row_tiles);
  for (int64_t i = 0; i < num_row_tiles; ++i) {
    row_tiles[i] = transpose_row_tile<B>(a, k, i * kTileRows, transposed.data() + i * per_tile);
  }
  configure<B>();
  for (int64_t t = tb; t < te; ++t) {
    const uint8_t* tw = w + t * tile_bytes;
    const int64_t c0 = t * kTileCols, ncols = std::min<int64_t>(kTileCols, n - c0);
    decode_tile<B>(tw, subs, decoded.data());
    for (int64_t i = 0; i < num_row_tiles; ++i) {
      row_tile<B>(row_tiles[i], k, tw, decoded.data(), i * kTileRows, std::min<int64_t>(kTileRows, m - i * kTileRows),
                  c0, ncols, bias, out, ldo);
    }
    for (int64_t r = m_amx; r < m; r += Ops::kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(Ops::kRows, m - r));
      tile_rows<B, Ops::kRows>(rows, a, k, tw, 0, r, c0, ncols, bias, out, ldo, false);
    }
  }
  _tile_release();
}

inline void segment_tiles(int type, const QuantizedActs& a, int64_t m, int64_t k, const uint8_t* w, int64_t n,
                          int64_t tb, int64_t te, const float* bias, float* out, int64_t ldo) {
  if (!with_block(type, [&](auto b) { tiles<decltype(b)>(a, m, k, w, n, tb, te, bias, out, ldo); })) {
    PD_THROW("fd_gguf_linear: no kernel for ggml type " + std::to_string(type) + ".");
  }
}

}  // namespace amx
