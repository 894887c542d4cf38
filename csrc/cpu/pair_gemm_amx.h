// pair_gemm_impl.h's GEMM on AMX tiles (AMX-BF16): the same weights decoded to the same bf16
// pairs, which are exactly a B tile's rows (one k pair of 16 columns is 64 bytes), multiplied
// with `tdpbf16ps`, 16 rows x 16 columns x 16 k pairs per instruction, eight times the bf16
// dot products of AVX-512 registers per cycle. Included after pair_gemm_impl.h inside a namespace
// compiled for AVX512-BF16 and AMX-BF16 whose Ops are pair_gemm_bf16.h's.
//
// Every (row, column) is the same sequence of tile multiplies (16 k pairs each, in the order of
// K; a group's sum starts at zero), the same scale step per group and the same epilogue whichever
// rows share its tile, however many row tiles the call has and whether its panel was decoded into
// the buffer or block by block: a row's result never depends on the rest of the batch or on the
// thread count. The bits differ from the AVX-512 bf16 path's (another order of additions), so a
// layer runs one path throughout.
//
// Tiles: tmm0..3 the sums of one row tile x panel 0 / 1 x the even / odd blocks of K, tmm4 / tmm5
// the activations of an even / odd block, tmm6 / tmm7 the weights of panels 0 / 1.

namespace amx {

constexpr int64_t kBlockPairs = 16;  // k pairs per tile multiply: a B tile's 16 rows
constexpr int kTileRows = 16;

// Whether a layer's groups span whole tile multiplies: one group (its end is padded with zeros),
// or groups of a multiple of 16 k pairs.
inline bool fits(int64_t groups, int64_t group_pairs) { return groups == 1 || group_pairs % kBlockPairs == 0; }

// The activations' row stride in k pairs: whole blocks, zeros past K.
inline int64_t padded_pairs(int64_t kh) { return (kh + kBlockPairs - 1) / kBlockPairs * kBlockPairs; }

// The rows the prepared activations hold: a call of more than one tile reads whole tiles.
inline int64_t padded_rows(int64_t m) { return m <= kTileRows ? m : (m + kTileRows - 1) / kTileRows * kTileRows; }

// The call's activations rounded to bf16 pairs into xb, padded for the tiles on AMX (`amx`);
// returns their row stride in pairs.
inline int64_t prepare_pairs(const float* x, int64_t m, int64_t k, bool amx, std::vector<uint32_t>& xb) {
  const int64_t kh = (k + 1) / 2, ldx = amx ? padded_pairs(kh) : kh;
  bf16_pairs(x, m, k, xb, ldx, amx ? padded_rows(m) : m);
  return ldx;
}

// Row tiles of `rows` rows (a call of 16 rows or fewer configures just its rows: a decode step's
// multiplies then cost its rows only).
inline void configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t >= 6 ? kBlockPairs : rows);
  }
  _tile_loadconfig(&cfg);
}

// Pairs [j0, j0 + 16) of `panel` decoded into dst (zeros past K).
inline void decode_block(const Ops& ops, const Args& a, int64_t panel, int64_t j0, W* dst) {
  const uint8_t* wp = a.w + panel * panel_bytes(a.kh);
  if (j0 + kBlockPairs <= a.kh) {  // a whole block: no test per pair
    for (int64_t line = 0; line < kBlockPairs * kPairBytes; line += 64)
      __builtin_prefetch(wp + j0 * kPairBytes + line + kPrefetchBytes, 0, 2);
#pragma GCC unroll 16
    for (int64_t i = 0; i < kBlockPairs; ++i) dst[i] = decode_pair(ops, wp, j0 + i);
    return;
  }
  for (int64_t i = 0; i < kBlockPairs; ++i) {
    if (j0 + i < a.kh) {
      dst[i] = decode_pair(ops, wp, j0 + i);
    } else {
      dst[i].v = _mm512_setzero_si512();
    }
  }
}

// One call's scratch, per thread: one group's tile sums (panel, even / odd blocks) and the
// running totals of one row tile x 2 panels.
struct Scratch {
  alignas(64) float sums[2][2][kTileRows][kPanel];
  alignas(64) float total[2][kTileRows][kPanel];
};

// Folds group g's tile sums (even + odd blocks) into the totals of the valid rows [r0, r0 + rows)
// of `count` panels.
inline void fold_group(const Args& a, Scratch& s, int count, int64_t r0, int rows, int64_t panel, int64_t g) {
  for (int q = 0; q < count; ++q) {
    const F sc = Ops::load(a.scales + ((panel + q) * a.groups + g) * kPanel);
    const F mn = a.mins != nullptr ? Ops::load(a.mins + ((panel + q) * a.groups + g) * kPanel) : Ops::zero();
    for (int r = 0; r < rows; ++r) {
      const F sum = _mm512_add_ps(Ops::load(s.sums[q][0][r]), Ops::load(s.sums[q][1][r]));
      // The first group starts from zero, as pair_gemm_impl.h's totals do.
      F t = Ops::fma(sc, sum, g == 0 ? Ops::zero() : Ops::load(s.total[q][r]));
      if (a.mins != nullptr) t = Ops::fma(Ops::splat(a.xsum[(r0 + r) * a.groups + g]), mn, t);
      Ops::store(t, s.total[q][r]);
    }
  }
}

inline void store_totals(const Args& a, const Scratch& s, int count, int64_t r0, int rows, int64_t panel) {
  for (int q = 0; q < count; ++q) {
    const int64_t c0 = (panel + q) * kPanel;
    const int64_t ncols = a.n - c0 < kPanel ? a.n - c0 : kPanel;
    const float* bias = a.bias != nullptr ? a.bias + c0 : nullptr;
    for (int r = 0; r < rows; ++r) store_cols(Ops::load(s.total[q][r]), bias, ncols, a.out + (r0 + r) * a.n + c0);
  }
}

