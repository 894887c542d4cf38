// fastdeploy_cpu::exp_approx on 16 lanes (its constants, clamping and order of operations, so the
// same values) in registers. Included inside a namespace by each user compiled for AVX-512
// (attention_bf16.cc in its target region, activation.cc and attention.cc on AVX-512 builds), so each copy is
// compiled for its includer's instructions; no include guard on purpose.
inline __m512 exp_approx16(__m512 x) {
  using namespace fastdeploy_cpu::exp_coeffs;
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kLow)), _mm512_set1_ps(kHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  // Below kLow (masked scores included) exactly 0, as exp_approx.
  return _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kLow), _CMP_NLT_UQ), p, _mm512_castsi512_ps(bits));
}
