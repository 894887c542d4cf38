// Paged attention over the block table for a mixed batch of prefills and decodes, with GQA.
//
// The batch is flattened: sequence s owns query rows [query_start_loc[s],
// query_start_loc[s + 1]) and has seq_lens[s] tokens of context in the cache
// (cached prefix + earlier chunks + this step's tokens, already written by
// fd_rope_and_cache). Query i of a sequence with L new tokens sits at position
// seq_len - L + i and attends to keys 0 .. that position. A decode is simply a
// sequence with one query, so one kernel serves every mix.
//
// Work items are (sequence, kv head, tile of query tokens): the g = H / KVH query
// heads that share a kv head are processed together, so each key and value is
// read from the cache once per tile (a decode reads each K/V row once for all the heads of
// its group). Keys are walked in tiles of 16 through the block table (any block size) with
// an online softmax; query rows go in groups of 4, and a group skips every key tile past its
// last position (causal). With head dim 64 one group's tile stays in registers: scores, the
// masked max and sum as vector reductions, and P @ V with the value loads shared by the
// group's rows (tile_rows_d64); on AVX2 head dim 64 reads the cache rows in place instead
// (attention_kernel_direct_d64). Every query row goes
// through exactly the same arithmetic whatever tile or batch it is in (masked
// keys contribute exact zeros), so a request's output does not depend on what
// else is batched with it.
#include <algorithm>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define FD_ATTENTION_V16 1
#endif

#include "cpu_utils.h"
#include "kernels.h"