// One row tile (rows [r0, r0 + rows)) x `count` (1 or 2) panels. Even and odd blocks of K sum
// into separate tiles (tmm0 / tmm1 panel 0, tmm2 / tmm3 panel 1, added per group): a tile
// multiply waits for the one before it on the same sums (~50 cycles), so one chain per panel left
// a one-row call waiting on it. The weights come decoded in `decoded` (padded_pairs(kh) pairs per
// panel) or, with `decoded` null, are decoded block by block into `ring` just before their
// multiply: the panels then stream from memory once. Block b + 1 is decoded before block b's
// tiles load, into the other half of `ring`: a tile load waits for the stores it reads to reach
// the cache, which right after them stalled every block (~7 ns, a third of its decode).
void row_tile(const Ops& ops, const Args& a, int64_t r0, int rows, int64_t panel, int count, const W* decoded,
              W* ring, Scratch& s) {
  const int64_t ldx = a.ldx * static_cast<int64_t>(sizeof(X));
  const X* x = a.x + r0 * a.ldx;
  const int64_t kb = padded_pairs(a.kh), blocks = kb / kBlockPairs;
  const int64_t group_blocks = a.groups == 1 ? blocks : a.group_pairs / kBlockPairs;
  const bool two = count == 2;
  auto decode = [&](int64_t b) {
    W* dst = ring + (b & 1) * 2 * kBlockPairs;
    decode_block(ops, a, panel, b * kBlockPairs, dst);
    if (two) decode_block(ops, a, panel + 1, b * kBlockPairs, dst + kBlockPairs);
  };
  if (decoded == nullptr) decode(0);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t b = 0; b < blocks; ++b) {
    const W *w0, *w1;
    if (decoded == nullptr) {
      if (b + 1 < blocks) decode(b + 1);
      w0 = ring + (b & 1) * 2 * kBlockPairs;
      w1 = w0 + kBlockPairs;
    } else {
      w0 = decoded + b * kBlockPairs;
      w1 = w0 + kb;
    }
// Block b's multiplies from activation tile `at` into sums tiles c0 (panel 0) and c1 (panel 1):
// a macro, as the tile instructions take their register numbers as immediates.
#define FD_AMX_BLOCK(at, c0, c1)               \
  do {                                         \
    _tile_loadd(at, x + b * kBlockPairs, ldx); \
    _tile_loadd(6, w0, 64);                    \
    _tile_dpbf16ps(c0, at, 6);                 \
    if (two) {                                 \
      _tile_loadd(7, w1, 64);                  \
      _tile_dpbf16ps(c1, at, 7);               \
    }                                          \
  } while (0)
    if (b % 2 == 0) {
      FD_AMX_BLOCK(4, 0, 2);
    } else {
      FD_AMX_BLOCK(5, 1, 3);
    }
#undef FD_AMX_BLOCK
    if ((b + 1) % group_blocks == 0 || b + 1 == blocks) {  // the end of group g
      _tile_stored(0, s.sums[0][0], 64);
      _tile_stored(1, s.sums[0][1], 64);
      if (two) {
        _tile_stored(2, s.sums[1][0], 64);
        _tile_stored(3, s.sums[1][1], 64);
      }
      fold_group(a, s, count, r0, rows, panel, b / group_blocks);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  store_totals(a, s, count, r0, rows, panel);
}

// Panels [pb, pe) for every row, two at a time (the last alone where one is left over). One row
// tile streams each pair (one panel at a time measured ~10% slower at one row: fewer multiplies in
// flight); more rows decode each pair once into `buffer`, which every row tile then reads. Which
// panels share a tile changes no bits.
void panels(const Args& a, int64_t pb, int64_t pe, W* buffer, Scratch& s) {
  const Ops ops;
  const int64_t kb = padded_pairs(a.kh);
  for (int64_t p = pb; p < pe; p += 2) {
    const int count = pe - p < 2 ? 1 : 2;
    if (a.m <= kTileRows) {
      row_tile(ops, a, 0, static_cast<int>(a.m), p, count, nullptr, buffer, s);
      continue;
    }
    for (int q = 0; q < count; ++q) {
      for (int64_t j = 0; j < kb; j += kBlockPairs) decode_block(ops, a, p + q, j, buffer + q * kb + j);
    }
    for (int64_t r = 0; r < a.m; r += kTileRows) {
      const int rows = static_cast<int>(a.m - r < kTileRows ? a.m - r : kTileRows);
      row_tile(ops, a, r, rows, p, count, buffer, nullptr, s);
    }
  }
}

// The whole GEMM on AMX: x holds padded_rows(m) rows of padded_pairs(kh) pairs (ldx), zeros past
// row m and pair kh.
void gemm(const X* x, int64_t m, int64_t ldx, int64_t kh, const uint8_t* w, int64_t groups, int64_t group_pairs,
          const float* scales, const float* mins, const float* xsum, const float* bias, int64_t n, float* out) {
  const Args args{x, m, ldx, kh, n, groups, group_pairs, w, scales, mins, xsum, bias, out};
  for_panel_ranges(n, [&](int64_t pb, int64_t pe) {
    thread_local std::vector<W> buffer;
    thread_local Scratch scratch;
    const int64_t need = m <= kTileRows ? 4 * kBlockPairs : 2 * padded_pairs(kh);
    if (static_cast<int64_t>(buffer.size()) < need) buffer.resize(need);
    configure(m <= kTileRows ? static_cast<int>(m) : kTileRows);
    panels(args, pb, pe, buffer.data(), scratch);
    _tile_release();
  });
}

}  // namespace amx
