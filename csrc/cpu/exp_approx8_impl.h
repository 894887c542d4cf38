// fastdeploy_cpu::exp_approx on 8 lanes (its constants, clamping and order of operations, so the
// same values) in AVX2 registers: exp_approx16_impl.h's sibling for AVX2 builds (attention.cc's
// softmax). Included inside a namespace; no include guard on purpose.
inline __m256 exp_approx8(__m256 x) {
  using namespace fastdeploy_cpu::exp_coeffs;
  const __m256 clamped = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kLow)), _mm256_set1_ps(kHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kPoly[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  // Below kLow (masked scores included) exactly 0, as exp_approx.
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kLow), _CMP_NLT_UQ);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