namespace {

#if defined(FD_ATTENTION_V16)
// Head dim 64, the common decode case, has its own code on AVX-512 and AVX2. On AVX-512
// (FD_ATTENTION_TRANSPOSED_D64): the same per-element arithmetic order as the generic loops
// (scores summed over d in order, P @ V over keys in order), with the key transpose done by
// register shuffles and the accumulators kept in registers. On AVX2 (FD_ATTENTION_DIRECT_D64):
// keys and values read in place, see attention_kernel_direct_d64. Every row of every tile takes
// its path, so batch invariance is kept.
//
// V16 is 16 fp32 lanes (one key tile of scores): one 512-bit register, or two 256-bit ones.
#if defined(__AVX512F__)
#define FD_ATTENTION_TRANSPOSED_D64 1
struct V16 {
  __m512 v;
};
inline V16 v16_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void v16_store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 v16_set1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 v16_zero() { return {_mm512_setzero_ps()}; }
inline V16 v16_fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 v16_mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
#include "exp_approx16_impl.h"
inline V16 v16_exp_minus(V16 a, float m) { return {exp_approx16(_mm512_sub_ps(a.v, _mm512_set1_ps(m)))}; }
// Lanes k >= n set to x (the causal / tail mask of a key tile).
inline V16 v16_fill_from(V16 a, int64_t n, float x) {
  const __mmask16 keep = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u);
  return {_mm512_mask_blend_ps(keep, _mm512_set1_ps(x), a.v)};
}
// Horizontal max and sum, in one fixed order of lanes.
inline float v16_reduce_max(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline float v16_reduce_add(V16 a) { return _mm512_reduce_add_ps(a.v); }
// P @ V rows that share each value load: 4 rows x 4 vectors of accumulators fit the 32 zmm registers.
constexpr int kPvRows = 4;

#include "transpose16_impl.h"

// dst[j][i] = src[i][j] for a 16 x 16 fp32 block.
inline void transpose16x16(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * src_stride);
  transpose16x16_regs(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * dst_stride, r[i]);
}
#else
struct V16 {
  __m256 lo, hi;
};
inline V16 v16_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void v16_store(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 v16_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 v16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v16_fmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 v16_mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
#include "exp_approx8_impl.h"
inline V16 v16_exp_minus(V16 a, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  return {exp_approx8(_mm256_sub_ps(a.lo, mv)), exp_approx8(_mm256_sub_ps(a.hi, mv))};
}
inline V16 v16_fill_from(V16 a, int64_t n, float x) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i nv = _mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 16)));
  const __m256 keep_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, lane));
  const __m256 keep_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
  const __m256 fill = _mm256_set1_ps(x);
  return {_mm256_blendv_ps(fill, a.lo, keep_lo), _mm256_blendv_ps(fill, a.hi, keep_hi)};
}
// One lane order for both reductions: halves, then 128-bit halves, then pairs, then the last two.
template <__m256 (*Op8)(__m256, __m256), __m128 (*Op4)(__m128, __m128), __m128 (*Op1)(__m128, __m128)>
inline float v16_reduce(V16 a) {
  const __m256 m = Op8(a.lo, a.hi);
  __m128 h = Op4(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = Op4(h, _mm_movehl_ps(h, h));
  h = Op1(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}
inline __m256 max8(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
inline __m128 max4(__m128 a, __m128 b) { return _mm_max_ps(a, b); }
inline __m128 max1(__m128 a, __m128 b) { return _mm_max_ss(a, b); }
inline __m256 add8(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
inline __m128 add4(__m128 a, __m128 b) { return _mm_add_ps(a, b); }
inline __m128 add1(__m128 a, __m128 b) { return _mm_add_ss(a, b); }
inline float v16_reduce_max(V16 a) { return v16_reduce<max8, max4, max1>(a); }
inline float v16_reduce_add(V16 a) { return v16_reduce<add8, add4, add1>(a); }
#define FD_ATTENTION_DIRECT_D64 1
#endif
#endif

constexpr int64_t kKeyTile = 16;    // keys per score tile: one 512-bit vector of fp32 scores
constexpr int64_t kRowGroup = 4;    // query rows sharing each key load in the score loop

#if defined(FD_ATTENTION_V16)
// The online-softmax step of one query row (at position pos) over a key tile's scores s: the row's
// probabilities into p (keys past the position or the tile exact zeros), its running max and
// lane-wise sums updated; returns alpha, the factor that rescales the row's accumulator.
inline float softmax_tile_row(V16 s, int64_t pos, int64_t key0, int64_t num_keys, float& row_max, float* sum,
                              float* p) {
  const int64_t valid = std::min(num_keys, pos - key0 + 1);  // causal: keys <= position
  if (valid <= 0) {  // acc * 1 + 0 * v: the row is unchanged
    v16_store(p, v16_zero());
    return 1.0f;
  }
  const float new_max = std::max(row_max, v16_reduce_max(v16_fill_from(s, valid, -INFINITY)));
  const float alpha = fastdeploy_cpu::exp_approx(row_max - new_max);
  // In registers: GCC left the loop over the 16 lanes scalar.
  const V16 e = v16_fill_from(v16_exp_minus(s, new_max), valid, 0.0f);
  v16_store(p, e);
  // Lane-wise running sums, reduced once per row at the end: no horizontal sum per tile.
  v16_store(sum, v16_fmadd(v16_load(sum), v16_set1(alpha), e));
  row_max = new_max;
  return alpha;
}
#endif

#if defined(FD_ATTENTION_TRANSPOSED_D64)
// One key tile for kRowGroup query rows of head dim 64, everything in registers: scores summed
// over d in order, the online-softmax update of each row (masked lanes are exact zeros), then
// acc = acc * alpha + sum_k p_k v_k over the keys in order, kPvRows rows sharing each value load.
// Each row's arithmetic is the same whichever rows share its group, so outputs stay
// batch-invariant.
inline void tile_rows_d64(const float* q, const float* keys_t, const float* values, const int64_t* row_pos,
                          int64_t key0, int64_t num_keys, float* row_max, float* row_sum_v, float* probs, float* acc) {
  V16 s[kRowGroup];
  for (int rr = 0; rr < kRowGroup; ++rr) s[rr] = v16_zero();
  for (int64_t d = 0; d < 64; ++d) {
    const V16 kd = v16_load(keys_t + d * kKeyTile);
    for (int rr = 0; rr < kRowGroup; ++rr) s[rr] = v16_fmadd(v16_set1(q[rr * 64 + d]), kd, s[rr]);
  }
  float alpha[kRowGroup];
  for (int rr = 0; rr < kRowGroup; ++rr)
    alpha[rr] = softmax_tile_row(s[rr], row_pos[rr], key0, num_keys, row_max[rr], row_sum_v + rr * kKeyTile,
                                 probs + rr * kKeyTile);
  for (int r0 = 0; r0 < kRowGroup; r0 += kPvRows) {
    V16 a[kPvRows][4];
    for (int rr = 0; rr < kPvRows; ++rr) {
      const V16 al = v16_set1(alpha[r0 + rr]);
      for (int j = 0; j < 4; ++j) a[rr][j] = v16_mul(v16_load(acc + (r0 + rr) * 64 + j * 16), al);
    }
    for (int64_t k = 0; k < num_keys; ++k) {
      const float* v = values + k * 64;
      const V16 v0 = v16_load(v), v1 = v16_load(v + 16), v2 = v16_load(v + 32), v3 = v16_load(v + 48);
      for (int rr = 0; rr < kPvRows; ++rr) {
        const V16 pk = v16_set1(probs[(r0 + rr) * kKeyTile + k]);
        a[rr][0] = v16_fmadd(pk, v0, a[rr][0]);
        a[rr][1] = v16_fmadd(pk, v1, a[rr][1]);
        a[rr][2] = v16_fmadd(pk, v2, a[rr][2]);
        a[rr][3] = v16_fmadd(pk, v3, a[rr][3]);
      }
    }
    for (int rr = 0; rr < kPvRows; ++rr)
      for (int j = 0; j < 4; ++j) v16_store(acc + (r0 + rr) * 64 + j * 16, a[rr][j]);
  }
}
#endif

#if defined(FD_ATTENTION_DIRECT_D64)
// On AVX2, head dim 64 reads keys and values straight from their cache rows instead: widening
// every row to fp32 scratch and transposing the keys (16 8x8 shuffles a tile) cost more than the
// multiply-adds at decode, where a tile serves only a group's three query rows. Each score is a
// dot product, 8 lanes wide over d (even and odd chunks in two chains, then added), and the tile's
// scores of a row come from one fixed tree over the lanes (reduce_rows8); P @ V reads each value
// row once for all the rows, a quarter of d at a time (the accumulators of 4 rows fit 16 ymm).
// A row's arithmetic does not depend on how many rows share its call, so outputs stay
// batch-invariant.
#include "reduce_rows8_avx2_impl.h"

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bf16 widened exactly: the bits in the high half
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// One key tile (keys[k], values[k]: the cache rows of its num_keys keys) for R query rows q of
// head dim 64 (scaled), their softmax state and accumulators acc.
template <int R, typename CacheT>
inline void tile_rows_d64_direct(const float* q, const CacheT* const* keys, const CacheT* const* values,
                                 const int64_t* row_pos, int64_t key0, int64_t num_keys, float* row_max,
                                 float* row_sum_v, float* probs, float* acc) {
  __m256 part[R][kKeyTile];  // each row and key's 8 lanes of the dot product
  for (int64_t k = 0; k < kKeyTile; ++k) {
    if (k >= num_keys) {
      for (int r = 0; r < R; ++r) part[r][k] = _mm256_setzero_ps();
      continue;
    }
    __m256 even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    for (int c = 0; c < 64; c += 16) {
      const __m256 k0 = load8(keys[k] + c), k1 = load8(keys[k] + c + 8);
      for (int r = 0; r < R; ++r) {
        even[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * 64 + c), k0, even[r]);
        odd[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * 64 + c + 8), k1, odd[r]);
      }
    }
    for (int r = 0; r < R; ++r) part[r][k] = _mm256_add_ps(even[r], odd[r]);
  }
  const auto add = [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); };
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    const V16 s{reduce_rows8(part[r], add), reduce_rows8(part[r] + 8, add)};
    alpha[r] = softmax_tile_row(s, row_pos[r], key0, num_keys, row_max[r], row_sum_v + r * kKeyTile, probs + r * kKeyTile);
  }
  for (int c = 0; c < 64; c += 16) {
    __m256 a[R][2];
    for (int r = 0; r < R; ++r) {
      const __m256 al = _mm256_set1_ps(alpha[r]);
      a[r][0] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * 64 + c), al);
      a[r][1] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * 64 + c + 8), al);
    }
    for (int64_t k = 0; k < num_keys; ++k) {
      const __m256 v0 = load8(values[k] + c), v1 = load8(values[k] + c + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 pk = _mm256_broadcast_ss(probs + r * kKeyTile + k);
        a[r][0] = _mm256_fmadd_ps(pk, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(pk, v1, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc + r * 64 + c, a[r][0]);
      _mm256_storeu_ps(acc + r * 64 + c + 8, a[r][1]);
    }
  }
}

