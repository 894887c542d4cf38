// The kernels as plain functions, shared by their own ops and by the fused decoder-layer op.
// Arguments are raw fp32 buffers (row-major, contiguous); caches are Paddle tensors because
// their element type (fp32 or bf16) is chosen at run time.
#pragma once

#include <cstdint>
#include <vector>

#include "paddle/extension.h"

namespace fastdeploy_cpu {

// linear.cc (oneDNN): out[m, n] = x[m, k] @ W + bias, W packed by fd_linear_pack in bf16 or fp32.
bool linear_packed_size_ok(int64_t packed_bytes, int64_t k, int64_t n, bool bf16);
void linear_forward(const float* x, int64_t m, int64_t k, const void* packed, const float* bias, int64_t n, bool bf16,
                    float* out);

// Which kernel runs the linears, fixed at build time by -march=native: oneDNN where the CPU has
// bf16 dot products (AMX-BF16 / AVX512-BF16); else, with AVX2 + FMA, the panel kernel of
// panel_gemm.cc for fp32 and bf16 weights alike; else oneDNN (fp32 only in practice).
#if defined(__AVX512BF16__) || defined(__AMX_BF16__) || !(defined(__AVX2__) && defined(__FMA__))
constexpr bool kPanelGemm = false;
#else
constexpr bool kPanelGemm = true;
#endif

// panel_gemm.cc: W [K, N] packed as [N/16][K][16] fp32 or bf16; with bf16 the activations are
// rounded to bf16 too; fp32 FMAs either way.
int64_t panel_packed_bytes(int64_t k, int64_t n, bool bf16);
void panel_pack(const float* w, int64_t k, int64_t n, bool bf16, void* packed);
void panel_unpack(const void* packed, int64_t k, int64_t n, bool bf16, float* w);
void panel_gemm(const float* x, int64_t m, int64_t k, const void* packed, bool bf16, const float* bias, int64_t n,
                float* out);

// gguf_gemm.cc: out[m, n] = x[m, k] @ W^T (+ bias) from GGUF blocks. W is the rows of
// consecutive segments, each `rows` rows of one ggml type (segments: (type, rows) pairs),
// packed by gguf_pack; activations are quantized per 32 elements to int8. isa: one of the paths below.
enum GgufIsa : int { kGgufScalar = 0, kGgufAvx2 = 1, kGgufAvx512Vnni = 2, kGgufAmxInt8 = 3 };
// Bytes of one row of k elements of ggml type `type`; -1 without a kernel or for a k off its block.
int64_t gguf_row_bytes(int type, int64_t k);
// Bytes of `rows` such rows in the kernel's packed layout; -1 as gguf_row_bytes.
int64_t gguf_packed_bytes(int type, int64_t rows, int64_t k);
void gguf_pack(const uint8_t* w, const int64_t* segments, int64_t num_segments, int64_t k, uint8_t* out);
void gguf_gemm(const float* x, int64_t m, int64_t k, const uint8_t* w, const int64_t* segments, int64_t num_segments,
               const float* bias, int64_t n, int isa, float* out);
// Rows ids[0..count) of a packed table of ggml type `type` (rows of k elements), dequantized to fp32 [count, k].
void gguf_dequantize_rows(const uint8_t* w, int type, int64_t k, const int64_t* ids, int64_t count, float* out);

// moe.cc: out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), each expert a SwiGLU MLP whose
// weights are packed by fd_linear_pack: w13 + e * w13_stride is expert e's [H, 2I] gate|up, w2 + e * w2_stride
// its [I, H] down projection.
void fused_moe(const float* x, int64_t num_tokens, int64_t hidden, const int64_t* topk_ids,
               const float* topk_weights, int64_t top_k, const uint8_t* w13, int64_t w13_stride, const uint8_t* w2,
               int64_t w2_stride, int64_t num_experts, int64_t inter, bool bf16, float* out);

// int_gemm.cc: out[m, n] = x[m, k] @ W (+ bias) with W integers (8 bits per channel, or 4 bits
// per group of `group` rows of K) in 16-column panels, widened in registers (to fp32, or to bf16
// on the AVX512-BF16 and AMX paths).
enum IntIsa : int { kIntScalar = 0, kIntAvx2 = 1, kIntAvx512 = 2, kIntAvx512Bf16 = 3, kIntAmxBf16 = 4 };
constexpr int64_t kIntPanel = 16;
// An int4 panel is 64-byte blocks of four k pairs (16-bit word 2c + h of a block holds column c's rows
// 2i + h of its pairs i = 0..3 in nibble i; fastdeploy/.../int_kernels.py's pack_int4), zeros past K.
constexpr int64_t kInt4BlockPairs = 4;
inline int64_t int4_panel_bytes(int64_t k) {
  return (k / 2 + kInt4BlockPairs - 1) / kInt4BlockPairs * kInt4BlockPairs * kIntPanel;
}
int64_t int_packed_bytes(int bits, int64_t k, int64_t n);
// A linear layer's integer weight in one buffer: the panels, then the fp32 scales, then (int4) the
// mins (int_kernels.py's linear_buffer); int_linear_bytes is its size (0 for bits other than 8 / 4,
// or int4 without an even K and group), int_linear_parts its pieces.
struct IntLinearParts {
  const uint8_t* w;
  const float* scales;
  const float* mins;  // null for int8
};
int64_t int_linear_bytes(int bits, int64_t k, int64_t n, int64_t group);
IntLinearParts int_linear_parts(const uint8_t* buffer, int bits, int64_t k, int64_t n, int64_t group);
void int_gemm(const float* x, int64_t m, int64_t k, const uint8_t* w, int bits, int64_t group, const float* scales,
              const float* mins, const float* bias, int64_t n, int isa, float* out);

// w8a8.cc: each row's groups of `group` columns of x quantized to u8 with a zero point
// (x ~ scale * (q - zero), zero in 0..255; q [G, M, group], scale and zero [M, G]; see there), and
// the int32 sums acc[G, M, N] of each group's q @ qw (int8 weights with scales wscale [G, N] and
// column sums wsum [G, N]) turned into fp32 rows; with one group `acc` may be `out`.
int64_t w8a8_groups(int64_t k, int64_t group);
void quantize_rows_u8(const float* x, int64_t m, int64_t k, int64_t group, uint8_t* q, float* scale,
                      int32_t* zero);
void w8a8_epilogue(const int32_t* acc, int64_t m, int64_t n, int64_t groups, const float* xscale,
                   const int32_t* xzero, const float* wscale, const int32_t* wsum, const float* bias, float* out);
// fp8_gemm.cc: an fp8 weight as one buffer (pack_fp8: the e4m3 codes in 16-column panels, then the fp32
// scales per panel and group of `group` rows of K), its size (-1: no such shape), and x [M, K] @ it (+ bias)
// on kernel path `isa`.
int64_t fp8_weight_bytes(int64_t k, int64_t n, int64_t group);
void fp8_forward(const float* x, int64_t m, int64_t k, const uint8_t* weight, int64_t group, const float* bias,
                 int64_t n, int isa, float* out);
// linear.cc: W8A8's weight as one buffer (fd_w8a8_pack: oneDNN's packed [G, group, N] int8, then
// wscale [G, N] float32 and wsum [G, N] int32), its size (-1: no such shape), and x [M, K] @ it (+ bias)
// given the buffer's size (checked against w8a8_weight_bytes).
int64_t w8a8_weight_bytes(int64_t k, int64_t n, int64_t group);
void w8a8_forward(const float* x, int64_t m, int64_t k, const uint8_t* weight, int64_t weight_bytes, const float* bias,
                  int64_t n, int64_t group, float* out);
// The ops' checks of group (1..K), wscale [G, N] float32, wsum [G, N] int32 and the optional bias [N] float32.
void check_w8a8_operands(const paddle::Tensor& wscale, const paddle::Tensor& wsum,
                         const paddle::optional<paddle::Tensor>& bias, int64_t k, int64_t n, int64_t group,
                         const char* op);

// layernorm.cc
void rms_norm(const float* x, const float* weight, float eps, int64_t rows, int64_t h, float* out);
// residual += x; x = rms_norm(residual) * weight.
void fused_add_rms_norm(float* x, float* residual, const float* weight, float eps, int64_t rows, int64_t h);

// activation.cc: out[r] = silu(x[r, :d]) * x[r, d:].
void silu_and_mul(const float* x, int64_t rows, int64_t d, float* out);

// pos_encoding.cc: in place on qkv [T, (H + 2 KVH) D]; k and v rows go to the caches at slots.
void rope_and_cache(float* qkv, const int64_t* positions, const float* cos_sin, int64_t max_position, int64_t rot_dim,
                    paddle::Tensor& key_cache, paddle::Tensor& value_cache, const int64_t* slots,
                    const float* norm_weight, int64_t num_tokens, int64_t num_heads, bool is_neox, float eps);

// attention.cc: out [T, H D] from the queries in the first H D columns of query [T, query_stride].
// attn_isa (the platform's choice): kAttentionFp32 converts bf16 caches to fp32 and multiplies in
// fp32; kAttentionBf16 multiplies bf16 caches with AVX512-BF16 dot products (attention_bf16.cc);
// kAttentionAmxBf16 takes the scores from AMX tiles and the rest from kAttentionBf16's code.
// kAttentionPrefetchL2 added to any of them (also the platform's choice, per CPU vendor): the cache
// rows a kernel asks for ahead of use go to L2, not L1.
constexpr int kAttentionFp32 = 0, kAttentionBf16 = 1, kAttentionAmxBf16 = 2;
constexpr int kAttentionPrefetchL2 = 8;
void paged_attention(const float* query, int64_t query_stride, const paddle::Tensor& key_cache,
                     const paddle::Tensor& value_cache, const int64_t* block_tables, int64_t max_blocks,
                     const int64_t* query_start_loc, const int64_t* seq_lens, int64_t num_seqs, int64_t num_heads,
                     float scale, int attn_isa, float* out);

// A unit of attention work: the query rows of one kv head's group of heads for a tile of a
// sequence's new tokens. Both attention kernels split a batch the same way (attention.cc).
struct AttentionWorkItem {
  int64_t seq, kv_head, token_begin, num_tokens;
};
// Walks the cache slots of consecutive positions through a block table without a division per
// position (two integer divisions per key cost more than the key's multiply-adds at decode).
class SlotCursor {
 public:
  SlotCursor(const int64_t* table, int64_t block_size, int64_t pos)
      : table_(table), block_size_(block_size), block_(pos / block_size), offset_(pos % block_size) {}
  int64_t slot() const { return table_[block_] * block_size_ + offset_; }
  void next() {
    if (++offset_ == block_size_) {
      offset_ = 0;
      ++block_;
    }
  }

