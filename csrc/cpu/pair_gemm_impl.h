// A GEMM over weights stored as k pairs of 16 output columns, each pair decoded into registers
// by the including path's `Ops`: fp8_gemm.cc's e4m3 weights, and int_gemm.cc's int8 / int4 ones on
// its bf16-dot-product path. Included once per instruction set and format inside that path's
// namespace (and `#pragma GCC target`) after its `Ops`.
//
// Layout: qweight [ceil(N/16)][Kh][kPairBytes], Kh = ceil(K/2): panel p, k pair j holds rows 2j
//         and 2j+1 of the panel's 16 columns (0 past N or K) in the format's encoding; a format
//         whose Ops sets kPairsPerBlock stores its pairs in blocks of that many (int4: four pairs
//         in 64 bytes, kernels.h), the last one padded;
//   scales [ceil(N/16)][G][16] fp32, one per group of `group_pairs` k pairs and column, and for
//          formats with a zero point mins of the same shape and xsum [m][G], the sum of each
//          row's activations over each group:
//          out = sum_g scale[g] * sum_{k in g} x[k] * q[k]  (+ min[g] * xsum[g]).
// Every (row, column) is the same chain of operations in the order of K whichever tile computes
// it and whether its panel was decoded into the buffer or in registers, so a row's result never
// depends on the rest of the batch or on the thread count.

// Each path's `Ops` (defined before the include) gives:
//   F (16 fp32 lanes) with zero(), splat(), load(), store(), fma(a, b, c) = a * b + c;
//   W: one k pair of 16 columns decoded (decode(bytes) from kPairBytes bytes of the panel; with
//      kPairsPerBlock, decode(block, i) the block's pair i);
//   Acc: one row's sums over a group, zero_acc(), madd(acc, x, j, w, chain) adding k pair j of
//        the prepared row x (chain 0 / 1: the even / odd pairs, for paths that keep two chains),
//        sum(acc) -> F;
//   X: the element type of a prepared activation row (kXStride elements per k pair);
//   kRows, kPanels: rows and panels per tile.
using F = Ops::F;
using W = Ops::W;
using Acc = Ops::Acc;
using X = Ops::X;

constexpr int kPanel = 16;
constexpr int kRows = Ops::kRows;
constexpr int64_t kPairBytes = Ops::kPairBytes;
constexpr int64_t kPrefetchBytes = 8192;

template <class O, class = void>
struct PairsPerBlock {
  static constexpr int64_t value = 1;
};
template <class O>
struct PairsPerBlock<O, std::void_t<decltype(O::kPairsPerBlock)>> {
  static constexpr int64_t value = O::kPairsPerBlock;
};
constexpr int64_t kPairsPerBlock = PairsPerBlock<Ops>::value;
static_assert(kPairsPerBlock == 1 || kPairsPerBlock % 2 == 0, "tile() decodes a block two pairs at a time");
constexpr int64_t kBlockBytes = kPairsPerBlock * kPairBytes;

// Bytes of one panel of kh pairs (whole blocks).
inline int64_t panel_bytes(int64_t kh) { return (kh + kPairsPerBlock - 1) / kPairsPerBlock * kBlockBytes; }

// Pair i of the block at `block` (templates on the Ops so that only the format's own decode is compiled).
template <class O>
inline W decode_in_block(const O& ops, const uint8_t* block, int i) {
  if constexpr (PairsPerBlock<O>::value == 1) {
    return ops.decode(block + i * kPairBytes);
  } else {
    return ops.decode(block, i);
  }
}

// Pair j of the panel at `wp`.
inline W decode_pair(const Ops& ops, const uint8_t* wp, int64_t j) {
  return decode_in_block(ops, wp + j / kPairsPerBlock * kBlockBytes, static_cast<int>(j % kPairsPerBlock));
}

struct Args {
  const X* x;  // [m][ldx]: prepared rows
  int64_t m, ldx, kh, n, groups, group_pairs;
  const uint8_t* w;
  const float* scales;
  const float* mins;  // null without a zero point
  const float* xsum;  // [m][groups] where mins is set
  const float* bias;
  float* out;  // [m, n]
};