// tile_rows_d64_direct for the first n (1 to 4) of a group's rows.
template <typename CacheT>
inline void tile_rows_d64_direct(int64_t n, const float* q, const CacheT* const* keys, const CacheT* const* values,
                                 const int64_t* row_pos, int64_t key0, int64_t num_keys, float* row_max,
                                 float* row_sum_v, float* probs, float* acc) {
  switch (n) {
    case 1: tile_rows_d64_direct<1>(q, keys, values, row_pos, key0, num_keys, row_max, row_sum_v, probs, acc); break;
    case 2: tile_rows_d64_direct<2>(q, keys, values, row_pos, key0, num_keys, row_max, row_sum_v, probs, acc); break;
    case 3: tile_rows_d64_direct<3>(q, keys, values, row_pos, key0, num_keys, row_max, row_sum_v, probs, acc); break;
    default: tile_rows_d64_direct<4>(q, keys, values, row_pos, key0, num_keys, row_max, row_sum_v, probs, acc); break;
  }
}
#endif

template <int kHeadDim, typename CacheT>
void attention_kernel(const float* query, int64_t query_stride, const CacheT* key_cache, const CacheT* value_cache,
                      const int64_t* block_tables, int64_t max_blocks, const int64_t* query_start_loc,
                      const int64_t* seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim_runtime, int64_t block_size, float scale, bool prefetch_l2, float* out) {
  // A compile-time head dim lets the compiler keep rows of it in registers.
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : head_dim_runtime;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tile_tokens = std::max<int64_t>(1, fastdeploy_cpu::kAttentionTileRows / group);
  const int64_t max_rows = (tile_tokens * group + kRowGroup - 1) / kRowGroup * kRowGroup;
  // One thread's buffers.
  struct Scratch {
    std::vector<float> q_rows, acc, row_max, row_sum, row_sum_v, keys_t, key_rows, values, probs;
    std::vector<int64_t> row_pos;
  };
  auto make_scratch = [&] {
    return Scratch{std::vector<float>(max_rows * head_dim), std::vector<float>(max_rows * head_dim),
                   std::vector<float>(max_rows), std::vector<float>(max_rows), std::vector<float>(max_rows * kKeyTile),
                   std::vector<float>(head_dim * kKeyTile), std::vector<float>(kKeyTile * head_dim),
                   std::vector<float>(kKeyTile * head_dim), std::vector<float>(max_rows * kKeyTile),
                   std::vector<int64_t>(max_rows)};
  };
  auto attend = [&](Scratch& sc, const fastdeploy_cpu::AttentionWorkItem& item,
                    const fastdeploy_cpu::AttentionItemRows& at) {
    auto &q_rows = sc.q_rows, &acc = sc.acc, &row_max = sc.row_max, &row_sum = sc.row_sum;
    auto &row_sum_v = sc.row_sum_v, &keys_t = sc.keys_t, &key_rows = sc.key_rows, &values = sc.values;
    auto &probs = sc.probs;
    auto& row_pos = sc.row_pos;
    const int64_t rows = at.rows, first_token = at.first_token, first_pos = at.first_pos, last_pos = at.last_pos;
    const int64_t padded_rows = (rows + kRowGroup - 1) / kRowGroup * kRowGroup;
    // Row r = (token r / group, query head kv_head * group + r % group); padding rows stay zero.
    std::fill(q_rows.begin(), q_rows.begin() + padded_rows * head_dim, 0.0f);
    std::fill(acc.begin(), acc.begin() + padded_rows * head_dim, 0.0f);
    for (int64_t r = 0; r < padded_rows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.0f;
      std::fill(row_sum_v.begin() + r * kKeyTile, row_sum_v.begin() + (r + 1) * kKeyTile, 0.0f);
      row_pos[r] = r < rows ? first_pos + r / group : -1;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* src =
          query + (first_token + r / group) * query_stride + (item.kv_head * group + r % group) * head_dim;
      float* dst = q_rows.data() + r * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = src[d] * scale;
    }
    const int64_t* table = block_tables + item.seq * max_blocks;

    for (int64_t key0 = 0; key0 <= last_pos; key0 += kKeyTile) {
      const int64_t num_keys = std::min(kKeyTile, last_pos + 1 - key0);
      // Gather this tile's keys and values ([16][D]) through the block table, converting whole
      // rows (vectorized), then transpose the keys to [D][16] in one pass: a strided read per
      // lane is far cheaper than a scalar scatter of every key.
      fastdeploy_cpu::SlotCursor here(table, block_size, key0);
#if defined(FD_ATTENTION_V16)
      fastdeploy_cpu::SlotCursor ahead(table, block_size, key0 + kKeyTile);
#endif
      for (int64_t k = 0; k < num_keys; ++k, here.next()) {
        const int64_t offset = (here.slot() * num_kv_heads + item.kv_head) * head_dim;
        fastdeploy_cpu::load_row(key_cache + offset, key_rows.data() + k * head_dim, head_dim);
        fastdeploy_cpu::load_row(value_cache + offset, values.data() + k * head_dim, head_dim);
#if defined(FD_ATTENTION_V16)
        // The next tile's rows sit in another (random) block: start fetching them now.
        if (key0 + k + kKeyTile <= last_pos) {
          const int64_t next_offset = (ahead.slot() * num_kv_heads + item.kv_head) * head_dim;
          ahead.next();
          const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(CacheT));
          fastdeploy_cpu::prefetch_bytes(key_cache + next_offset, row_bytes, prefetch_l2);
          fastdeploy_cpu::prefetch_bytes(value_cache + next_offset, row_bytes, prefetch_l2);
        }
#endif
      }
      // Finite zeros in the unused lanes.
      std::fill(key_rows.begin() + num_keys * head_dim, key_rows.end(), 0.0f);
#if defined(FD_ATTENTION_TRANSPOSED_D64)
      if constexpr (kHeadDim == 64) {
        for (int64_t c = 0; c < 64; c += 16)
          transpose16x16(key_rows.data() + c, 64, keys_t.data() + c * kKeyTile, kKeyTile);
      } else
#endif
      {
        for (int64_t d = 0; d < head_dim; ++d) {
          const float* column = key_rows.data() + d;
          float* kd = keys_t.data() + d * kKeyTile;
#pragma omp simd
          for (int64_t k = 0; k < kKeyTile; ++k) kd[k] = column[k * head_dim];
        }
      }

      for (int64_t r0 = 0; r0 < padded_rows; r0 += kRowGroup) {
        const int64_t group_last = *std::max_element(row_pos.begin() + r0, row_pos.begin() + r0 + kRowGroup);
        if (group_last < key0) continue;  // every row of the group is before this key tile
#if defined(FD_ATTENTION_TRANSPOSED_D64)
        if constexpr (kHeadDim == 64) {
          static_assert(kKeyTile == 16 && kRowGroup == 4 && kRowGroup % kPvRows == 0, "one V16 of scores per row");
          tile_rows_d64(q_rows.data() + r0 * 64, keys_t.data(), values.data(), row_pos.data() + r0, key0, num_keys,
                        row_max.data() + r0, row_sum_v.data() + r0 * kKeyTile, probs.data() + r0 * kKeyTile,
                        acc.data() + r0 * 64);
          continue;
        }
#endif
        // Scores of kRowGroup rows x 16 keys, accumulated over the head dim in registers.
        float scores[kRowGroup][kKeyTile] = {};
        {
          for (int64_t d = 0; d < head_dim; ++d) {
            const float* kd = keys_t.data() + d * kKeyTile;
            for (int64_t rr = 0; rr < kRowGroup; ++rr) {
              const float qd = q_rows[(r0 + rr) * head_dim + d];
#pragma omp simd
              for (int64_t k = 0; k < kKeyTile; ++k) scores[rr][k] += qd * kd[k];
            }
          }
        }
        for (int64_t rr = 0; rr < kRowGroup; ++rr) {
          const int64_t r = r0 + rr;
          float* p = probs.data() + r * kKeyTile;
          const int64_t valid = std::min(num_keys, row_pos[r] - key0 + 1);  // causal: keys <= position
          if (valid <= 0) {
            std::fill(p, p + kKeyTile, 0.0f);
            continue;
          }
          float tile_max = -INFINITY;
          for (int64_t k = 0; k < valid; ++k) tile_max = std::max(tile_max, scores[rr][k]);
          const float new_max = std::max(row_max[r], tile_max);
          const float alpha = fastdeploy_cpu::exp_approx(row_max[r] - new_max);
          float tile_sum = 0.0f;
#pragma omp simd reduction(+ : tile_sum)
          for (int64_t k = 0; k < kKeyTile; ++k) {
            const float e = fastdeploy_cpu::exp_approx(scores[rr][k] - new_max);
            p[k] = k < valid ? e : 0.0f;
            tile_sum += p[k];
          }
          row_sum[r] = row_sum[r] * alpha + tile_sum;
          row_max[r] = new_max;
          float* a = acc.data() + r * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] *= alpha;
        }
        // acc += P @ V for the group's rows; masked keys have p = 0 exactly.
        {
          for (int64_t k = 0; k < num_keys; ++k) {
            const float* v = values.data() + k * head_dim;
            for (int64_t rr = 0; rr < kRowGroup; ++rr) {
              const float pk = probs[(r0 + rr) * kKeyTile + k];
              float* a = acc.data() + (r0 + rr) * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) a[d] += pk * v[d];
            }
          }
        }
      }
    }
