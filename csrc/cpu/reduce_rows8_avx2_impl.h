// Eight horizontal reductions at once on AVX2, shared by the AVX2 paths that reduce one register
// per row (gguf_gemm.cc's activation quantization, attention.cc's dot-product scores). Included
// inside a namespace compiled for AVX2 (a target region or -march); no include guard on purpose.

// Lane j of the result: v[j]'s 8 lanes combined by `op`, in one fixed order of lanes (so the same
// value wherever a row sits); 14 shuffles and 7 ops where 8 separate reductions take 24 of each.
template <class Op>
inline __m256 reduce_rows8(const __m256 v[8], Op op) {
  __m256 a[4], b[2];
  // a[i], per 128-bit lane: v[2i] and v[2i + 1] reduced to two lanes each, interleaved.
  for (int i = 0; i < 4; ++i) a[i] = op(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // b[i], per 128-bit lane: that lane's total of v[4i] .. v[4i + 3].
  for (int i = 0; i < 2; ++i) {
    b[i] = op(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return op(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
