// One whole Llama-style decoder layer in one op: the per-layer sequence of kernels without
// nine trips through Paddle's custom-op dispatch.
//
// Paddle's eager runner costs ~10-20 us per custom-op call (it copies its op registry and
// parses attribute strings on every call), which at nine ops x 30 layers is several ms of
// a ~25 ms decode step. This op runs the same kernels, in the same order and with the
// same arithmetic as the separate ops, on per-thread scratch buffers:
//
//   residual += hidden; hidden = rms_norm(residual)           (input_layernorm)
//   qkv = hidden @ Wqkv (+b); q/k norm + RoPE; K/V -> cache     (fd_rope_and_cache)
//   attn = paged_attention(q, cache)
//   hidden = attn @ Wo (+b)
//   residual += hidden; hidden = rms_norm(residual)           (post_attention_layernorm)
//   hidden = silu_and_mul(hidden @ Wgate_up (+b)) @ Wdown (+b)
//
// hidden and residual are updated in place (the first layer passes a zero residual, which
// makes the first add exact), so a layer allocates nothing.
//
// The four matmul weights are packed for the linear kernel (dtype "bfloat16" / "float32"), GGUF
// blocks packed by fd_gguf_pack (dtype "gguf": each weight's (type, rows) segments, the block
// kernels' path), or integer weights in one buffer each (dtype "int": segments (bits, group,
// int_gemm.cc's path); wint8 / wint4 / AWQ / GPTQ).
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"