 private:
  const int64_t* table_;
  int64_t block_size_, block_, offset_;
};
constexpr int64_t kAttentionTileRows = 48;  // target query rows (tokens x heads of a group) per item
std::vector<AttentionWorkItem> attention_work_items(const int64_t* query_start_loc, int64_t num_seqs,
                                                    int64_t num_kv_heads, int64_t group);

// Where an item's rows are: row r is token first_token + r / group, query head kv_head * group +
// r % group, at position first_pos + r / group (last_pos for the item's last token).
struct AttentionItemRows {
  int64_t rows, first_token, first_pos, last_pos;
  // The item after this one in the batch (nullptr for the last): with one thread the next to run,
  // whose first keys a kernel may fetch while it finishes this one.
  const AttentionWorkItem* next = nullptr;
};
// False where the sequence's seq_lens is shorter than its queries or longer than its block table.
inline bool attention_item_rows(const AttentionWorkItem& item, const int64_t* query_start_loc,
                                const int64_t* seq_lens, int64_t group, int64_t block_size, int64_t max_blocks,
                                AttentionItemRows* out) {
  const int64_t num_queries = query_start_loc[item.seq + 1] - query_start_loc[item.seq];
  const int64_t context = seq_lens[item.seq];
  if (context < num_queries || (context + block_size - 1) / block_size > max_blocks) return false;
  const int64_t first_pos = context - num_queries + item.token_begin;
  *out = {item.num_tokens * group, query_start_loc[item.seq] + item.token_begin, first_pos,
          first_pos + item.num_tokens - 1};
  return true;
}

// Runs body(scratch, item, rows) for every work item of a batch over the threads (a dynamic
// schedule: items differ in length), each thread with its own scratch from make_scratch(); an
// error where a sequence's seq_lens is shorter than its queries or longer than its block table.
template <class MakeScratch, class Body>
void for_each_attention_item(const int64_t* query_start_loc, const int64_t* seq_lens, int64_t num_seqs,
                             int64_t num_kv_heads, int64_t group, int64_t block_size, int64_t max_blocks,
                             MakeScratch make_scratch, Body body) {
  const std::vector<AttentionWorkItem> items = attention_work_items(query_start_loc, num_seqs, num_kv_heads, group);
  const int64_t num_items = static_cast<int64_t>(items.size());
  bool bad_context = false;
#pragma omp parallel if (num_items > 1) reduction(|| : bad_context)
  {
    auto scratch = make_scratch();
    // monotonic: the GOMP 1.0 entry points Paddle's libiomp5 implements (the kernels run on it, _C.py).
#pragma omp for schedule(monotonic : dynamic, 1)
    for (int64_t it = 0; it < num_items; ++it) {
      AttentionItemRows at;
      if (!attention_item_rows(items[it], query_start_loc, seq_lens, group, block_size, max_blocks, &at)) {
        bad_context = true;
        continue;
      }
      at.next = it + 1 < num_items ? &items[it + 1] : nullptr;
      body(scratch, items[it], at);
    }
  }
  PD_CHECK(!bad_context, "paged_attention: seq_lens is shorter than the query or longer than the block table.");
}

// attention_bf16.cc: paged_attention over bf16 caches on AVX512-BF16 (the scores on AMX tiles
// where `amx`) for head dims 64 and 128, prefetching into L2 where `prefetch_l2`; false (nothing
// written) for other head dims.
bool paged_attention_bf16(const float* query, int64_t query_stride, const uint16_t* key_cache,
                          const uint16_t* value_cache, const int64_t* block_tables, int64_t max_blocks,
                          const int64_t* query_start_loc, const int64_t* seq_lens, int64_t num_seqs,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                          bool amx, bool prefetch_l2, float* out);

}  // namespace fastdeploy_cpu
