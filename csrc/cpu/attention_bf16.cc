// Paged attention over bf16 caches with AVX512-BF16 dot products (`vdpbf16ps`: per fp32 lane, the
// sum of two bf16 products). The work items, key tiles of 16, causal skipping and online softmax
// are attention.cc's; what differs is that keys and values are never widened: attention.cc converts
// every cached key and value to fp32 and transposes the keys in fp32 before multiplying, which at
// decode (three query rows per kv head) costs more than the multiplies. Here
//   scores: the keys of a tile, as pairs of bf16 per 32-bit lane, transposed in registers to
//           [D/2 pairs][16 keys]; each pair step is one dot instruction per query row against the
//           row's (scaled, bf16-rounded) query pair broadcast from memory;
//   P @ V:  the probabilities rounded to bf16, two keys' values interleaved per lane
//           (unpack of two rows), one dot instruction per 16 output lanes and row for two keys.
// The output lanes of P @ V come out in the unpack's order and are put back in order once per
// row at the end. The row sums are of the rounded probabilities, so each row's weights sum to
// one as used. Every query row takes the same instructions in the same order whatever else is in
// its tile or batch, so outputs stay batch-invariant.
//
// On AMX (attn_isa == kAttentionAmxBf16) the scores come from tiles instead: the keys, 16 rows of
// a key tile in the cache as they are (or copied together where a tile spans blocks or is part
// filled), are an A tile, the rows' queries as pairs the B tile, and tdpbf16ps sums each key's
// products for 16 query rows at once; no transpose and no score dots. The scores of a row are
// then a column of the stored C tile, gathered. The tile multiply, store and gathers keep a tile's
// softmax waiting, so the next tile's scores are multiplied before this tile's softmax and P @ V
// (two score buffers) and run beside them; one tile at a time the path was no faster than the
// dot products. P @ V is the same on both paths. A row's scores depend only on its query and the
// keys, whatever shares the C tile.
//
// The code is compiled for AVX512-BF16 and AMX whatever -march the library is built with (a target
// region); it runs only where the platform chose it (attn_isa kAttentionBf16 / kAttentionAmxBf16).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 10 || defined(__clang__))
#define FD_ATTENTION_BF16 1
#include <immintrin.h>
#endif

#if defined(FD_ATTENTION_BF16)
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
namespace attn_bf16 {

#include "transpose16_impl.h"
#include "exp_approx16_impl.h"

constexpr int64_t kKeys = 16;      // keys per tile: one register of fp32 scores
constexpr int64_t kGroupRows = 4;  // most query rows sharing each key-pair load
// A tile of a decode takes ~0.15 us, about one memory latency: fetching one tile ahead left it
// waiting. Two tiles ahead ran 16 decodes over 1,000 tokens 9% faster (over 330: 2-4%) with the
// caches of 30 layers streamed from memory; three were slower again. An item's last tiles fetch
// the next item's first ones, which were otherwise read cold: 16 decodes over 330 tokens
// streamed 244 -> 206 us, the gguf decode step at batch 16 3.8-4.9% faster (interleaved A/B).
// Where the lines go is the platform's choice (kAttentionPrefetchL2): into L1 on Sapphire Rapids,
// where L2 was no faster; into L2 on AMD EPYCs (Zen 4: the same decodes streamed 680-860 -> 415-550
// us, one process, interleaved).
constexpr int64_t kPrefetchTiles = 2;
constexpr int64_t kPrefetchKeys = kPrefetchTiles * kKeys;

// acc + w . x (bf16 pairs per lane) with x's one pair in every lane (GCC folds the broadcast into
// the instruction's memory operand). A value, not an asm on a reference: accumulators held in
// arrays then stay in registers.
inline __m512 dot_bcast(__m512 acc, __m512i w, const uint32_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(static_cast<int>(*x)));
}

// 16 fp32 -> 16 bf16 (round to nearest even) and the rounded values back in fp32.
inline __m256i round_bf16(__m512 v, __m512* rounded) {
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
  *rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  return b;
}

