// The weight-only integer GEMM of int_gemm.cc, included once per instruction set inside that
// set's namespace (and `#pragma GCC target`) after that set's `Ops`.
//
// Layouts (built by fastdeploy/model_executor/layers/quantization/int_kernels.py):
//   int8: [ceil(N/16)][Kp][16] int8, one panel of 16 output columns, zero past N and in the row
//         that rounds K up to an even Kp (int_gemm.cc's bf16 path reads the rows in pairs);
//         scales [ceil(N/16)][16]: out = scale * sum_k x[k] * q[k].
//   int4: [ceil(N/16)][ceil(K/8)][64] bytes, kernels.h's blocks of kInt4BlockPairs k pairs (0..15);
//         scales and mins [ceil(N/16)][G][16] for G = ceil(K / group) groups:
//         out = sum_g scale[g] * sum_{k in g} x[k] * q[k]  +  min[g] * sum_{k in g} x[k],
//         so w = scale * q + min (min = -scale * zero for a zero point).
// Every (row, column) is the same chain of multiply-adds in the order of K whichever tile
// computes it, so a row's result never depends on the rest of the batch or the thread count.

// Each path's `Ops` (defined before the include) gives F, 16 fp32 lanes, and:
//   i8(p) / u4(block, i, lo, hi): 16 int8 weights, or rows 2i and 2i + 1 of an int4 block, as F;
//   splat(s), fma(a, b, c) = a * b + c (one rounding), mul, store(F, float*), load(const float*);
//   kChains: how many accumulators a tile of few rows keeps in flight (rows x panels).
using F = Ops::F;

constexpr int kPanel = 16;
constexpr int kRows = 4;

inline void store_cols(const F& v, const float* bias, int64_t ncols, float* dst) {
  alignas(64) float tmp[kPanel];
  Ops::store(v, tmp);
  for (int64_t c = 0; c < ncols; ++c) dst[c] = tmp[c] + (bias != nullptr ? bias[c] : 0.0f);
}

// R rows x P panels: every (row, panel) pair keeps its own accumulator. With one or two rows a
// single panel gives one or two chains of dependent FMAs, latency-bound at a fraction of the
// memory's speed (an MoE expert or a decode step gets 1-2 rows); P panels at once give R x P
// independent chains over the same per-column arithmetic, so the results are the same bits
// whatever P is. `rem` is the number of columns from the first panel's on (the last panel of N
// may be partial).
template <int R, int P>
void tile_int8(const float* x, int64_t k, const int8_t* panel, int64_t panel_stride, const float* scale,
               const float* bias, int64_t rem, float* out, int64_t ldo) {
  F acc[R][P];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < P; ++j) acc[r][j] = Ops::zero();
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    F w[P];
#pragma GCC unroll 4
    for (int j = 0; j < P; ++j) w[j] = Ops::i8(panel + j * panel_stride + kk * kPanel);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const F xv = Ops::splat(x[r * k + kk]);
#pragma GCC unroll 4
      for (int j = 0; j < P; ++j) acc[r][j] = Ops::fma(xv, w[j], acc[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < P; ++j) {
    const F s = Ops::load(scale + j * kPanel);
    const int64_t ncols = rem - j * kPanel < kPanel ? rem - j * kPanel : kPanel;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      store_cols(Ops::mul(acc[r][j], s), bias != nullptr ? bias + j * kPanel : nullptr, ncols,
                 out + r * ldo + j * kPanel);
  }
}

template <int R, int P>
void tile_int4(const float* x, int64_t k, const float* xsum, int64_t groups, int64_t group, const uint8_t* panel,
               int64_t panel_stride, const float* scale, const float* mins, int64_t scale_stride, const float* bias,
               int64_t rem, float* out, int64_t ldo) {
  F acc[R][P];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < P; ++j) acc[r][j] = Ops::zero();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t p0 = g * group / 2, p1 = (g * group + group < k ? g * group + group : k) / 2;
    F part[R][P];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < P; ++j) part[r][j] = Ops::zero();
    }
    // Pair p: rows 2p, 2p + 1, nibble i of block b (p = 4b + i); whole blocks unrolled, so that
    // each pair's shift is a constant.
    const auto pair = [&](int64_t p, int i) __attribute__((always_inline)) {
      const uint8_t* block = panel + p / kInt4BlockPairs * (kInt4BlockPairs * kPanel);
      F lo[P], hi[P];
#pragma GCC unroll 4
      for (int j = 0; j < P; ++j) Ops::u4(block + j * panel_stride, i, lo[j], hi[j]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const F x0 = Ops::splat(x[r * k + 2 * p]), x1 = Ops::splat(x[r * k + 2 * p + 1]);
#pragma GCC unroll 4
        for (int j = 0; j < P; ++j) {
          part[r][j] = Ops::fma(x0, lo[j], part[r][j]);
          part[r][j] = Ops::fma(x1, hi[j], part[r][j]);
        }
      }
    };
    int64_t p = p0;
    for (; p % kInt4BlockPairs == 0 && p + kInt4BlockPairs <= p1; p += kInt4BlockPairs) {
#pragma GCC unroll 4
      for (int i = 0; i < kInt4BlockPairs; ++i) pair(p + i, i);
    }
    for (; p < p1; ++p) pair(p, static_cast<int>(p % kInt4BlockPairs));