#if defined(FD_ATTENTION_TRANSPOSED_D64)
    if constexpr (kHeadDim == 64)
      for (int64_t r = 0; r < rows; ++r) row_sum[r] = v16_reduce_add(v16_load(row_sum_v.data() + r * kKeyTile));
#endif
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / row_sum[r];
      const float* a = acc.data() + r * head_dim;
      float* dst = out + (first_token + r / group) * num_heads * head_dim +
                   (item.kv_head * group + r % group) * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = a[d] * inv;
    }
  };
  fastdeploy_cpu::for_each_attention_item(query_start_loc, seq_lens, num_seqs, num_kv_heads, group, block_size,
                                          max_blocks, make_scratch, attend);
}

#if defined(FD_ATTENTION_DIRECT_D64)
// attention_kernel for head dim 64 on AVX2, the keys and values read in place (tile_rows_d64_direct).
// Where the batch has items enough for every thread twice over, an item is a tile of a sequence's
// tokens with all its kv heads, so a key tile's cache rows (every head of a token side by side:
// 6 KB runs of a block with bf16 and 3 kv heads) are read whole rather than as one head's
// 128-byte pieces at a 384-byte stride; else (one sequence's decode) one kv head, so the heads
// still spread over the threads. Row r of the item's head hh sits at hh * rows + r, rows being one
// head's (token r / group, query head h * group + r % group). Which rows share an item changes no
// row's arithmetic.
template <typename CacheT>
void attention_kernel_direct_d64(const float* query, int64_t query_stride, const CacheT* key_cache,
                                 const CacheT* value_cache, const int64_t* block_tables, int64_t max_blocks,
                                 const int64_t* query_start_loc, const int64_t* seq_lens, int64_t num_seqs,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale,
                                 bool prefetch_l2, float* out) {
  constexpr int64_t kD = 64;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tile_tokens = std::max<int64_t>(1, fastdeploy_cpu::kAttentionTileRows / group);
  const int64_t max_rows = tile_tokens * num_heads;
  const int64_t token_row = num_kv_heads * kD;  // a token's cache row: every kv head
  // The batch's tiles of tokens: the work items of a single kv head.
  const auto token_tiles =
      static_cast<int64_t>(fastdeploy_cpu::attention_work_items(query_start_loc, num_seqs, 1, group).size());
  const int64_t item_heads = token_tiles >= 2 * omp_get_max_threads() ? num_kv_heads : 1;
  const int64_t item_bytes = item_heads * kD * static_cast<int64_t>(sizeof(CacheT));
  struct Scratch {
    std::vector<float> q_rows, acc, row_max, row_sum_v, probs;
    std::vector<int64_t> row_pos;
  };
  auto make_scratch = [&] {
    return Scratch{std::vector<float>(max_rows * kD), std::vector<float>(max_rows * kD), std::vector<float>(max_rows),
                   std::vector<float>(max_rows * kKeyTile), std::vector<float>(max_rows * kKeyTile),
                   std::vector<int64_t>(max_rows)};
  };
  auto attend = [&](Scratch& sc, const fastdeploy_cpu::AttentionWorkItem& item,
                    const fastdeploy_cpu::AttentionItemRows& at) {
    const int64_t rows = at.rows, last_pos = at.last_pos, h0 = item.kv_head * item_heads;
    for (int64_t h = h0; h < h0 + item_heads; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = (h - h0) * rows + r;
        sc.row_max[i] = -INFINITY;
        sc.row_pos[i] = at.first_pos + r / group;
        std::fill(sc.row_sum_v.begin() + i * kKeyTile, sc.row_sum_v.begin() + (i + 1) * kKeyTile, 0.0f);
        std::fill(sc.acc.begin() + i * kD, sc.acc.begin() + (i + 1) * kD, 0.0f);
        const float* src = query + (at.first_token + r / group) * query_stride + (h * group + r % group) * kD;
#pragma omp simd
        for (int64_t d = 0; d < kD; ++d) sc.q_rows[i * kD + d] = src[d] * scale;
      }
    }
    const int64_t* table = block_tables + item.seq * max_blocks;
    for (int64_t key0 = 0; key0 <= last_pos; key0 += kKeyTile) {
      const int64_t num_keys = std::min(kKeyTile, last_pos + 1 - key0);
      int64_t offsets[kKeyTile];
      fastdeploy_cpu::SlotCursor here(table, block_size, key0), ahead(table, block_size, key0 + kKeyTile);
      for (int64_t k = 0; k < num_keys; ++k, here.next()) {
        offsets[k] = here.slot() * token_row + h0 * kD;
        // The next tile's rows sit in another (random) block: start fetching them now.
        if (key0 + k + kKeyTile <= last_pos) {
          const int64_t next = ahead.slot() * token_row + h0 * kD;
          ahead.next();
          fastdeploy_cpu::prefetch_bytes(key_cache + next, item_bytes, prefetch_l2);
          fastdeploy_cpu::prefetch_bytes(value_cache + next, item_bytes, prefetch_l2);
        }
      }
      for (int64_t hh = 0; hh < item_heads; ++hh) {
        const CacheT* keys[kKeyTile];
        const CacheT* vals[kKeyTile];
        for (int64_t k = 0; k < num_keys; ++k) {
          keys[k] = key_cache + offsets[k] + hh * kD;
          vals[k] = value_cache + offsets[k] + hh * kD;
        }
        for (int64_t r0 = hh * rows; r0 < (hh + 1) * rows; r0 += kRowGroup) {
          const int64_t n = std::min(kRowGroup, (hh + 1) * rows - r0);
          if (sc.row_pos[r0 + n - 1] < key0) continue;  // causal: every row of the group is before the tile
          tile_rows_d64_direct(n, sc.q_rows.data() + r0 * kD, keys, vals, sc.row_pos.data() + r0, key0, num_keys,
                               sc.row_max.data() + r0, sc.row_sum_v.data() + r0 * kKeyTile,
                               sc.probs.data() + r0 * kKeyTile, sc.acc.data() + r0 * kD);
        }
      }
    }
    for (int64_t h = h0; h < h0 + item_heads; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = (h - h0) * rows + r;
        const float inv = 1.0f / v16_reduce_add(v16_load(sc.row_sum_v.data() + i * kKeyTile));
        float* dst = out + (at.first_token + r / group) * num_heads * kD + (h * group + r % group) * kD;
#pragma omp simd
        for (int64_t d = 0; d < kD; ++d) dst[d] = sc.acc[i * kD + d] * inv;
      }
    }
  };
  // Items of item_heads kv heads each: the items of num_kv_heads / item_heads (one or all) heads.
  fastdeploy_cpu::for_each_attention_item(query_start_loc, seq_lens, num_seqs, num_kv_heads / item_heads, group,
                                          block_size, max_blocks, make_scratch, attend);
}
#endif