template <int D, bool kAmx>
void kernel(const float* query, int64_t query_stride, const uint16_t* key_cache, const uint16_t* value_cache,
            const int64_t* block_tables, int64_t max_blocks, const int64_t* query_start_loc, const int64_t* seq_lens,
            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale,
            bool prefetch_l2, float* out) {
  constexpr int kPairs = D / 2;     // 32-bit lanes of a bf16 row
  constexpr int kChunks = D / 32;   // registers of a bf16 row
  constexpr int kAccVecs = D / 16;  // fp32 registers of an output row
  constexpr int kPvRows = D <= 64 ? 4 : 2;  // rows of accumulators in the 32 registers at once
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tile_tokens = std::max<int64_t>(1, fastdeploy_cpu::kAttentionTileRows / group);
  const int64_t max_rows = tile_tokens * group;
  constexpr int kTileRows = 16;  // query rows per C tile (AMX)
  const int64_t row_groups = (max_rows + kTileRows - 1) / kTileRows;
  const int64_t key_stride = num_kv_heads * D;  // elements between a block's consecutive slots

  // Output lane t of half q of a 32-lane chunk reads lane idx of the chunk's unpacklo (bit 4 clear)
  // or unpackhi (bit 4 set) accumulator: unpack interleaves 4 of every 8 lanes per 128-bit lane.
  alignas(64) int32_t unpermute[2][16];
  for (int q = 0; q < 2; ++q)
    for (int t = 0; t < 16; ++t) unpermute[q][t] = (((t >> 2) & 1) << 4) | (8 * q + 4 * (t >> 3) + (t & 3));

  // One thread's buffers.
  struct Scratch {
    std::vector<uint32_t> q_pairs, keys_t, value_pairs;
    std::vector<float> acc, row_max, row_sum;
    std::vector<uint16_t> probs_bf;
    std::vector<int64_t> row_pos;
    // AMX: the queries as B tiles ([row group][chunk][pair][16 rows]), each group's C tile of
    // scores ([16 keys][16 rows]) and a key tile copied together where it cannot load in place.
    std::vector<uint32_t> q_tiles;
    std::vector<float> scores_t;
    std::vector<uint16_t> keys_copy;
  };
  auto make_scratch = [&] {
    return Scratch{std::vector<uint32_t>(max_rows * kPairs), std::vector<uint32_t>(kPairs * kKeys),
                   std::vector<uint32_t>(kKeys / 2 * kAccVecs * 16), std::vector<float>(max_rows * D),
                   std::vector<float>(max_rows), std::vector<float>(max_rows * kKeys),
                   std::vector<uint16_t>(max_rows * kKeys), std::vector<int64_t>(max_rows),
                   std::vector<uint32_t>(kAmx ? row_groups * kChunks * 16 * kTileRows : 0),
                   std::vector<float>(kAmx ? 2 * row_groups * kKeys * kTileRows : 0),
                   std::vector<uint16_t>(kAmx ? kKeys * D : 0)};
  };
  auto attend = [&](Scratch& sc, const fastdeploy_cpu::AttentionWorkItem& item,
                    const fastdeploy_cpu::AttentionItemRows& at) {
    auto &q_pairs = sc.q_pairs, &keys_t = sc.keys_t, &value_pairs = sc.value_pairs;
    auto &acc = sc.acc, &row_max = sc.row_max, &row_sum = sc.row_sum;
    auto& probs_bf = sc.probs_bf;
    auto& row_pos = sc.row_pos;
    const auto& tile_scores = sc.scores_t;
    const __m512i key_lanes = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(kTileRows));
    const int64_t rows = at.rows, first_token = at.first_token, first_pos = at.first_pos, last_pos = at.last_pos;
    // One pass of P @ V covers every row (a decode's group of heads): values are unpacked where multiplied.
    const bool one_pass = rows <= std::min<int64_t>(kGroupRows, kPvRows);
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < rows; ++r) {
      row_max[r] = -INFINITY;
      row_pos[r] = first_pos + r / group;
      _mm512_storeu_ps(row_sum.data() + r * kKeys, _mm512_setzero_ps());
      for (int u = 0; u < kAccVecs; ++u) _mm512_storeu_ps(acc.data() + r * D + u * 16, _mm512_setzero_ps());
      uint32_t* qp = q_pairs.data() + r * kPairs;
      const float* src =
          query + (first_token + r / group) * query_stride + (item.kv_head * group + r % group) * D;
      for (int c = 0; c < kChunks; ++c) {
        const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(src + c * 32), scale_v);
        const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(src + c * 32 + 16), scale_v);
        _mm512_storeu_si512(qp + c * 16, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
    const int64_t num_groups = (rows + kTileRows - 1) / kTileRows;
    if constexpr (kAmx) {
      // B tile (g, c): row p holds pair c * 16 + p of the group's 16 query rows (zeros past the last).
      std::fill(sc.q_tiles.begin(), sc.q_tiles.begin() + num_groups * kChunks * 16 * kTileRows, 0u);
      for (int64_t r = 0; r < rows; ++r)
        for (int c = 0; c < kChunks; ++c)
          for (int p = 0; p < 16; ++p)
            sc.q_tiles[(((r / kTileRows) * kChunks + c) * 16 + p) * kTileRows + r % kTileRows] =
                q_pairs[r * kPairs + c * 16 + p];
      fastdeploy_cpu::TileConfig cfg;
      for (int t = 0; t < 3; ++t) {  // 0: C, 1: A (16 keys x 32 dims), 2: B (16 pairs x 16 rows)
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
      }
      _tile_loadconfig(&cfg);
    }
    const int64_t* table = block_tables + item.seq * max_blocks;
    // Past this item's last keys the prefetch runs on into the next item's first ones (within its
    // block table's row whatever its seq_lens says: that item checks its own context when it runs).
    const int64_t next_keys =
        at.next == nullptr
            ? 0
            : std::max<int64_t>(0, std::min({kPrefetchKeys, seq_lens[at.next->seq], max_blocks * block_size}));
    fastdeploy_cpu::SlotCursor next_cursor(at.next != nullptr ? block_tables + at.next->seq * max_blocks : table,
                                           block_size, 0);
    int64_t next_fetched = 0;

    // AMX: the scores of the tile at tile_key0 into buffer `buf` ([row group][16 keys][16 rows]). A
    // block's 16 slots load in place as the A tile; a tile spanning blocks or part filled is copied
    // together first (missing keys as zeros: finite scores, masked below).
    // More than a decode's few rows read their scores from the C tile transposed once (16 loads, 64
    // shuffles) rather than gathered (16 loads per row).
    const bool transpose_scores = rows > kGroupRows;
    auto amx_scores = [&](int64_t tile_key0, int buf) {
      const int64_t n = std::min(kKeys, last_pos + 1 - tile_key0);
      const uint16_t* a;
      int64_t a_stride = key_stride;
      if (n == kKeys && block_size % kKeys == 0) {
        a = key_cache + (fastdeploy_cpu::SlotCursor(table, block_size, tile_key0).slot() * num_kv_heads +
                         item.kv_head) * D;
      } else {
        fastdeploy_cpu::SlotCursor cur(table, block_size, tile_key0);
        for (int64_t k = 0; k < kKeys; ++k) {
          uint16_t* dst = sc.keys_copy.data() + k * D;
          if (k < n) {
            std::memcpy(dst, key_cache + (cur.slot() * num_kv_heads + item.kv_head) * D, D * sizeof(uint16_t));
            cur.next();
          } else {
            std::memset(dst, 0, D * sizeof(uint16_t));
          }
        }
        a = sc.keys_copy.data();
        a_stride = D;
      }
      float* st = sc.scores_t.data() + buf * row_groups * kKeys * kTileRows;
      for (int64_t g = 0; g < num_groups; ++g) {
        if (row_pos[std::min(rows, (g + 1) * kTileRows) - 1] < tile_key0) continue;  // every row is before it
        _tile_zero(0);
        for (int c = 0; c < kChunks; ++c) {
          _tile_loadd(1, a + c * 32, a_stride * sizeof(uint16_t));
          _tile_loadd(2, sc.q_tiles.data() + (g * kChunks + c) * 16 * kTileRows, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, st + g * kKeys * kTileRows, 64);
        if (transpose_scores) {  // [16 keys][16 rows] -> [16 rows][16 keys]
          __m512 t[16];
          for (int k = 0; k < 16; ++k) t[k] = _mm512_loadu_ps(st + g * kKeys * kTileRows + k * kTileRows);
          transpose16x16_regs(t);
          for (int k = 0; k < 16; ++k) _mm512_storeu_ps(st + g * kKeys * kTileRows + k * kTileRows, t[k]);
        }
      }
    };
    if constexpr (kAmx) amx_scores(0, 0);

    for (int64_t key0 = 0; key0 <= last_pos; key0 += kKeys) {
      const int64_t num_keys = std::min(kKeys, last_pos + 1 - key0);
      const uint16_t* key_rows[kKeys];
      const uint16_t* value_rows[kKeys];
      // Slot cursors for this tile and (to prefetch, its rows sit in other, random blocks) the one
      // kPrefetchTiles on.
      fastdeploy_cpu::SlotCursor here(table, block_size, key0), ahead(table, block_size, key0 + kPrefetchKeys);
      const int64_t num_ahead = std::min(kKeys, last_pos + 1 - (key0 + kPrefetchKeys));
      for (int64_t k = 0; k < num_keys; ++k, here.next()) {
        const int64_t offset = (here.slot() * num_kv_heads + item.kv_head) * D;
        key_rows[k] = key_cache + offset;
        value_rows[k] = value_cache + offset;
        int64_t next_offset = -1;
        if (k < num_ahead) {
          next_offset = (ahead.slot() * num_kv_heads + item.kv_head) * D;
          ahead.next();
        } else if (next_fetched < next_keys) {
          next_offset = (next_cursor.slot() * num_kv_heads + at.next->kv_head) * D;
          next_cursor.next();
          ++next_fetched;
        }
        if (next_offset >= 0) {
          fastdeploy_cpu::prefetch_bytes(key_cache + next_offset, D * 2, prefetch_l2);
          fastdeploy_cpu::prefetch_bytes(value_cache + next_offset, D * 2, prefetch_l2);
        }
      }
      // AMX: the next tile's scores multiply while this tile's softmax and P @ V run.
      if constexpr (kAmx) {
        if (key0 + kKeys <= last_pos) amx_scores(key0 + kKeys, ((key0 / kKeys) + 1) & 1);
      }
      // Keys as [pair][key] for the score dots; keys past num_keys are zeros (finite scores, masked below).
      if constexpr (!kAmx) {
        for (int c = 0; c < kChunks; ++c) {
          __m512 r[16];
          for (int64_t k = 0; k < kKeys; ++k)
            r[k] = k < num_keys ? _mm512_loadu_ps(reinterpret_cast<const float*>(key_rows[k] + c * 32))
                                : _mm512_setzero_ps();
          transpose16x16_regs(r);
          float* kt = reinterpret_cast<float*>(keys_t.data()) + c * 16 * kKeys;
          for (int j = 0; j < 16; ++j) _mm512_storeu_ps(kt + j * kKeys, r[j]);
        }
      }
      // Values of keys (2i, 2i + 1) interleaved per lane (chunk c: unpacklo, then unpackhi); a missing odd key
      // is zeros. An item of one pass of rows (a decode's group of heads) unpacks them where it multiplies;
      // more rows read them from value_pairs, unpacked once per tile.
      const int64_t num_pairs = (num_keys + 1) / 2;
      auto unpack_values = [&](int64_t i, __m512i* v) {
        for (int c = 0; c < kChunks; ++c) {
          const __m512i a = _mm512_loadu_si512(value_rows[2 * i] + c * 32);
          const __m512i b =
              2 * i + 1 < num_keys ? _mm512_loadu_si512(value_rows[2 * i + 1] + c * 32) : _mm512_setzero_si512();
          v[2 * c] = _mm512_unpacklo_epi16(a, b);
          v[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
        }
      };
      if (!one_pass)
        for (int64_t i = 0; i < num_pairs; ++i) {
          __m512i v[kAccVecs];
          unpack_values(i, v);
          for (int u = 0; u < kAccVecs; ++u) _mm512_storeu_si512(value_pairs.data() + (i * kAccVecs + u) * 16, v[u]);
        }

      // R rows from r0 (R <= kGroupRows, known when compiled: no padding rows are multiplied).
      auto rows_tile = [&](auto rows_c, int64_t r0) {
        constexpr int R = decltype(rows_c)::value;
        if (row_pos[r0 + R - 1] < key0) return;  // positions ascend: every row is before this key tile
        // Scores: two chains per row (even and odd pairs) keep the dot unit busy.
        __m512 s[R][2];
        for (int rr = 0; rr < R; ++rr) s[rr][0] = s[rr][1] = _mm512_setzero_ps();
        if constexpr (!kAmx) {
#pragma GCC unroll 4
          for (int j = 0; j < kPairs; j += 2) {
            const __m512i k0 = _mm512_loadu_si512(keys_t.data() + j * kKeys);
            const __m512i k1 = _mm512_loadu_si512(keys_t.data() + (j + 1) * kKeys);
#pragma GCC unroll 4
            for (int rr = 0; rr < R; ++rr) {
              const uint32_t* qp = q_pairs.data() + (r0 + rr) * kPairs + j;
              s[rr][0] = dot_bcast(s[rr][0], k0, qp);
              s[rr][1] = dot_bcast(s[rr][1], k1, qp + 1);
            }
          }
        }
        float alpha[R];
        for (int rr = 0; rr < R; ++rr) {
          const int64_t r = r0 + rr;
          uint16_t* pb = probs_bf.data() + r * kKeys;
          const int64_t valid = std::min(num_keys, row_pos[r] - key0 + 1);  // causal: keys <= position
          if (valid <= 0) {  // acc * 1 + 0 * v: the row is unchanged
            std::fill(pb, pb + kKeys, uint16_t{0});
            alpha[rr] = 1.0f;
            continue;
          }
          // AMX: the row's column of its group's C tile (key k at k * 16), or its row once transposed.
          const float* st =
              tile_scores.data() + ((key0 / kKeys) & 1) * row_groups * kKeys * kTileRows + (r / kTileRows) * kKeys * kTileRows;
          const __m512 sc = !kAmx              ? _mm512_add_ps(s[rr][0], s[rr][1])
                            : transpose_scores ? _mm512_loadu_ps(st + (r % kTileRows) * kKeys)
                                               : _mm512_i32gather_ps(key_lanes, st + r % kTileRows, 4);
          const __mmask16 keep = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1u);
          const float tile_max = _mm512_reduce_max_ps(_mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), sc));
          // Most tiles after the first few do not raise the running max: alpha is then exactly 1 (as
          // exp_approx(0) is) and the scalar exp is skipped.
          alpha[rr] = 1.0f;
          if (tile_max > row_max[r]) {
            alpha[rr] = fastdeploy_cpu::exp_approx(row_max[r] - tile_max);
            row_max[r] = tile_max;
          }
          const __m512 p = _mm512_maskz_mov_ps(keep, exp_approx16(_mm512_sub_ps(sc, _mm512_set1_ps(row_max[r]))));
          __m512 rounded;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb), round_bf16(p, &rounded));
          // Lane-wise running sums, reduced once per row at the end.
          float* sum = row_sum.data() + r * kKeys;
          _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), _mm512_set1_ps(alpha[rr]), rounded));
        }
        // P @ V for P rows from r0 + rp.
        auto pv = [&](auto count_c, int rp) {
          constexpr int P = decltype(count_c)::value;
          __m512 a[P][kAccVecs];
          for (int rr = 0; rr < P; ++rr) {
            const __m512 al = _mm512_set1_ps(alpha[rp + rr]);
            for (int u = 0; u < kAccVecs; ++u)
              a[rr][u] = _mm512_mul_ps(_mm512_loadu_ps(acc.data() + (r0 + rp + rr) * D + u * 16), al);
          }
          for (int64_t i = 0; i < num_pairs; ++i) {
            __m512i v[kAccVecs];
            if (one_pass) {
              unpack_values(i, v);
            } else {
#pragma GCC unroll 8
              for (int u = 0; u < kAccVecs; ++u)
                v[u] = _mm512_loadu_si512(value_pairs.data() + (i * kAccVecs + u) * 16);
            }
#pragma GCC unroll 4
            for (int rr = 0; rr < P; ++rr) {
              const uint32_t* pp = reinterpret_cast<const uint32_t*>(probs_bf.data() + (r0 + rp + rr) * kKeys) + i;
#pragma GCC unroll 8
              for (int u = 0; u < kAccVecs; ++u) a[rr][u] = dot_bcast(a[rr][u], v[u], pp);
            }
          }
          for (int rr = 0; rr < P; ++rr)
            for (int u = 0; u < kAccVecs; ++u) _mm512_storeu_ps(acc.data() + (r0 + rp + rr) * D + u * 16, a[rr][u]);
        };
        if constexpr (R <= kPvRows) {
          pv(std::integral_constant<int, R>{}, 0);
        } else {
          pv(std::integral_constant<int, kPvRows>{}, 0);
          pv(std::integral_constant<int, R - kPvRows>{}, kPvRows);
        }
      };
      for (int64_t r0 = 0; r0 < rows; r0 += kGroupRows) {
        switch (std::min(kGroupRows, rows - r0)) {
          case 1: rows_tile(std::integral_constant<int, 1>{}, r0); break;
          case 2: rows_tile(std::integral_constant<int, 2>{}, r0); break;
          case 3: rows_tile(std::integral_constant<int, 3>{}, r0); break;
          default: rows_tile(std::integral_constant<int, 4>{}, r0); break;
        }
      }
    }
    const __m512i idx0 = _mm512_load_si512(unpermute[0]), idx1 = _mm512_load_si512(unpermute[1]);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(row_sum.data() + r * kKeys)));
      const float* a = acc.data() + r * D;
      float* dst = out + (first_token + r / group) * num_heads * D + (item.kv_head * group + r % group) * D;
      for (int c = 0; c < kChunks; ++c) {
        const __m512 lo = _mm512_loadu_ps(a + 2 * c * 16), hi = _mm512_loadu_ps(a + (2 * c + 1) * 16);
        _mm512_storeu_ps(dst + c * 32, _mm512_mul_ps(_mm512_permutex2var_ps(lo, idx0, hi), inv));
        _mm512_storeu_ps(dst + c * 32 + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, idx1, hi), inv));
      }
    }
    if constexpr (kAmx) _tile_release();
  };
  fastdeploy_cpu::for_each_attention_item(query_start_loc, seq_lens, num_seqs, num_kv_heads, group, block_size,
                                          max_blocks, make_scratch, attend);
}

}  // namespace attn_bf16
#pragma GCC pop_options
#endif

namespace fastdeploy_cpu {

bool paged_attention_bf16(const float* query, int64_t query_stride, const uint16_t* key_cache,
                          const uint16_t* value_cache, const int64_t* block_tables, int64_t max_blocks,
                          const int64_t* query_start_loc, const int64_t* seq_lens, int64_t num_seqs,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                          bool amx, bool prefetch_l2, float* out) {
#if defined(FD_ATTENTION_BF16)
  auto kernel = head_dim == 64    ? (amx ? attn_bf16::kernel<64, true> : attn_bf16::kernel<64, false>)
                : head_dim == 128 ? (amx ? attn_bf16::kernel<128, true> : attn_bf16::kernel<128, false>)
                                  : nullptr;
  if (kernel == nullptr) return false;
  kernel(query, query_stride, key_cache, value_cache, block_tables, max_blocks, query_start_loc, seq_lens, num_seqs,
         num_heads, num_kv_heads, block_size, scale, prefetch_l2, out);
  return true;
#else
  return false;
#endif
}

}  // namespace fastdeploy_cpu
