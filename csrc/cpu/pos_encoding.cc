// Rotary embedding fused with the KV-cache write (vLLM's rotary_embedding + reshape_and_cache).
//
// Works in place on the fused QKV projection output [T, (H + 2 * KVH) * D]: the
// optional per-head RMSNorm of q and k (Qwen3's q_norm / k_norm) and RoPE are
// applied to the q and k heads, then this step's k and v rows are stored in the
// paged cache at slot_mapping[t] (cache [num_blocks, block_size, KVH, D], fp32 or
// bf16). Attention then reads q straight from the QKV buffer and every key and
// value from the cache, so nothing is split, copied or gathered in Python.
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"

namespace {

// cos_sin row layout, as in vLLM: [cos(0 .. rot/2) | sin(0 .. rot/2)].
inline void rotate_neox(float* x, const float* cos, const float* sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// GPT-J style: pairs (2i, 2i + 1) rotate together (ERNIE 4.5).
inline void rotate_interleaved(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[2 * i], x2 = x[2 * i + 1];
    x[2 * i] = x1 * cos[i] - x2 * sin[i];
    x[2 * i + 1] = x2 * cos[i] + x1 * sin[i];
  }
}

inline void rms_norm_head(float* x, const float* weight, int64_t d, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) sum += x[i] * x[i];
  const float scale = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) x[i] = x[i] * scale * weight[i];
}

template <typename CacheT>
void rope_and_cache_impl(float* qkv, const int64_t* positions, const float* cos_sin, CacheT* key_cache,
                    CacheT* value_cache, const int64_t* slots, const float* norm_weight, int64_t num_tokens,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rot_dim, int64_t max_position,
                    bool is_neox, float eps) {
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t kv_width = num_kv_heads * head_dim;
  const int64_t half = rot_dim / 2;
  bool bad_position = false;
#pragma omp parallel for if (num_tokens >= 64) schedule(static) reduction(|| : bad_position)
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* row = qkv + t * width;
    const int64_t pos = positions[t];
    if (pos < 0 || pos >= max_position) {
      bad_position = true;
      continue;
    }
    const float* cos = cos_sin + pos * rot_dim;
    const float* sin = cos + half;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
      float* x = row + h * head_dim;
      if (norm_weight != nullptr) rms_norm_head(x, norm_weight + h * head_dim, head_dim, eps);
      if (is_neox) {
        rotate_neox(x, cos, sin, half);
      } else {
        rotate_interleaved(x, cos, sin, half);
      }
    }
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding token: nothing to cache
    fastdeploy_cpu::store_row(row + num_heads * head_dim, key_cache + slot * kv_width, kv_width);
    fastdeploy_cpu::store_row(row + num_heads * head_dim + kv_width, value_cache + slot * kv_width, kv_width);
  }
  PD_CHECK(!bad_position, "rope_and_cache: a position is outside the rotary cache.");
}

}  // namespace

namespace fastdeploy_cpu {

void rope_and_cache(float* qkv, const int64_t* positions, const float* cos_sin, int64_t max_position, int64_t rot_dim,
                    paddle::Tensor& key_cache, paddle::Tensor& value_cache, const int64_t* slots,
                    const float* norm_weight, int64_t num_tokens, int64_t num_heads, bool is_neox, float eps) {
  const int64_t num_kv_heads = key_cache.shape()[2];
  const int64_t head_dim = key_cache.shape()[3];
  if (is_bf16(key_cache)) {
    rope_and_cache_impl(qkv, positions, cos_sin, static_cast<uint16_t*>(key_cache.data()),
                        static_cast<uint16_t*>(value_cache.data()), slots, norm_weight, num_tokens, num_heads,
                        num_kv_heads, head_dim, rot_dim, max_position, is_neox, eps);
  } else {
    check_dtype(key_cache, paddle::DataType::FLOAT32, "key_cache");
    rope_and_cache_impl(qkv, positions, cos_sin, key_cache.data<float>(), value_cache.data<float>(), slots,
                        norm_weight, num_tokens, num_heads, num_kv_heads, head_dim, rot_dim, max_position, is_neox,
                        eps);
  }
}

}  // namespace fastdeploy_cpu