inline void store_cols(const F& v, const float* bias, int64_t ncols, float* dst) {
  alignas(64) float tmp[kPanel];
  Ops::store(v, tmp);
  for (int64_t c = 0; c < ncols; ++c) dst[c] = tmp[c] + (bias != nullptr ? bias[c] : 0.0f);
}

// R rows of P (1 or 2) adjacent panels sharing each activation load; `decoded` is the panels decoded
// (kh entries each, one after the other), or null to decode in registers.
template <int R, int P>
void tile(const Ops& ops, const Args& a, int64_t r0, int64_t panel, const W* decoded) {
  const int64_t wstride = panel_bytes(a.kh);
  const uint8_t* wp = a.w + panel * wstride;
  const X* x = a.x + r0 * a.ldx;
  F total[R][P];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) total[r][q] = Ops::zero();
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t j0 = g * a.group_pairs;
    const int64_t j1 = j0 + a.group_pairs < a.kh ? j0 + a.group_pairs : a.kh;
    Acc acc[R][P];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < P; ++q) acc[r][q] = Ops::zero_acc();
    // Pairs j (even chain) and j + 1 (odd chain) of every panel into every row's sums.
    const auto madd_pairs = [&](int64_t j, const W* w0, const W* w1) __attribute__((always_inline)) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        for (int q = 0; q < P; ++q) Ops::madd(acc[r][q], x + r * a.ldx, j, w0[q], 0);
        for (int q = 0; q < P; ++q) Ops::madd(acc[r][q], x + r * a.ldx, j + 1, w1[q], 1);
      }
    };
    int64_t j = j0;
    if constexpr (kPairsPerBlock > 1 && P == 1) {
      // Whole blocks decoded in registers, two pairs at a time as below (the same pairs in the same
      // order), their index in the block known at compile time. Only one-panel tiles decode in
      // registers (see panels()); in the two-panel tiles of the buffered path the loop cost ~10% at 16 rows.
      for (; decoded == nullptr && j % kPairsPerBlock == 0 && j + kPairsPerBlock <= j1; j += kPairsPerBlock) {
        const uint8_t* block = wp + j / kPairsPerBlock * kBlockBytes;
        __builtin_prefetch(block + kPrefetchBytes, 0, 2);
#pragma GCC unroll 4
        for (int i = 0; i < kPairsPerBlock; i += 2) {
          const W w0 = decode_in_block(ops, block, i), w1 = decode_in_block(ops, block, i + 1);
          madd_pairs(j + i, &w0, &w1);
        }
      }
    }
    for (; j + 1 < j1; j += 2) {
      W w0[P], w1[P];
      for (int q = 0; q < P; ++q) {
        if (decoded != nullptr) {
          w0[q] = decoded[q * a.kh + j];
          w1[q] = decoded[q * a.kh + j + 1];
        } else {
          // A few rows stream their weights from memory: ask L2 for them ahead, across the 4 KB
          // pages where the hardware prefetcher stops (as gguf_gemm_impl.h's tiles do).
          __builtin_prefetch(wp + q * wstride + j * kPairBytes + kPrefetchBytes, 0, 2);
          w0[q] = decode_pair(ops, wp + q * wstride, j);
          w1[q] = decode_pair(ops, wp + q * wstride, j + 1);
        }
      }
      madd_pairs(j, w0, w1);
    }
    if (j < j1) {
      for (int q = 0; q < P; ++q) {
        const W w0 = decoded != nullptr ? decoded[q * a.kh + j] : decode_pair(ops, wp + q * wstride, j);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) Ops::madd(acc[r][q], x + r * a.ldx, j, w0, 0);
      }
    }
    for (int q = 0; q < P; ++q) {
      const F s = Ops::load(a.scales + ((panel + q) * a.groups + g) * kPanel);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) total[r][q] = Ops::fma(s, Ops::sum(acc[r][q]), total[r][q]);
      if (a.mins != nullptr) {
        const F mn = Ops::load(a.mins + ((panel + q) * a.groups + g) * kPanel);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) total[r][q] = Ops::fma(Ops::splat(a.xsum[(r0 + r) * a.groups + g]), mn, total[r][q]);
      }
    }
  }
  for (int q = 0; q < P; ++q) {
    const int64_t c0 = (panel + q) * kPanel;
    const int64_t ncols = a.n - c0 < kPanel ? a.n - c0 : kPanel;
    const float* bias = a.bias != nullptr ? a.bias + c0 : nullptr;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) store_cols(total[r][q], bias, ncols, a.out + (r0 + r) * a.n + c0);
  }
}