template <typename CacheT>
void dispatch_head_dim(int64_t head_dim, const float* query, int64_t query_stride, const CacheT* key_cache,
                       const CacheT* value_cache, const int64_t* block_tables, int64_t max_blocks,
                       const int64_t* query_start_loc, const int64_t* seq_lens, int64_t num_seqs, int64_t num_heads,
                       int64_t num_kv_heads, int64_t block_size, float scale, bool prefetch_l2, float* out) {
#if defined(FD_ATTENTION_DIRECT_D64)
  if (head_dim == 64) {
    attention_kernel_direct_d64(query, query_stride, key_cache, value_cache, block_tables, max_blocks, query_start_loc,
                                seq_lens, num_seqs, num_heads, num_kv_heads, block_size, scale, prefetch_l2, out);
    return;
  }
#endif
  // Compile-time copies for the common head sizes, the runtime-sized one for the rest.
  auto kernel = head_dim == 64    ? attention_kernel<64, CacheT>
                : head_dim == 128 ? attention_kernel<128, CacheT>
                                  : attention_kernel<0, CacheT>;
  kernel(query, query_stride, key_cache, value_cache, block_tables, max_blocks, query_start_loc, seq_lens, num_seqs,
         num_heads, num_kv_heads, head_dim, block_size, scale, prefetch_l2, out);
}

}  // namespace

