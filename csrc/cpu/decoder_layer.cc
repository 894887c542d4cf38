// Consecutive Llama-style decoder layers in one op: the per-layer sequence of kernels without
// nine trips per layer through Paddle's custom-op dispatch, and without one trip per layer.
//
// Paddle's eager runner costs ~8 us per custom-op call plus ~0.4 us per argument (it copies
// its op registry and parses attribute strings on every call): nine ops x 30 layers were
// several ms of a ~25 ms decode step, and one op per layer still 15 us x 30 (~9% of a 5 ms
// GGUF step at batch 1). This op runs a run of layers with the same kernels, in the same
// order and with the same arithmetic as the separate ops, on per-thread scratch buffers;
// each layer is
//
//   residual += hidden; hidden = rms_norm(residual)           (input_layernorm)
//   qkv = hidden @ Wqkv (+b); q/k norm + RoPE; K/V -> cache     (fd_rope_and_cache)
//   attn = paged_attention(q, cache)
//   hidden = attn @ Wo (+b)
//   residual += hidden; hidden = rms_norm(residual)           (post_attention_layernorm)
//   hidden = silu_and_mul(hidden @ Wgate_up (+b)) @ Wdown (+b)
//
// A step of more than kMlpChunkRows tokens on the row-tiled kernels (GGUF blocks, integer and fp8
// weights) runs its MLP on kMlpChunkRows rows at a time: the chunk's gate/up output and SiLU
// product stay in cache instead of streaming through memory (2048 tokens of SmolLM2-135M: 25 MB
// and 12.5 MB a layer), and each row's arithmetic is unchanged.
//
// hidden and residual are updated in place (the first layer of a model passes a zero
// residual, which makes the first add exact), so a layer allocates nothing. Every per-layer
// input is a list with one entry per layer of the run; the layers share their shapes,
// settings and rope table.
//
// The four matmul weights are packed for the linear kernel (dtype "bfloat16" / "float32"), GGUF
// blocks packed by fd_gguf_pack (dtype "gguf": each weight's (type, rows) segments, the block
// kernels' path), or integer weights in one buffer each (dtype "int": segments (bits, group,
// int_gemm.cc's path); wint8 / wint4 / AWQ / GPTQ), W8A8's buffers of fd_w8a8_pack (dtype "w8a8":
// segments (group)) or fp8 buffers of pack_fp8 (dtype "fp8": segments (group, fp8_gemm.cc's path)).
// `segments` holds, per layer and for qkv, o, gate_up and down in turn, the count of a weight's
// segment values and then the values.
#include <algorithm>
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"
#include "weight_matmul.h"

namespace {

using fastdeploy_cpu::Matmul;

// Measured on the AVX512-BF16 EPYC (one thread, 16 prompts of 270 tokens, one process taking turns):
// prefill GGUF 4.31 -> 4.04 s at 128 rows (64 and 192 alike), wint4 5.87 -> 5.59 s, fp8 6.15 -> 5.93 s;
// wint4 at 1536 x 8960 MLP shapes 10.6 -> 8.6 s. oneDNN's matmuls (bf16, w8a8), which block their
// rows themselves, gained nothing (5.24 -> 5.16 s; 8.01 -> 8.14 s at 1536 x 8960): they keep whole steps.
constexpr int64_t kMlpChunkRows = 128;

const float* optional_data(const paddle::optional<std::vector<paddle::Tensor>>& list, size_t i) {
  return list.is_initialized() ? list->at(i).data<float>() : nullptr;
}

using fastdeploy_cpu::sized;

// Reads each layer's four weights' segment values off the flattened `segments` attribute.
class SegmentReader {
 public:
  explicit SegmentReader(const std::vector<int64_t>& values) : values_(values) {}

  Matmul next(const paddle::Tensor& weight, const float* bias) {
    PD_CHECK(pos_ < values_.size() && values_[pos_] >= 0 &&
                 pos_ + 1 + static_cast<size_t>(values_[pos_]) <= values_.size(),
             "decoder_layers: segments hold fewer weights than the layers have.");
    const int64_t count = values_[pos_];
    const Matmul m{{weight, bias, values_.data() + pos_ + 1, count}};
    pos_ += 1 + count;
    return m;
  }

  bool done() const { return pos_ == values_.size(); }

