// Helpers shared by the CPU kernels: bf16 conversion, a vectorizable exp, input checks.
//
// Everything here is plain C++ written so that GCC vectorizes it under
// `#pragma omp simd` with -O3 -march=native (the extension is built on the
// machine that runs it), instead of hand-written intrinsics per ISA.
#pragma once

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "paddle/extension.h"

namespace fastdeploy_cpu {

// Threads for a parallel region over `units` pieces of work: at most the runtime's, at least one,
// and one inside another parallel region (the fused MoE ops run a whole expert per thread, its
// GEMMs on that thread, whatever the runtime's nesting setting; loops that size their team
// otherwise say `if (... && !omp_in_parallel())`).
inline int team_size(int64_t units) {
  if (omp_in_parallel()) return 1;
  return static_cast<int>(std::min<int64_t>(omp_get_max_threads(), std::max<int64_t>(1, units)));
}

// A per-thread scratch buffer of at least `size` elements (it only grows, so steps do not reallocate).
template <typename T>
T* sized(std::vector<T>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// bf16 is the top half of an fp32: widening is a shift.
inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even, as torch and oneDNN do (NaN stays NaN). Branch-free, so loops over it
// vectorize.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

// The constants of exp_approx, shared with the kernels that evaluate it on whole registers
// (attention_bf16.cc's exp_approx16), so both give the same values.
namespace exp_coeffs {
constexpr float kLow = -87.0f, kHigh = 88.0f;  // below kLow: exactly 0
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 in two parts
constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_coeffs

// exp(x) with ~1 ulp error (Cephes polynomial), branch-free so loops over it vectorize.
// Inputs below -87 (including -inf, used for masked scores) return exactly 0.
inline float exp_approx(float x) {
  using namespace exp_coeffs;
  // Comparisons rather than std::fmin/fmax, and nearbyint rather than floor(x + 0.5): GCC
  // vectorizes neither of those (each became a libm call per element).
  const float low = x > kLow ? x : kLow;
  const float clamped = low < kHigh ? low : kHigh;
  const float n = std::nearbyint(clamped * kLog2e);
  float r = clamped - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kPoly[i];
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < kLow ? 0.0f : p * scale;
}

// Load n values of a float or bf16 row into fp32.
inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load_row(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

// Asks for the `bytes` from p (whole 64-byte lines) ahead of their use, into L2 where `l2`, else L1.
inline void prefetch_bytes(const void* p, int64_t bytes, bool l2) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) {
    if (l2) {
      __builtin_prefetch(c + b, 0, 2);
    } else {
      __builtin_prefetch(c + b, 0, 3);
    }
  }
}

// Store n fp32 values into a float or bf16 row.
inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, uint16_t* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// Rows of x [m, k] rounded to bf16 once, in pairs: word j of row r holds x[r, 2j] in its low half
// and x[r, 2j + 1] in its high one (a zero past an odd K); the activations of the bf16 dot-product
// kernels (pair_gemm_bf16.h). `ldx` words per row (at least ceil(k / 2)) and `rows` rows (at least
// m), zeros past them: the AMX tiles read whole blocks of K and whole tiles of rows.
inline void bf16_pairs(const float* x, int64_t m, int64_t k, std::vector<uint32_t>& out, int64_t ldx = 0,
                       int64_t rows = 0) {
  ldx = std::max<int64_t>(ldx, (k + 1) / 2);
  out.assign(std::max(rows, m) * ldx, 0);
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    uint32_t* o = out.data() + r * ldx;
#pragma omp simd
    for (int64_t j = 0; j < k / 2; ++j) {
      o[j] = float_to_bf16(xr[2 * j]) | static_cast<uint32_t>(float_to_bf16(xr[2 * j + 1])) << 16;
    }
    if (k % 2 != 0) o[k / 2] = float_to_bf16(xr[k - 1]);
  }
}

// The sum of x[0, n) rounded to bf16 (what the bf16 dot products multiply), in a fixed order
// that depends on n only.
inline float bf16_rounded_sum(const float* x, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += bf16_to_float(float_to_bf16(x[i]));
  return s;
}

// Whether Linux lets this process use the AMX tile state, asked for once per process (oneDNN
// asks the same way).
inline bool amx_tiles_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Whether this CPU and process can run AMX-BF16 tiles.
inline bool amx_bf16_usable() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && amx_tiles_permitted();
}

// Whether this CPU and process can run AMX-INT8 tiles.
inline bool amx_int8_usable() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && amx_tiles_permitted();
}

// An AMX tile configuration (palette 1): per tile register its bytes per row and its rows; what
// _tile_loadconfig reads. Plain data, so any translation unit may fill one.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void check_cpu_contiguous(const paddle::Tensor& t, const char* name) {
  PD_CHECK(t.is_cpu(), std::string(name) + " must be a CPU tensor.");
  PD_CHECK(t.is_contiguous(), std::string(name) + " must be contiguous.");
}

inline void check_dtype(const paddle::Tensor& t, paddle::DataType dtype, const char* name) {
  PD_CHECK(t.dtype() == dtype, std::string(name) + " has the wrong dtype.");
}

// KV caches are float32 or bfloat16; kernels template on the element type.
inline bool is_bf16(const paddle::Tensor& t) { return t.dtype() == paddle::DataType::BFLOAT16; }

// The rows of a linear-style op's input x [..., K] (float32, contiguous, at least one dimension).
struct LinearRows {
  int64_t m, k;
};
inline LinearRows check_linear_x(const paddle::Tensor& x, const std::string& op) {
  check_cpu_contiguous(x, "x");
  check_dtype(x, paddle::DataType::FLOAT32, "x");
  PD_CHECK(!x.shape().empty(), op + ": x must have at least one dimension.");
  const int64_t k = x.shape().back();
  return {k ? x.numel() / k : 0, k};
}

// The [..., N] float32 output of a linear-style op on x [..., K].
inline paddle::Tensor linear_output(const paddle::Tensor& x, int64_t n) {
  std::vector<int64_t> shape = x.shape();  // a copy: shape() returns by value
  shape.back() = n;
  return paddle::empty(shape, paddle::DataType::FLOAT32, x.place());
}

// An optional bias [N] float32: its data, or nullptr without one.
inline const float* optional_bias(const paddle::optional<paddle::Tensor>& bias, int64_t n, const std::string& op) {
  if (!bias.is_initialized()) return nullptr;
  check_cpu_contiguous(*bias, "bias");
  check_dtype(*bias, paddle::DataType::FLOAT32, "bias");
  PD_CHECK(bias->numel() == n, op + ": bias must have N elements.");
  return bias->data<float>();
}

}  // namespace fastdeploy_cpu