namespace fastdeploy_cpu {

std::vector<AttentionWorkItem> attention_work_items(const int64_t* query_start_loc, int64_t num_seqs,
                                                    int64_t num_kv_heads, int64_t group) {
  const int64_t tile_tokens = std::max<int64_t>(1, kAttentionTileRows / group);
  std::vector<AttentionWorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t num_queries = query_start_loc[s + 1] - query_start_loc[s];
    for (int64_t t0 = 0; t0 < num_queries; t0 += tile_tokens)
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({s, h, t0, std::min(tile_tokens, num_queries - t0)});
  }
  return items;
}

void paged_attention(const float* query, int64_t query_stride, const paddle::Tensor& key_cache,
                     const paddle::Tensor& value_cache, const int64_t* block_tables, int64_t max_blocks,
                     const int64_t* query_start_loc, const int64_t* seq_lens, int64_t num_seqs, int64_t num_heads,
                     float scale, int attn_isa, float* out) {
  const bool prefetch_l2 = (attn_isa & kAttentionPrefetchL2) != 0;
  attn_isa &= ~kAttentionPrefetchL2;
  const int64_t block_size = key_cache.shape()[1];
  const int64_t num_kv_heads = key_cache.shape()[2];
  const int64_t head_dim = key_cache.shape()[3];
  static const bool amx_usable = amx_bf16_usable();  // asked once, not per layer and step
  PD_CHECK(attn_isa != kAttentionAmxBf16 || amx_usable,
           "paged_attention: attn_isa 2 (AMX) needs AMX-BF16 tiles, which this CPU or process cannot use.");
  if (is_bf16(key_cache) && (attn_isa == kAttentionBf16 || attn_isa == kAttentionAmxBf16) &&
      paged_attention_bf16(query, query_stride, static_cast<const uint16_t*>(key_cache.data()),
                           static_cast<const uint16_t*>(value_cache.data()), block_tables, max_blocks,
                           query_start_loc, seq_lens, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                           attn_isa == kAttentionAmxBf16, prefetch_l2, out)) {
    return;
  }
  if (is_bf16(key_cache)) {
    dispatch_head_dim(head_dim, query, query_stride, static_cast<const uint16_t*>(key_cache.data()),
                      static_cast<const uint16_t*>(value_cache.data()), block_tables, max_blocks, query_start_loc,
                      seq_lens, num_seqs, num_heads, num_kv_heads, block_size, scale, prefetch_l2, out);
  } else {
    check_dtype(key_cache, paddle::DataType::FLOAT32, "key_cache");
    dispatch_head_dim(head_dim, query, query_stride, key_cache.data<float>(), value_cache.data<float>(),
                      block_tables, max_blocks, query_start_loc, seq_lens, num_seqs, num_heads, num_kv_heads,
                      block_size, scale, prefetch_l2, out);
  }
}

}  // namespace fastdeploy_cpu