 private:
  const std::vector<int64_t>& values_;
  size_t pos_ = 0;
};

}  // namespace

void DecoderLayers(paddle::Tensor& hidden, paddle::Tensor& residual, const std::vector<paddle::Tensor>& input_norm_weights,
                   const std::vector<paddle::Tensor>& qkv_packed,
                   const paddle::optional<std::vector<paddle::Tensor>>& qkv_biases,
                   const paddle::optional<std::vector<paddle::Tensor>>& qk_norm_weights,
                   const paddle::Tensor& cos_sin_cache, const paddle::Tensor& positions,
                   std::vector<paddle::Tensor>& key_caches, std::vector<paddle::Tensor>& value_caches,
                   const paddle::Tensor& slot_mapping, const paddle::Tensor& block_tables,
                   const paddle::Tensor& query_start_loc, const paddle::Tensor& seq_lens,
                   const std::vector<paddle::Tensor>& o_packed, const paddle::optional<std::vector<paddle::Tensor>>& o_biases,
                   const std::vector<paddle::Tensor>& post_norm_weights, const std::vector<paddle::Tensor>& gate_up_packed,
                   const paddle::optional<std::vector<paddle::Tensor>>& gate_up_biases,
                   const std::vector<paddle::Tensor>& down_packed,
                   const paddle::optional<std::vector<paddle::Tensor>>& down_biases, int num_heads,
                   int64_t intermediate_size, float eps, float qk_eps, bool is_neox, float scale,
                   const std::string& dtype, const std::vector<int64_t>& segments, int gguf_isa, int attn_isa) {
  using fastdeploy_cpu::check_cpu_contiguous;
  check_cpu_contiguous(hidden, "hidden");
  check_cpu_contiguous(residual, "residual");
  fastdeploy_cpu::check_dtype(hidden, paddle::DataType::FLOAT32, "hidden");
  PD_CHECK(residual.numel() == hidden.numel(), "decoder_layers: hidden and residual differ in size.");
  const size_t layers = input_norm_weights.size();
  const std::vector<paddle::Tensor>* per_layer[] = {&qkv_packed, &key_caches, &value_caches, &o_packed,
                                                    &post_norm_weights, &gate_up_packed, &down_packed};
  for (const auto* list : per_layer) {
    PD_CHECK(list->size() == layers, "decoder_layers: every per-layer input needs one tensor per layer.");
  }
  for (const auto* list : {&qkv_biases, &qk_norm_weights, &o_biases, &gate_up_biases, &down_biases}) {
    PD_CHECK(!list->is_initialized() || (*list)->size() == layers,
             "decoder_layers: every per-layer input needs one tensor per layer.");
  }
  if (layers == 0) return;
  PD_CHECK(key_caches[0].shape().size() == 4, "decoder_layers: caches must be [num_blocks, block_size, KVH, D].");
  const int64_t h = hidden.shape().back();
  const int64_t t = h ? hidden.numel() / h : 0;
  const int64_t kvh = key_caches[0].shape()[2];
  const int64_t d = key_caches[0].shape()[3];
  const int64_t q_width = num_heads * d;
  const int64_t qkv_width = (num_heads + 2 * kvh) * d;
  const int64_t inter = intermediate_size;
  PD_CHECK(positions.numel() == t && slot_mapping.numel() == t, "decoder_layers: one position and slot per token.");

  std::vector<Matmul> matmuls;
  matmuls.reserve(4 * layers);
  SegmentReader reader(segments);
  for (size_t l = 0; l < layers; ++l) {
    PD_CHECK(key_caches[l].shape() == key_caches[0].shape() && value_caches[l].shape() == key_caches[0].shape(),
             "decoder_layers: the layers' caches differ in shape.");
    matmuls.push_back(reader.next(qkv_packed[l], optional_data(qkv_biases, l)));
    matmuls.push_back(reader.next(o_packed[l], optional_data(o_biases, l)));
    matmuls.push_back(reader.next(gate_up_packed[l], optional_data(gate_up_biases, l)));
    matmuls.push_back(reader.next(down_packed[l], optional_data(down_biases, l)));
    const Matmul* mm = matmuls.data() + 4 * l;
    PD_CHECK(mm[0].fits(h, qkv_width, dtype) && mm[1].fits(q_width, h, dtype) && mm[2].fits(h, 2 * inter, dtype) &&
                 mm[3].fits(inter, h, dtype),
             "decoder_layers: a packed weight of layer " + std::to_string(l) + " does not match the layer's shapes.");
  }
  PD_CHECK(reader.done(), "decoder_layers: segments hold more weights than the layers have.");
  if (t == 0) return;

  thread_local std::vector<float> qkv_buf, attn_buf, gate_up_buf, act_buf;
  float* x = hidden.data<float>();
  float* res = residual.data<float>();
  float* qkv = sized(qkv_buf, t * qkv_width);
  float* attn = sized(attn_buf, t * q_width);
  const bool row_tiled = dtype == "gguf" || dtype == "int" || dtype == "fp8";
  const int64_t mlp_rows = row_tiled ? std::min(t, kMlpChunkRows) : t;
  float* gate_up = sized(gate_up_buf, mlp_rows * 2 * inter);
  float* act = sized(act_buf, mlp_rows * inter);
  const int64_t* pos = positions.data<int64_t>();
  const int64_t* slots = slot_mapping.data<int64_t>();

  for (size_t l = 0; l < layers; ++l) {
    const Matmul* mm = matmuls.data() + 4 * l;
    fastdeploy_cpu::fused_add_rms_norm(x, res, input_norm_weights[l].data<float>(), eps, t, h);
    mm[0].run(x, t, h, qkv_width, dtype, gguf_isa, qkv);
    fastdeploy_cpu::rope_and_cache(qkv, pos, cos_sin_cache.data<float>(), cos_sin_cache.shape()[0],
                                   cos_sin_cache.shape()[1], key_caches[l], value_caches[l], slots,
                                   optional_data(qk_norm_weights, l), t, num_heads, is_neox, qk_eps);
    fastdeploy_cpu::paged_attention(qkv, qkv_width, key_caches[l], value_caches[l], block_tables.data<int64_t>(),
                                    block_tables.shape()[1], query_start_loc.data<int64_t>(),
                                    seq_lens.data<int64_t>(), seq_lens.numel(), num_heads, scale, attn_isa, attn);
    mm[1].run(attn, t, q_width, h, dtype, gguf_isa, x);
    fastdeploy_cpu::fused_add_rms_norm(x, res, post_norm_weights[l].data<float>(), eps, t, h);
    for (int64_t r = 0; r < t; r += mlp_rows) {  // down_proj overwrites only the rows gate_up_proj has read
      const int64_t rows = std::min(mlp_rows, t - r);
      mm[2].run(x + r * h, rows, h, 2 * inter, dtype, gguf_isa, gate_up);
      fastdeploy_cpu::silu_and_mul(gate_up, rows, inter, act);
      mm[3].run(act, rows, inter, h, dtype, gguf_isa, x + r * h);
    }
  }
}

