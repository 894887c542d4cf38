// Linear layers for AVX2 + FMA CPUs (no AMX / AVX512-BF16): weights in panels of 16 columns.
//
// On such CPUs oneDNN has only its reference bf16 matmul, and its fp32 matmul was measured
// slower than this kernel for most of a model's shapes (benchmarks/results/kernels.json) and
// sums K differently for different M, which breaks batch invariance. Weights are packed once,
// as [N/16][K][16] fp32 or bf16 (bf16 halves the bytes a decode step reads, which is what
// bounds it). The kernel widens a bf16 row of a panel to fp32 in registers (bf16 is the top
// half of an fp32: a zero-extend and a shift) and accumulates with fp32 FMAs.
//
// With bf16 weights the activations are rounded to bf16 first, as on the AMX / AVX512-BF16
// path, so both paths compute the same products (exact in fp32) and differ only in the
// order of the sum.
//
// Every output element is one FMA chain over k = 0..K-1 in order, whatever tile computes it,
// however many rows M has and however many threads run: a row's result never depends on the
// rest of the batch (batch invariance) or on the thread count.
#include <algorithm>
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>
#endif

namespace fastdeploy_cpu {

namespace {

constexpr int64_t kPanel = 16;  // columns per panel: two 8-wide fp32 registers

inline int64_t num_panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

inline void to_panel(float v, float* dst) { *dst = v; }
inline void to_panel(float v, uint16_t* dst) { *dst = float_to_bf16(v); }
inline float from_panel(float v) { return v; }
inline float from_panel(uint16_t v) { return bf16_to_float(v); }

template <typename W>
void pack(const float* w, int64_t k, int64_t n, W* packed) {
  const int64_t panels = num_panels(n);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    W* dst = packed + p * k * kPanel;
    for (int64_t kk = 0; kk < k; ++kk) {
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t col = p * kPanel + c;
        to_panel(col < n ? w[kk * n + col] : 0.0f, dst + kk * kPanel + c);  // padding columns hold 0
      }
    }
  }
}

template <typename W>
void unpack(const W* packed, int64_t k, int64_t n, float* w) {
  for (int64_t p = 0; p < num_panels(n); ++p) {
    const W* src = packed + p * k * kPanel;
    for (int64_t kk = 0; kk < k; ++kk) {
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c) w[kk * n + p * kPanel + c] = from_panel(src[kk * kPanel + c]);
    }
  }
}

}  // namespace

int64_t panel_packed_bytes(int64_t k, int64_t n, bool bf16) {
  return num_panels(n) * k * kPanel * (bf16 ? sizeof(uint16_t) : sizeof(float));
}

void panel_pack(const float* w, int64_t k, int64_t n, bool bf16, void* packed) {
  if (bf16) return pack(w, k, n, static_cast<uint16_t*>(packed));
  pack(w, k, n, static_cast<float*>(packed));
}

void panel_unpack(const void* packed, int64_t k, int64_t n, bool bf16, float* w) {
  if (bf16) return unpack(static_cast<const uint16_t*>(packed), k, n, w);
  unpack(static_cast<const float*>(packed), k, n, w);
}

#if defined(__AVX2__) && defined(__FMA__)

