// 16 fp32 lanes in plain C++ (the compiler vectorises each loop on its own): the lane operations
// the portable paths of the weight-format kernels (int_gemm.cc, fp8_gemm.cc) share; each path's
// Ops derives from Lanes16 and adds its own weight decoding. Included inside each path's
// namespace, so each copy is compiled for its includer's instructions; no include guard on purpose.
struct Lanes16 {
  struct F {
    float v[16];
  };
  static F zero() { return F{}; }
  static F splat(float s) {
    F r;
    for (float& f : r.v) f = s;
    return r;
  }
  static F load(const float* p) {
    F r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static void store(const F& a, float* p) { std::memcpy(p, a.v, sizeof(a.v)); }
  static F fma(const F& a, const F& b, F c) {
    for (int i = 0; i < 16; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return c;
  }
};