PD_BUILD_OP(fd_decoder_layers)
    .Inputs({"hidden", "residual", paddle::Vec("input_norm_weights"), paddle::Vec("qkv_packed"),
             paddle::Optional(paddle::Vec("qkv_biases")), paddle::Optional(paddle::Vec("qk_norm_weights")),
             "cos_sin_cache", "positions", paddle::Vec("key_caches"), paddle::Vec("value_caches"), "slot_mapping",
             "block_tables", "query_start_loc", "seq_lens", paddle::Vec("o_packed"),
             paddle::Optional(paddle::Vec("o_biases")), paddle::Vec("post_norm_weights"),
             paddle::Vec("gate_up_packed"), paddle::Optional(paddle::Vec("gate_up_biases")),
             paddle::Vec("down_packed"), paddle::Optional(paddle::Vec("down_biases"))})
    .Outputs({"hidden_out", "residual_out", paddle::Vec("key_caches_out"), paddle::Vec("value_caches_out")})
    .SetInplaceMap({{"hidden", "hidden_out"},
                    {"residual", "residual_out"},
                    {paddle::Vec("key_caches"), paddle::Vec("key_caches_out")},
                    {paddle::Vec("value_caches"), paddle::Vec("value_caches_out")}})
    .Attrs({"num_heads: int", "intermediate_size: int64_t", "eps: float", "qk_eps: float", "is_neox: bool",
            "scale: float", "dtype: std::string", "segments: std::vector<int64_t>", "gguf_isa: int",
            "attn_isa: int"})
    .SetKernelFn(PD_KERNEL(DecoderLayers));