namespace {

const float* optional_data(const paddle::optional<paddle::Tensor>& t) {
  return t.is_initialized() ? t->data<float>() : nullptr;
}

float* scratch(std::vector<float>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// One of the layer's matmul weights: packed for the linear kernel, or GGUF blocks with their segments.
struct Matmul {
  const paddle::Tensor& weight;
  const paddle::optional<paddle::Tensor>& bias;
  const std::vector<int64_t>& segments;

  bool fits(int64_t k, int64_t n, const std::string& dtype) const {
    if (dtype == "int") {
      if (segments.size() != 3) return false;
      const int64_t bytes = fastdeploy_cpu::int_linear_bytes(static_cast<int>(segments[0]), k, n, segments[1]);
      return bytes > 0 && weight.numel() == bytes;
    }
    if (dtype != "gguf") return fastdeploy_cpu::linear_packed_size_ok(weight.numel(), k, n, dtype == "bfloat16");
    int64_t rows = 0, bytes = 0;
    for (size_t s = 0; s + 1 < segments.size(); s += 2) {
      const int64_t packed = fastdeploy_cpu::gguf_packed_bytes(static_cast<int>(segments[s]), segments[s + 1], k);
      if (packed <= 0) return false;
      rows += segments[s + 1];
      bytes += packed;
    }
    return !segments.empty() && segments.size() % 2 == 0 && rows == n && bytes == weight.numel();
  }

  void run(const float* x, int64_t m, int64_t k, int64_t n, const std::string& dtype, int gguf_isa, float* out) const {
    const float* b = optional_data(bias);
    if (dtype == "int") {
      const int bits = static_cast<int>(segments[0]);
      const auto parts = fastdeploy_cpu::int_linear_parts(weight.data<uint8_t>(), bits, k, n, segments[1]);
      fastdeploy_cpu::int_gemm(x, m, k, parts.w, bits, segments[1], parts.scales, parts.mins, b, n,
                               static_cast<int>(segments[2]), out);
    } else if (dtype == "gguf") {
      fastdeploy_cpu::gguf_gemm(x, m, k, weight.data<uint8_t>(), segments.data(),
                                static_cast<int64_t>(segments.size() / 2), b, n, gguf_isa, out);
    } else {
      fastdeploy_cpu::linear_forward(x, m, k, weight.data(), b, n, dtype == "bfloat16", out);
    }
  }
};

}  // namespace

void DecoderLayer(paddle::Tensor& hidden, paddle::Tensor& residual, const paddle::Tensor& input_norm_weight,
                  const paddle::Tensor& qkv_packed, const paddle::optional<paddle::Tensor>& qkv_bias,
                  const paddle::optional<paddle::Tensor>& qk_norm_weight, const paddle::Tensor& cos_sin_cache,
                  const paddle::Tensor& positions, paddle::Tensor& key_cache, paddle::Tensor& value_cache,
                  const paddle::Tensor& slot_mapping, const paddle::Tensor& block_tables,
                  const paddle::Tensor& query_start_loc, const paddle::Tensor& seq_lens,
                  const paddle::Tensor& o_packed, const paddle::optional<paddle::Tensor>& o_bias,
                  const paddle::Tensor& post_norm_weight, const paddle::Tensor& gate_up_packed,
                  const paddle::optional<paddle::Tensor>& gate_up_bias, const paddle::Tensor& down_packed,
                  const paddle::optional<paddle::Tensor>& down_bias, int num_heads, int64_t intermediate_size,
                  float eps, float qk_eps, bool is_neox, float scale, const std::string& dtype,
                  const std::vector<int64_t>& qkv_segments, const std::vector<int64_t>& o_segments,
                  const std::vector<int64_t>& gate_up_segments, const std::vector<int64_t>& down_segments,
                  int gguf_isa, int attn_isa) {
  using fastdeploy_cpu::check_cpu_contiguous;
  check_cpu_contiguous(hidden, "hidden");
  check_cpu_contiguous(residual, "residual");
  fastdeploy_cpu::check_dtype(hidden, paddle::DataType::FLOAT32, "hidden");
  PD_CHECK(residual.numel() == hidden.numel(), "decoder_layer: hidden and residual differ in size.");
  PD_CHECK(key_cache.shape().size() == 4, "decoder_layer: caches must be [num_blocks, block_size, KVH, D].");
  const Matmul qkv_mm{qkv_packed, qkv_bias, qkv_segments}, o_mm{o_packed, o_bias, o_segments};
  const Matmul gate_up_mm{gate_up_packed, gate_up_bias, gate_up_segments}, down_mm{down_packed, down_bias, down_segments};
  const int64_t h = hidden.shape().back();
  const int64_t t = h ? hidden.numel() / h : 0;
  const int64_t kvh = key_cache.shape()[2];
  const int64_t d = key_cache.shape()[3];
  const int64_t q_width = num_heads * d;
  const int64_t qkv_width = (num_heads + 2 * kvh) * d;
  const int64_t inter = intermediate_size;
  PD_CHECK(qkv_mm.fits(h, qkv_width, dtype) && o_mm.fits(q_width, h, dtype) &&
               gate_up_mm.fits(h, 2 * inter, dtype) && down_mm.fits(inter, h, dtype),
           "decoder_layer: a packed weight does not match the layer's shapes.");
  PD_CHECK(positions.numel() == t && slot_mapping.numel() == t, "decoder_layer: one position and slot per token.");
  if (t == 0) return;

  thread_local std::vector<float> qkv_buf, attn_buf, gate_up_buf, act_buf;
  float* x = hidden.data<float>();
  float* res = residual.data<float>();
  float* qkv = scratch(qkv_buf, t * qkv_width);
  float* attn = scratch(attn_buf, t * q_width);
  float* gate_up = scratch(gate_up_buf, t * 2 * inter);
  float* act = scratch(act_buf, t * inter);

  fastdeploy_cpu::fused_add_rms_norm(x, res, input_norm_weight.data<float>(), eps, t, h);
  qkv_mm.run(x, t, h, qkv_width, dtype, gguf_isa, qkv);
  fastdeploy_cpu::rope_and_cache(qkv, positions.data<int64_t>(), cos_sin_cache.data<float>(), cos_sin_cache.shape()[0],
                                 cos_sin_cache.shape()[1], key_cache, value_cache, slot_mapping.data<int64_t>(),
                                 optional_data(qk_norm_weight), t, num_heads, is_neox, qk_eps);
  fastdeploy_cpu::paged_attention(qkv, qkv_width, key_cache, value_cache, block_tables.data<int64_t>(),
                                  block_tables.shape()[1], query_start_loc.data<int64_t>(), seq_lens.data<int64_t>(),
                                  seq_lens.numel(), num_heads, scale, attn_isa, attn);
  o_mm.run(attn, t, q_width, h, dtype, gguf_isa, x);
  fastdeploy_cpu::fused_add_rms_norm(x, res, post_norm_weight.data<float>(), eps, t, h);
  gate_up_mm.run(x, t, h, 2 * inter, dtype, gguf_isa, gate_up);
  fastdeploy_cpu::silu_and_mul(gate_up, t, inter, act);
  down_mm.run(act, t, inter, h, dtype, gguf_isa, x);
}

PD_BUILD_OP(fd_decoder_layer)
    .Inputs({"hidden", "residual", "input_norm_weight", "qkv_packed", paddle::Optional("qkv_bias"),
             paddle::Optional("qk_norm_weight"), "cos_sin_cache", "positions", "key_cache", "value_cache",
             "slot_mapping", "block_tables", "query_start_loc", "seq_lens", "o_packed", paddle::Optional("o_bias"),
             "post_norm_weight", "gate_up_packed", paddle::Optional("gate_up_bias"), "down_packed",
             paddle::Optional("down_bias")})
    .Outputs({"hidden_out", "residual_out", "key_cache_out", "value_cache_out"})
    .SetInplaceMap({{"hidden", "hidden_out"},
                    {"residual", "residual_out"},
                    {"key_cache", "key_cache_out"},
                    {"value_cache", "value_cache_out"}})
    .Attrs({"num_heads: int", "intermediate_size: int64_t", "eps: float", "qk_eps: float", "is_neox: bool",
            "scale: float", "dtype: std::string", "qkv_segments: std::vector<int64_t>",
            "o_segments: std::vector<int64_t>", "gate_up_segments: std::vector<int64_t>",
            "down_segments: std::vector<int64_t>", "gguf_isa: int", "attn_isa: int"})
    .SetKernelFn(PD_KERNEL(DecoderLayer));