template <int R, int P>
void tile_rows(int rows, const Ops& ops, const Args& a, int64_t r0, int64_t panel, const W* decoded) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1, P>(rows, ops, a, r0, panel, decoded);
  }
  tile<R, P>(ops, a, r0, panel, decoded);
}

// Panels [pb, pe) for every row, Ops::kPanels at a time (the last alone where one is left over).
// With more rows than one tile, the panels are decoded once into `buffer` (kPanels * kh entries)
// and every row tile reads them there. One tile decodes in registers, one panel at a time: its
// weights then stream from memory as one sequential run (two panels side by side read two runs
// and, weights streamed, ran ~1.6x slower at one row); which panels share a tile changes no bits.
void panels(const Args& a, int64_t pb, int64_t pe, W* buffer) {
  const Ops ops;
  if (a.m <= kRows) {
    for (int64_t p = pb; p < pe; ++p) tile_rows<kRows, 1>(static_cast<int>(a.m), ops, a, 0, p, nullptr);
    return;
  }
  for (int64_t p = pb; p < pe; p += Ops::kPanels) {
    const int count = static_cast<int>(pe - p < Ops::kPanels ? pe - p : Ops::kPanels);
    for (int q = 0; q < count; ++q) {
      const uint8_t* wp = a.w + (p + q) * panel_bytes(a.kh);
      // Pair by pair (decoding int4's whole blocks here, four stores at a time, ran ~10% slower at 16 rows).
      for (int64_t j = 0; j < a.kh; ++j) {
        if (j % (64 / kPairBytes) == 0) __builtin_prefetch(wp + j * kPairBytes + kPrefetchBytes, 0, 2);
        buffer[q * a.kh + j] = decode_pair(ops, wp, j);
      }
    }
    const W* decoded = buffer;
    for (int64_t r = 0; r < a.m; r += kRows) {
      const int rows = static_cast<int>(a.m - r < kRows ? a.m - r : kRows);
      if (count == Ops::kPanels) {
        tile_rows<kRows, Ops::kPanels>(rows, ops, a, r, p, decoded);
      } else {
        tile_rows<kRows, 1>(rows, ops, a, r, p, decoded);
      }
    }
  }
}

// Runs body(pb, pe) for each thread's contiguous range of panels [pb, pe): the weights are read
// once in all, and which thread computes a column changes nothing in it.
template <typename Body>
void for_panel_ranges(int64_t n, Body body) {
  const int64_t num_panels = (n + kPanel - 1) / kPanel;
  const int threads = team_size(num_panels / 4);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t pb = num_panels * t / nt, pe = num_panels * (t + 1) / nt;
    if (pb < pe) body(pb, pe);
  }
}

// The whole GEMM on this path.
void gemm(const X* x, int64_t m, int64_t ldx, int64_t kh, const uint8_t* w, int64_t groups, int64_t group_pairs,
          const float* scales, const float* mins, const float* xsum, const float* bias, int64_t n, float* out) {
  const Args args{x, m, ldx, kh, n, groups, group_pairs, w, scales, mins, xsum, bias, out};
  for_panel_ranges(n, [&](int64_t pb, int64_t pe) {
    thread_local std::vector<W> buffer;
    if (m > kRows && static_cast<int64_t>(buffer.size()) < Ops::kPanels * kh) buffer.resize(Ops::kPanels * kh);
    panels(args, pb, pe, buffer.data());
  });
}
