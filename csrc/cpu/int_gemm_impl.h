// The weight-only integer GEMM of int_gemm.cc, included once per instruction set inside that
// set's namespace (and `#pragma GCC target`) after that set's `Ops`.
//
// Layouts (built by fastdeploy/model_executor/layers/quantization/int_kernels.py):
//   int8: [ceil(N/16)][K][16] int8, one panel of 16 output columns, zero past N;
//         scales [ceil(N/16)][16]: out = scale * sum_k x[k] * q[k].
//   int4: [ceil(N/16)][K/2][16] uint8, q[2p] in the low nibble, q[2p+1] in the high one (0..15);
//         scales and mins [ceil(N/16)][G][16] for G = ceil(K / group) groups:
//         out = sum_g scale[g] * sum_{k in g} x[k] * q[k]  +  min[g] * sum_{k in g} x[k],
//         so w = scale * q + min (min = -scale * zero for a zero point).
// Every (row, column) is the same chain of multiply-adds in the order of K whichever tile
// computes it, so a row's result never depends on the rest of the batch or the thread count.

// Each path's `Ops` (defined before the include) gives F, 16 fp32 lanes, and:
//   i8(p) / u4(p, lo, hi): 16 int8 weights, or the low and high nibbles of 16 bytes, as F;
//   splat(s), fma(a, b, c) = a * b + c (one rounding), mul, store(F, float*), load(const float*).
using F = Ops::F;

constexpr int kPanel = 16;
constexpr int kRows = 4;

inline void store_cols(const F& v, const float* bias, int64_t ncols, float* dst) {
  alignas(64) float tmp[kPanel];
  Ops::store(v, tmp);
  for (int64_t c = 0; c < ncols; ++c) dst[c] = tmp[c] + (bias != nullptr ? bias[c] : 0.0f);
}

template <int R>
void tile_int8(const float* x, int64_t k, const int8_t* panel, const float* scale, const float* bias, int64_t ncols,
               float* out, int64_t ldo) {
  F acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = Ops::zero();
  for (int64_t kk = 0; kk < k; ++kk) {
    const F w = Ops::i8(panel + kk * kPanel);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = Ops::fma(Ops::splat(x[r * k + kk]), w, acc[r]);
  }
  const F s = Ops::load(scale);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) store_cols(Ops::mul(acc[r], s), bias, ncols, out + r * ldo);
}

template <int R>
void tile_int4(const float* x, int64_t k, const float* xsum, int64_t groups, int64_t group, const uint8_t* panel,
               const float* scale, const float* mins, const float* bias, int64_t ncols, float* out, int64_t ldo) {
  F acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = Ops::zero();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t p0 = g * group / 2, p1 = (g * group + group < k ? g * group + group : k) / 2;
    F part[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) part[r] = Ops::zero();
    for (int64_t p = p0; p < p1; ++p) {
      F lo, hi;
      Ops::u4(panel + p * kPanel, lo, hi);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        part[r] = Ops::fma(Ops::splat(x[r * k + 2 * p]), lo, part[r]);
        part[r] = Ops::fma(Ops::splat(x[r * k + 2 * p + 1]), hi, part[r]);
      }
    }
    const F s = Ops::load(scale + g * kPanel), mn = Ops::load(mins + g * kPanel);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      acc[r] = Ops::fma(s, part[r], acc[r]);
      acc[r] = Ops::fma(Ops::splat(xsum[r * groups + g]), mn, acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) store_cols(acc[r], bias, ncols, out + r * ldo);
}

// `rows` (1 .. kRows) rows of one panel.
template <int R>
void panel_rows(int rows, const IntGemmArgs& a, int64_t r0, int64_t panel) {
  if constexpr (R > 1) {
    if (rows < R) return panel_rows<R - 1>(rows, a, r0, panel);
  }
  const int64_t c0 = panel * kPanel;
  const int64_t ncols = a.n - c0 < kPanel ? a.n - c0 : kPanel;
  const float* bias = a.bias != nullptr ? a.bias + c0 : nullptr;
  float* out = a.out + r0 * a.n + c0;
  if (a.bits == 8) {
    tile_int8<R>(a.x + r0 * a.k, a.k, reinterpret_cast<const int8_t*>(a.w) + panel * a.k * kPanel,
                 a.scales + panel * kPanel, bias, ncols, out, a.n);
  } else {
    tile_int4<R>(a.x + r0 * a.k, a.k, a.xsum + r0 * a.groups, a.groups, a.group, a.w + panel * (a.k / 2) * kPanel,
                 a.scales + panel * a.groups * kPanel, a.mins + panel * a.groups * kPanel, bias, ncols, out, a.n);
  }
}

// Panels [pb, pe) for every row: a few panels (their weights stay in L1/L2) against every row
// tile, then the next few.
void panels(const IntGemmArgs& a, int64_t pb, int64_t pe) {
  constexpr int64_t kChunk = 2;
  for (int64_t pc = pb; pc < pe; pc += kChunk) {
    const int64_t pce = pc + kChunk < pe ? pc + kChunk : pe;
    for (int64_t r = 0; r < a.m; r += kRows) {
      const int rows = static_cast<int>(a.m - r < kRows ? a.m - r : kRows);
      for (int64_t p = pc; p < pce; ++p) panel_rows<kRows>(rows, a, r, p);
    }
  }
}