#pragma GCC unroll 4
    for (int j = 0; j < P; ++j) {
      const F s = Ops::load(scale + j * scale_stride + g * kPanel), mn = Ops::load(mins + j * scale_stride + g * kPanel);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        acc[r][j] = Ops::fma(s, part[r][j], acc[r][j]);
        acc[r][j] = Ops::fma(Ops::splat(xsum[r * groups + g]), mn, acc[r][j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < P; ++j) {
    const int64_t ncols = rem - j * kPanel < kPanel ? rem - j * kPanel : kPanel;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      store_cols(acc[r][j], bias != nullptr ? bias + j * kPanel : nullptr, ncols, out + r * ldo + j * kPanel);
  }
}

// Panels [panel, panel + count) (count <= P) of R rows from row r0.
template <int R, int P>
void tile_panels(int count, const IntGemmArgs& a, int64_t r0, int64_t panel) {
  if constexpr (P > 1) {
    if (count < P) return tile_panels<R, P - 1>(count, a, r0, panel);
  }
  const int64_t c0 = panel * kPanel;
  const float* bias = a.bias != nullptr ? a.bias + c0 : nullptr;
  float* out = a.out + r0 * a.n + c0;
  if (a.bits == 8) {
    tile_int8<R, P>(a.x + r0 * a.k, a.k, reinterpret_cast<const int8_t*>(a.w) + panel * a.kp * kPanel, a.kp * kPanel,
                    a.scales + panel * kPanel, bias, a.n - c0, out, a.n);
  } else {
    const int64_t scale_stride = a.groups * kPanel;
    tile_int4<R, P>(a.x + r0 * a.k, a.k, a.xsum + r0 * a.groups, a.groups, a.group,
                    a.w + panel * int4_panel_bytes(a.k), int4_panel_bytes(a.k), a.scales + panel * scale_stride,
                    a.mins + panel * scale_stride, scale_stride, bias, a.n - c0, out, a.n);
  }
}

// Panels [pb, pe) of `rows` (1 .. kRows) rows from r0, P = Ops::kChains / rows (1 .. kMaxPanels)
// panels at a time.
constexpr int kMaxPanels = 4;
template <int R>
void panel_rows(int rows, const IntGemmArgs& a, int64_t r0, int64_t pb, int64_t pe) {
  if constexpr (R > 1) {
    if (rows < R) return panel_rows<R - 1>(rows, a, r0, pb, pe);
  }
  constexpr int kFit = Ops::kChains / R > 1 ? Ops::kChains / R : 1;
  constexpr int P = kFit < kMaxPanels ? kFit : kMaxPanels;
  for (int64_t p = pb; p < pe; p += P) tile_panels<R, P>(static_cast<int>(pe - p < P ? pe - p : P), a, r0, p);
}

// Panels [pb, pe) for every row. Up to kRows rows: one pass, P panels side by side. More: a few
// panels (their weights stay in L1) against every row tile, then the next few.
void panels(const IntGemmArgs& a, int64_t pb, int64_t pe) {
  if (a.m <= kRows) return panel_rows<kRows>(static_cast<int>(a.m), a, 0, pb, pe);
  constexpr int64_t kChunk = 2;
  for (int64_t pc = pb; pc < pe; pc += kChunk) {
    const int64_t pce = pc + kChunk < pe ? pc + kChunk : pe;
    for (int64_t r = 0; r < a.m; r += kRows) {
      panel_rows<kRows>(static_cast<int>(a.m - r < kRows ? a.m - r : kRows), a, r, pc, pce);
    }
  }
}
