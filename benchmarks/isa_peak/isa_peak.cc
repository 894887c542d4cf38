// Peak multiply-add rate of one core per dot-product instruction: 12 independent accumulator
// chains (enough to hide every latency), no memory traffic. Each function is compiled for its
// own instructions; the driver (benchmarks/benchmark_isa_peak.py) runs only those the CPU has.
// Prints one "name macs_per_instruction ns_per_instruction" line per instruction asked for.
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstring>

namespace {

constexpr int kChains = 12;
constexpr long kIters = 20000000;

double ns_per_instruction(std::chrono::steady_clock::time_point t0) {
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / (static_cast<double>(kIters) * kChains);
}

// The timed loop of one instruction: kChains accumulators of type V from SEED, each updated by
// STEP(acc) per iteration (a macro: every function carries its own target, which a shared
// template or lambda would not). INV, the step's loop-invariant operand, is pinned to a register
// each iteration, and the accumulators are indexed (a range-for over references made GCC copy
// each accumulator twice around its step, which slowed the measured rate).
#define FD_PEAK_LOOP(V, SEED, STEP, INV)                   \
  V acc[kChains];                                          \
  for (V& c : acc) c = SEED;                               \
  const auto t0 = std::chrono::steady_clock::now();        \
  for (long it = 0; it < kIters; ++it) {                   \
    _Pragma("GCC unroll 12") for (int i = 0; i < kChains; ++i) acc[i] = STEP(acc[i]); \
    asm volatile("" : : "v"(INV));                         \
  }                                                        \
  const double ns = ns_per_instruction(t0);                \
  for (V& c : acc) asm volatile("" : : "x"(c));            \
  return ns;

// The instruction itself: GCC 12 compiles _mm512_dpbusd_epi32 on a loop-carried accumulator with
// two register copies around each one.
__attribute__((target("avx512f"))) inline __m512i dpbusd(__m512i c, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(c) : "v"(a), "v"(b));
  return c;
}

// One timed function per instruction: NAME compiled for TARGET, its loop-invariant operands
// declared by the trailing arguments (operands that do not change: each instruction still waits
// only on its own accumulator).
#define FD_PEAK_FN(NAME, TARGET, V, SEED, STEP, INV, ...) \
  __attribute__((target(TARGET))) double NAME() {         \
    __VA_ARGS__;                                          \
    FD_PEAK_LOOP(V, SEED, STEP, INV)                      \
  }

#define DPBUSD_STEP(c) dpbusd(c, a, b)
#define DPBF16_STEP(c) _mm512_dpbf16_ps(c, a, a)
#define FMA512_STEP(c) _mm512_fmadd_ps(c, a, b)
#define FMA256_STEP(c) _mm256_fmadd_ps(c, a, b)
// AVX2's int8 dot product without VNNI: vpmaddubsw + vpmaddwd + vpaddd per 32 multiply-adds (the
// products read the accumulator, so the compiler cannot hoist them out of the loop).
#define MADDUBS_STEP(c) _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(c, b), ones))

FD_PEAK_FN(vpdpbusd_zmm, "avx512f,avx512bw,avx512vnni", __m512i, _mm512_setzero_si512(), DPBUSD_STEP, a,
           const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5))
FD_PEAK_FN(vdpbf16ps_zmm, "avx512f,avx512bw,avx512bf16", __m512, _mm512_setzero_ps(), DPBF16_STEP, a,
           const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80)))
FD_PEAK_FN(vfmadd_zmm, "avx512f", __m512, _mm512_setzero_ps(), FMA512_STEP, a,
           const __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f))
FD_PEAK_FN(vfmadd_ymm, "avx2,fma", __m256, _mm256_setzero_ps(), FMA256_STEP, a,
           const __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f))
FD_PEAK_FN(vpmaddubsw_ymm, "avx2", __m256i, _mm256_setzero_si256(), MADDUBS_STEP, b,
           const __m256i b = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1))

struct Entry {
  const char* name;
  int macs;
  double (*run)();
};

const Entry kEntries[] = {
    {"vpdpbusd_zmm", 64, vpdpbusd_zmm}, {"vdpbf16ps_zmm", 32, vdpbf16ps_zmm}, {"vfmadd231ps_zmm", 16, vfmadd_zmm},
    {"vfmadd231ps_ymm", 8, vfmadd_ymm}, {"vpmaddubsw_ymm", 32, vpmaddubsw_ymm},
};

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    for (const Entry& e : kEntries) {
      if (std::strcmp(argv[i], e.name) == 0) std::printf("%s %d %.4f\n", e.name, e.macs, e.run());
    }
  }
  return 0;
}