void RopeAndCache(paddle::Tensor& qkv, const paddle::Tensor& positions, const paddle::Tensor& cos_sin_cache,
                  paddle::Tensor& key_cache, paddle::Tensor& value_cache, const paddle::Tensor& slot_mapping,
                  const paddle::optional<paddle::Tensor>& qk_norm_weight, int num_heads, bool is_neox, float eps) {
  using fastdeploy_cpu::check_cpu_contiguous;
  using fastdeploy_cpu::check_dtype;
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(positions, "positions");
  check_cpu_contiguous(cos_sin_cache, "cos_sin_cache");
  check_cpu_contiguous(key_cache, "key_cache");
  check_cpu_contiguous(value_cache, "value_cache");
  check_cpu_contiguous(slot_mapping, "slot_mapping");
  check_dtype(qkv, paddle::DataType::FLOAT32, "qkv");
  check_dtype(cos_sin_cache, paddle::DataType::FLOAT32, "cos_sin_cache");
  check_dtype(positions, paddle::DataType::INT64, "positions");
  check_dtype(slot_mapping, paddle::DataType::INT64, "slot_mapping");
  PD_CHECK(key_cache.shape().size() == 4, "rope_and_cache: caches must be [num_blocks, block_size, KVH, D].");
  PD_CHECK(key_cache.dtype() == value_cache.dtype(), "rope_and_cache: key and value caches differ in dtype.");
  const int64_t num_kv_heads = key_cache.shape()[2];
  const int64_t head_dim = key_cache.shape()[3];
  const int64_t num_tokens = qkv.shape()[0];
  const int64_t rot_dim = cos_sin_cache.shape()[1];
  PD_CHECK(qkv.numel() == num_tokens * (num_heads + 2 * num_kv_heads) * head_dim,
           "rope_and_cache: qkv must be [T, (H + 2 * KVH) * D].");
  PD_CHECK(positions.numel() == num_tokens && slot_mapping.numel() == num_tokens,
           "rope_and_cache: positions and slot_mapping need one entry per token.");
  PD_CHECK(rot_dim % 2 == 0 && rot_dim <= head_dim, "rope_and_cache: rotary dim must be even and <= head_dim.");
  const float* norm_weight = nullptr;
  if (qk_norm_weight.is_initialized()) {
    check_cpu_contiguous(*qk_norm_weight, "qk_norm_weight");
    PD_CHECK(qk_norm_weight->numel() == (num_heads + num_kv_heads) * head_dim,
             "rope_and_cache: qk_norm_weight must be [H + KVH, D].");
    norm_weight = qk_norm_weight->data<float>();
  }
  fastdeploy_cpu::rope_and_cache(qkv.data<float>(), positions.data<int64_t>(), cos_sin_cache.data<float>(),
                                 cos_sin_cache.shape()[0], rot_dim, key_cache, value_cache,
                                 slot_mapping.data<int64_t>(), norm_weight, num_tokens, num_heads, is_neox, eps);
}

PD_BUILD_OP(fd_rope_and_cache)
    .Inputs({"qkv", "positions", "cos_sin_cache", "key_cache", "value_cache", "slot_mapping",
             paddle::Optional("qk_norm_weight")})
    .Outputs({"qkv_out", "key_cache_out", "value_cache_out"})
    .SetInplaceMap({{"qkv", "qkv_out"}, {"key_cache", "key_cache_out"}, {"value_cache", "value_cache_out"}})
    .Attrs({"num_heads: int", "is_neox: bool", "eps: float"})
    .SetKernelFn(PD_KERNEL(RopeAndCache));