namespace {

// 8 weights of a panel row as fp32.
inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 load8(const uint16_t* src) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// R rows x P panels of out = x @ W (+ bias): rows r0.. of x [M, K], panels p0.. of the packed
// weight. R * P * 2 accumulators stay in registers; P panels are streamed side by side so that
// a single row still has enough independent FMA chains.
template <typename W, int R, int P>
void tile(const float* x, int64_t k, const W* packed, const float* bias, int64_t n, int64_t r0, int64_t p0,
          float* out) {
  // Every loop over r and p is unrolled, so that the arrays become registers (any loop left
  // rolled keeps acc in memory, and each FMA then goes through a store and a load).
  __m256 acc[R][P][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  const W* w[P];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) w[p] = packed + (p0 + p) * k * kPanel;
  const float* xr[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) xr[r] = x + (r0 + r) * k;
  for (int64_t kk = 0; kk < k; ++kk) {
    // One panel row at a time (2 registers beside the accumulators); the broadcasts of x are
    // repeated per panel instead, which costs loads, not registers.
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const __m256 lo = load8(w[p] + kk * kPanel), hi = load8(w[p] + kk * kPanel + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(xr[r] + kk);
        acc[r][p][0] = _mm256_fmadd_ps(xv, lo, acc[r][p][0]);
        acc[r][p][1] = _mm256_fmadd_ps(xv, hi, acc[r][p][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    const int64_t col = (p0 + p) * kPanel;
    const int64_t width = std::min<int64_t>(kPanel, n - col);
    alignas(32) float b[kPanel] = {};
    if (bias != nullptr) std::copy(bias + col, bias + col + width, b);
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float* dst = out + (r0 + r) * n + col;
      const __m256 v0 = _mm256_add_ps(acc[r][p][0], b0), v1 = _mm256_add_ps(acc[r][p][1], b1);
      if (width == kPanel) {
        _mm256_storeu_ps(dst, v0);
        _mm256_storeu_ps(dst + 8, v1);
      } else {
        alignas(32) float tmp[kPanel];
        _mm256_store_ps(tmp, v0);
        _mm256_store_ps(tmp + 8, v1);
        std::copy(tmp, tmp + width, dst);
      }
    }
  }
}

// Panels per tile for R rows: at least 8 accumulator chains (FMA latency 4 x 2 units) and at
// most 12, so that accumulators, one panel row and a broadcast fit in 16 registers.
template <int R>
constexpr int panels_for_rows() {
  return R == 1 ? 4 : R == 2 ? 3 : R == 3 ? 2 : 1;
}

// Rows r0 .. r0+R-1 over panels [pb, pe): tiles of panels_for_rows<R>() panels, then single panels.
template <typename W, int R>
void row_block(const float* x, int64_t k, const W* packed, const float* bias, int64_t n, int64_t r0, int64_t pb,
               int64_t pe, float* out) {
  constexpr int P = panels_for_rows<R>();
  int64_t p = pb;
  for (; p + P <= pe; p += P) tile<W, R, P>(x, k, packed, bias, n, r0, p, out);
  for (; p < pe; ++p) tile<W, R, 1>(x, k, packed, bias, n, r0, p, out);
}

template <typename W>
void rows(int count, const float* x, int64_t k, const W* packed, const float* bias, int64_t n, int64_t r0,
          int64_t pb, int64_t pe, float* out) {
  switch (count) {
    case 1: return row_block<W, 1>(x, k, packed, bias, n, r0, pb, pe, out);
    case 2: return row_block<W, 2>(x, k, packed, bias, n, r0, pb, pe, out);
    case 3: return row_block<W, 3>(x, k, packed, bias, n, r0, pb, pe, out);
    case 4: return row_block<W, 4>(x, k, packed, bias, n, r0, pb, pe, out);
    case 5: return row_block<W, 5>(x, k, packed, bias, n, r0, pb, pe, out);
    default: return row_block<W, 6>(x, k, packed, bias, n, r0, pb, pe, out);
  }
}

constexpr int kMaxTileRows = 6;
// Rows kept in L2 while the panels of a thread pass over them.
constexpr int64_t kRowChunk = 48;
// Panels of one thread run against a row chunk before the next ones (they stay in L2).
constexpr int64_t kPanelChunk = 8;

template <typename W>
void gemm(const float* x, int64_t m, int64_t k, const W* packed, const float* bias, int64_t n, float* out) {
  const int64_t panels = num_panels(n);
  // Each thread owns a contiguous range of panels (output columns): the weights are read once in all.
  const int threads = team_size(panels / 4);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t pb = panels * t / nt, pe = panels * (t + 1) / nt;
    // A few rows stream all of the thread's panels in one pass (decode is bound by reading W);
    // more rows are blocked so that a chunk of rows and of panels stays in L2.
    const int64_t panel_chunk = m <= kMaxTileRows ? std::max<int64_t>(1, pe - pb) : kPanelChunk;
    for (int64_t rc = 0; rc < m; rc += kRowChunk) {
      const int64_t rce = std::min(m, rc + kRowChunk);
      for (int64_t pc = pb; pc < pe; pc += panel_chunk) {
        const int64_t pce = std::min(pe, pc + panel_chunk);
        for (int64_t r = rc; r < rce; r += kMaxTileRows) {
          rows(static_cast<int>(std::min<int64_t>(kMaxTileRows, rce - r)), x, k, packed, bias, n, r, pc, pce, out);
        }
      }
    }
  }
}

}  // namespace

void panel_gemm(const float* x, int64_t m, int64_t k, const void* packed, bool bf16, const float* bias, int64_t n,
                float* out) {
  if (m == 0) return;
  if (!bf16) return gemm(x, m, k, static_cast<const float*>(packed), bias, n, out);
  thread_local std::vector<float> rounded;
  if (static_cast<int64_t>(rounded.size()) < m * k) rounded.resize(m * k);
  float* xr = rounded.data();
#pragma omp parallel for simd if (m * k >= (1 << 16)) schedule(static)
  for (int64_t i = 0; i < m * k; ++i) xr[i] = bf16_to_float(float_to_bf16(x[i]));
  gemm(xr, m, k, static_cast<const uint16_t*>(packed), bias, n, out);
}

#else

void panel_gemm(const float*, int64_t, int64_t, const void*, bool, const float*, int64_t, float*) {
  PD_THROW("fd_linear: the panel kernel needs AVX2 and FMA.");
}

#endif

}  // namespace fastdeploy_cpu
