// F, the per-group sums and the scale step of pair_gemm_impl.h's AVX-512 paths (fp32 FMAs or
// bf16 dot products alike). Included inside a namespace compiled for AVX-512
// (`#pragma GCC target`); the includer's Ops derive from Ops512 and add W, X, decode and madd.
struct Ops512 {
  using F = __m512;
  struct Acc {
    __m512 c[2];  // the even and the odd k pairs
  };
  // Two panels per tile: each activation broadcast feeds both.
  static constexpr int kRows = 4, kPanels = 2;
  static F zero() { return _mm512_setzero_ps(); }
  static F splat(float s) { return _mm512_set1_ps(s); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(F v, float* p) { _mm512_storeu_ps(p, v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static Acc zero_acc() { return {{_mm512_setzero_ps(), _mm512_setzero_ps()}}; }
  static F sum(const Acc& acc) { return _mm512_add_ps(acc.c[0], acc.c[1]); }
};
