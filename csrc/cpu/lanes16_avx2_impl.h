// 16 fp32 lanes as two AVX2 registers: the lane operations the AVX2 paths of the weight-format
// kernels (int_gemm.cc, fp8_gemm.cc) share; each path's Ops derives from Lanes16 and adds its own
// weight decoding. Included inside each path's namespace within its `avx2,fma` target region; no
// include guard on purpose.
struct Lanes16 {
  struct F {
    __m256 a, b;
  };
  static F zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F splat(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
  static F load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void store(const F& v, float* p) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
  }
  static F fma(const F& x, const F& y, const F& c) {
    return {_mm256_fmadd_ps(x.a, y.a, c.a), _mm256_fmadd_ps(x.b, y.b, c.b)};
  }
};