// query [T, W] float32 whose first H * D columns are the queries (the fused QKV buffer works as is),
// caches [num_blocks, block_size, KVH, D] float32 or bfloat16, block_tables [S, max_blocks] int64,
// query_start_loc [S + 1] int64, seq_lens [S] int64 -> out [T, H * D] float32.
std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& query, const paddle::Tensor& key_cache,
                                           const paddle::Tensor& value_cache, const paddle::Tensor& block_tables,
                                           const paddle::Tensor& query_start_loc, const paddle::Tensor& seq_lens,
                                           int num_heads, float scale, int attn_isa) {
  using fastdeploy_cpu::check_cpu_contiguous;
  using fastdeploy_cpu::check_dtype;
  check_cpu_contiguous(query, "query");
  check_cpu_contiguous(key_cache, "key_cache");
  check_cpu_contiguous(value_cache, "value_cache");
  check_cpu_contiguous(block_tables, "block_tables");
  check_cpu_contiguous(query_start_loc, "query_start_loc");
  check_cpu_contiguous(seq_lens, "seq_lens");
  check_dtype(query, paddle::DataType::FLOAT32, "query");
  check_dtype(block_tables, paddle::DataType::INT64, "block_tables");
  check_dtype(query_start_loc, paddle::DataType::INT64, "query_start_loc");
  check_dtype(seq_lens, paddle::DataType::INT64, "seq_lens");
  PD_CHECK(key_cache.shape().size() == 4 && key_cache.dtype() == value_cache.dtype(),
           "paged_attention: caches must be [num_blocks, block_size, KVH, D] of one dtype.");
  PD_CHECK(query.shape().size() == 2, "paged_attention: query must be [T, W].");
  const int64_t block_size = key_cache.shape()[1];
  const int64_t num_kv_heads = key_cache.shape()[2];
  const int64_t head_dim = key_cache.shape()[3];
  const int64_t num_tokens = query.shape()[0];
  const int64_t num_seqs = seq_lens.numel();
  PD_CHECK(num_heads % num_kv_heads == 0, "paged_attention: num_heads must be a multiple of the kv heads.");
  PD_CHECK(query.shape()[1] >= num_heads * head_dim, "paged_attention: query is narrower than H * D.");
  PD_CHECK(query_start_loc.numel() == num_seqs + 1, "paged_attention: query_start_loc needs S + 1 entries.");
  PD_CHECK(block_tables.shape().size() == 2 && block_tables.shape()[0] >= num_seqs,
           "paged_attention: block_tables must be [S, max_blocks].");
  PD_CHECK(num_seqs == 0 || query_start_loc.data<int64_t>()[num_seqs] <= num_tokens,
           "paged_attention: query_start_loc points past the query rows.");
  auto out = paddle::empty({num_tokens, num_heads * head_dim}, paddle::DataType::FLOAT32, query.place());
  fastdeploy_cpu::paged_attention(query.data<float>(), query.shape()[1], key_cache, value_cache,
                                  block_tables.data<int64_t>(), block_tables.shape()[1],
                                  query_start_loc.data<int64_t>(), seq_lens.data<int64_t>(), num_seqs, num_heads,
                                  scale, attn_isa, out.data<float>());
  return {out};
}

PD_BUILD_OP(fd_paged_attention)
    .Inputs({"query", "key_cache", "value_cache", "block_tables", "query_start_loc", "seq_lens"})
    .Outputs({"out"})
    .Attrs({"num_heads: int", "scale: float", "attn_isa: int"})
    .SetKernelFn(PD_KERNEL(PagedAttention));
