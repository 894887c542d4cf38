// The bf16 dot-product step of pair_gemm_impl.h (AVX512-BF16): a decoded k pair is 32 bf16 (k0 in
// the low half of each 32-bit lane, k1 in the high one) and an activation pair one 32-bit word of
// two bf16 (bf16_pairs), so one `vdpbf16ps` adds both rows of the pair to every column's sum.
// Included after pair_gemm_avx512.h inside a namespace compiled for AVX512-BF16.
struct OpsBf16 : Ops512 {
  struct W {
    __m512i v;
  };
  using X = uint32_t;  // (bf16 x[2j], bf16 x[2j+1]) in one word
  static void madd(Acc& acc, const uint32_t* x, int64_t j, const W& w, int chain) {
    acc.c[chain] = _mm512_dpbf16_ps(acc.c[chain], reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[j]))),
                                    reinterpret_cast<__m512bh>(w.v));
  }
};
