// Fused mixture-of-experts forward on quantized expert weights: the grouping, gather,
// SiLU-and-mul and weighted sum of moe_impl.h, with the per-expert GEMM of the format.
//
//   fd_int_fused_moe:  wint8 / wint4 experts, int_gemm.cc (integers widened to fp32 in registers);
//                      expert e's [H, 2I] gate|up and [I, H] down weights in int_gemm_impl.h's panel
//                      layout, one row of [E, bytes] each, their scales (and 4-bit mins) rows of [E, n].
//   fd_gguf_fused_moe: GGUF block experts, gguf_gemm.cc (activations quantized per 32 to int8);
//                      expert e's gate|up rows ([2I, H] as (type, rows) segments) and down rows
//                      ([H, I]) packed by fd_gguf_pack, one row of [E, bytes] each.
//
// Both take the block's shared experts too (optional): a dense SwiGLU of int or GGUF weights
// (weight_matmul.h's OwnMatmul) that the op runs as one more expert over every token. Within a decode
// step the thread that runs them can compute while the others stream the routed experts' weights
// (moe_impl.h's expert tasks), which the shared experts' separate ops after the routed ones could not.
//
// Both kernels compute each row independently of the others, so the ops are batch-invariant
// like fd_fused_moe. Neither needs oneDNN: they build wherever int_gemm.cc / gguf_gemm.cc do.
#include "moe_impl.h"
#include "weight_matmul.h"

namespace {

using fastdeploy_cpu::check_cpu_contiguous;
using fastdeploy_cpu::check_dtype;

// An [E, per-expert] tensor of `dtype` with E rows of `per_expert` elements each.
void check_expert_rows(const paddle::Tensor& t, int64_t num_experts, int64_t per_expert, paddle::DataType dtype,
                       const char* name, const std::string& op) {
  check_cpu_contiguous(t, name);
  check_dtype(t, dtype, name);
  PD_CHECK(t.shape().size() == 2 && t.shape()[0] == num_experts && t.shape()[1] == per_expert,
           op + ": " + name + " must be [E = " + std::to_string(num_experts) + ", " + std::to_string(per_expert) +
               "], got " + std::to_string(t.numel()) + " elements.");
}

// An op's optional shared experts: gate|up [H, 2S] and down [S, H] weights, int or GGUF (OwnMatmul),
// their (format) segments, and optional per-token weights [T] (or [T, 1]).
class SharedExperts {
 public:
  SharedExperts(const paddle::optional<paddle::Tensor>& w13, const paddle::optional<paddle::Tensor>& w2,
                const paddle::optional<paddle::Tensor>& token_weights, int64_t inter, const std::string& dtype,
                const std::vector<int64_t>& w13_segments, const std::vector<int64_t>& w2_segments, int gguf_isa,
                int64_t num_tokens, int64_t hidden, const std::string& op)
      : dtype_(dtype), w13_segments_(w13_segments), w2_segments_(w2_segments), gguf_isa_(gguf_isa), hidden_(hidden) {
    if (inter == 0) {
      PD_CHECK(!w13.is_initialized() && !w2.is_initialized() && !token_weights.is_initialized(),
               op + ": shared expert weights need shared_inter > 0.");
      return;
    }
    PD_CHECK(inter > 0 && w13.is_initialized() && w2.is_initialized(),
             op + ": shared experts need shared_w13, shared_w2 and shared_inter > 0.");
    // (OwnMatmul runs fp8 too, but no MoE model reaches this op with fp8 shared experts: fp8 has no MoE method.)
    PD_CHECK(dtype == "int" || dtype == "gguf",
             op + ": shared experts in '" + dtype + "' are not run by this op (int and gguf are).");
    check_cpu_contiguous(*w13, "shared_w13");
    check_cpu_contiguous(*w2, "shared_w2");
    check_dtype(*w13, paddle::DataType::UINT8, "shared_w13");
    check_dtype(*w2, paddle::DataType::UINT8, "shared_w2");
    w13_ = &*w13;
    w2_ = &*w2;
    PD_CHECK(matmul(kW13).fits(hidden, 2 * inter, dtype) && matmul(kW2).fits(inter, hidden, dtype),
             op + ": shared_w13 / shared_w2 are not [H, 2S] / [S, H] = [" + std::to_string(hidden) + ", " +
                 std::to_string(2 * inter) + "] / [" + std::to_string(inter) + ", " + std::to_string(hidden) +
                 "] '" + dtype + "' weights.");
    settings_.inter = inter;
    if (token_weights.is_initialized()) {
      check_cpu_contiguous(*token_weights, "shared_weights");
      check_dtype(*token_weights, paddle::DataType::FLOAT32, "shared_weights");
      PD_CHECK(token_weights->numel() == num_tokens, op + ": shared_weights needs one weight per token.");
      settings_.token_weights = token_weights->data<float>();
    }
  }

  const fastdeploy_cpu::MoeShared& settings() const { return settings_; }

  // out = in @ the gate|up (kMoeW13) or down (kMoeW2) weight.
  void gemm(int proj, const float* in, int64_t rows, float* out) const {
    const int64_t inter = settings_.inter;
    if (proj == kW13) {
      matmul(kW13).run(in, rows, hidden_, 2 * inter, dtype_, gguf_isa_, out);
    } else {
      matmul(kW2).run(in, rows, inter, hidden_, dtype_, gguf_isa_, out);
    }
  }

 private:
  static constexpr int kW13 = fastdeploy_cpu::kMoeW13, kW2 = fastdeploy_cpu::kMoeW2;

  fastdeploy_cpu::OwnMatmul matmul(int proj) const {
    const std::vector<int64_t>& segments = proj == kW13 ? w13_segments_ : w2_segments_;
    return {proj == kW13 ? *w13_ : *w2_, nullptr, segments.data(), static_cast<int64_t>(segments.size())};
  }

  const paddle::Tensor *w13_ = nullptr, *w2_ = nullptr;
  const std::string& dtype_;
  const std::vector<int64_t>&w13_segments_, &w2_segments_;
  int gguf_isa_;
  int64_t hidden_;
  fastdeploy_cpu::MoeShared settings_;
};

}  // namespace

// x [T, H] fp32; topk_ids [T, K] int64 in [0, E); topk_weights [T, K] fp32; w13 [E, bytes] uint8 (each row one
// expert's [H, 2I] gate|up integers, int_gemm_impl.h's layout) with scales [E, n] (and int4 mins [E, n]);
// w2 / w2_scales / w2_mins likewise for the [I, H] down weights; the optional shared experts (SharedExperts)
// -> [T, H] fp32.
std::vector<paddle::Tensor> IntFusedMoE(
    const paddle::Tensor& x, const paddle::Tensor& topk_ids, const paddle::Tensor& topk_weights,
    const paddle::Tensor& w13, const paddle::Tensor& w13_scales, const paddle::optional<paddle::Tensor>& w13_mins,
    const paddle::Tensor& w2, const paddle::Tensor& w2_scales, const paddle::optional<paddle::Tensor>& w2_mins,
    const paddle::optional<paddle::Tensor>& shared_w13, const paddle::optional<paddle::Tensor>& shared_w2,
    const paddle::optional<paddle::Tensor>& shared_weights, int64_t inter, int bits, int64_t group, int isa,
    int64_t shared_inter, const std::string& shared_dtype, const std::vector<int64_t>& shared_w13_segments,
    const std::vector<int64_t>& shared_w2_segments, int shared_gguf_isa) {
  const std::string op = "fd_int_fused_moe";
  PD_CHECK(bits == 8 || bits == 4, op + ": bits must be 8 or 4.");
  PD_CHECK(w13.shape().size() == 2, op + ": w13 must be [E, bytes].");
  const int64_t num_experts = w13.shape()[0];
  const auto [num_tokens, hidden, top_k] = fastdeploy_cpu::check_moe_routing(x, topk_ids, topk_weights, num_experts, op);
  PD_CHECK(bits == 8 || (hidden % 2 == 0 && inter % 2 == 0 && group > 0 && group % 2 == 0),
           op + ": int4 needs an even H, I and group.");
  const auto scale_count = [&](int64_t k, int64_t n) {
    const int64_t panels = (n + fastdeploy_cpu::kIntPanel - 1) / fastdeploy_cpu::kIntPanel;
    return panels * (bits == 4 ? (k + group - 1) / group : 1) * fastdeploy_cpu::kIntPanel;
  };
  const int64_t s13 = scale_count(hidden, 2 * inter), s2 = scale_count(inter, hidden);
  check_expert_rows(w13, num_experts, fastdeploy_cpu::int_packed_bytes(bits, hidden, 2 * inter),
                    paddle::DataType::UINT8, "w13", op);
  check_expert_rows(w2, num_experts, fastdeploy_cpu::int_packed_bytes(bits, inter, hidden), paddle::DataType::UINT8,
                    "w2", op);
  check_expert_rows(w13_scales, num_experts, s13, paddle::DataType::FLOAT32, "w13_scales", op);
  check_expert_rows(w2_scales, num_experts, s2, paddle::DataType::FLOAT32, "w2_scales", op);
  const float *mins13 = nullptr, *mins2 = nullptr;
  if (bits == 4) {
    PD_CHECK(w13_mins.is_initialized() && w2_mins.is_initialized(), op + ": int4 needs w13_mins and w2_mins.");
    check_expert_rows(*w13_mins, num_experts, s13, paddle::DataType::FLOAT32, "w13_mins", op);
    check_expert_rows(*w2_mins, num_experts, s2, paddle::DataType::FLOAT32, "w2_mins", op);
    mins13 = w13_mins->data<float>();
    mins2 = w2_mins->data<float>();
  }
  const SharedExperts shared(shared_w13, shared_w2, shared_weights, shared_inter, shared_dtype, shared_w13_segments,
                             shared_w2_segments, shared_gguf_isa, num_tokens, hidden, op);
  auto out = paddle::empty({num_tokens, hidden}, paddle::DataType::FLOAT32, x.place());
  if (num_tokens == 0) return {out};
  const uint8_t *q13 = w13.data<uint8_t>(), *q2 = w2.data<uint8_t>();
  const float *sc13 = w13_scales.data<float>(), *sc2 = w2_scales.data<float>();
  const int64_t b13 = w13.shape()[1], b2 = w2.shape()[1];
  const auto gemm = [&](int64_t e, int proj, const float* in, int64_t rows, float* dst) {
    if (e == num_experts) {
      shared.gemm(proj, in, rows, dst);
    } else if (proj == fastdeploy_cpu::kMoeW13) {
      fastdeploy_cpu::int_gemm(in, rows, hidden, q13 + e * b13, bits, group, sc13 + e * s13,
                               mins13 ? mins13 + e * s13 : nullptr, nullptr, 2 * inter, isa, dst);
    } else {
      fastdeploy_cpu::int_gemm(in, rows, inter, q2 + e * b2, bits, group, sc2 + e * s2,
                               mins2 ? mins2 + e * s2 : nullptr, nullptr, hidden, isa, dst);
    }
  };
  fastdeploy_cpu::fused_moe_grouped(x.data<float>(), num_tokens, hidden, topk_ids.data<int64_t>(),
                                    topk_weights.data<float>(), top_k, num_experts, inter, gemm, out.data<float>(),
                                    shared.settings(),
                                    b13 + b2 + (s13 + s2) * (mins13 ? 2 : 1) * static_cast<int64_t>(sizeof(float)));
  return {out};
}

PD_BUILD_OP(fd_int_fused_moe)
    .Inputs({"x", "topk_ids", "topk_weights", "w13", "w13_scales", paddle::Optional("w13_mins"), "w2", "w2_scales",
             paddle::Optional("w2_mins"), paddle::Optional("shared_w13"), paddle::Optional("shared_w2"),
             paddle::Optional("shared_weights")})
    .Outputs({"out"})
    .Attrs({"inter: int64_t", "bits: int", "group: int64_t", "isa: int", "shared_inter: int64_t",
            "shared_dtype: std::string", "shared_w13_segments: std::vector<int64_t>",
            "shared_w2_segments: std::vector<int64_t>", "shared_gguf_isa: int"})
    .SetKernelFn(PD_KERNEL(IntFusedMoE));

namespace {

// Rows and packed bytes of one expert's matrix of k columns made of `segments` ((ggml type, rows) pairs).
std::pair<int64_t, int64_t> gguf_expert_shape(const std::vector<int64_t>& segments, int64_t k,
                                              const std::string& op, const char* name) {
  PD_CHECK(!segments.empty() && segments.size() % 2 == 0, op + ": " + name + " segments are (type, rows) pairs.");
  int64_t rows = 0, bytes = 0;
  for (size_t s = 0; s < segments.size(); s += 2) {
    const int64_t seg = fastdeploy_cpu::gguf_packed_bytes(static_cast<int>(segments[s]), segments[s + 1], k);
    PD_CHECK(seg > 0, op + ": " + name + ": ggml type " + std::to_string(segments[s]) + " has no kernel, a segment "
                          "has no rows, or K = " + std::to_string(k) + " is not a multiple of its block.");
    rows += segments[s + 1];
    bytes += seg;
  }
  return {rows, bytes};
}

}  // namespace

// x [T, H] fp32; topk_ids [T, K] int64 in [0, E); topk_weights [T, K] fp32; w13 [E, bytes] uint8: each row one
// expert's gate|up rows ([2I, H], gate first) packed by fd_gguf_pack, in w13_segments' (type, rows) pairs;
// w2 [E, bytes]: each expert's down rows ([H, I]) in w2_segments; the optional shared experts (SharedExperts)
// -> [T, H] fp32.
std::vector<paddle::Tensor> GgufFusedMoE(
    const paddle::Tensor& x, const paddle::Tensor& topk_ids, const paddle::Tensor& topk_weights,
    const paddle::Tensor& w13, const paddle::Tensor& w2, const paddle::optional<paddle::Tensor>& shared_w13,
    const paddle::optional<paddle::Tensor>& shared_w2, const paddle::optional<paddle::Tensor>& shared_weights,
    const std::vector<int64_t>& w13_segments, const std::vector<int64_t>& w2_segments, int isa, int64_t shared_inter,
    const std::string& shared_dtype, const std::vector<int64_t>& shared_w13_segments,
    const std::vector<int64_t>& shared_w2_segments, int shared_gguf_isa) {
  const std::string op = "fd_gguf_fused_moe";
  PD_CHECK(w13.shape().size() == 2, op + ": w13 must be [E, bytes].");
  const int64_t num_experts = w13.shape()[0];
  const auto [num_tokens, hidden, top_k] = fastdeploy_cpu::check_moe_routing(x, topk_ids, topk_weights, num_experts, op);
  const auto [rows13, bytes13] = gguf_expert_shape(w13_segments, hidden, op, "w13");
  PD_CHECK(rows13 % 2 == 0, op + ": w13 must have 2I rows (gate, then up).");
  const int64_t inter = rows13 / 2;
  const auto [rows2, bytes2] = gguf_expert_shape(w2_segments, inter, op, "w2");
  PD_CHECK(rows2 == hidden, op + ": w2 has " + std::to_string(rows2) + " rows, H is " + std::to_string(hidden) + ".");
  check_expert_rows(w13, num_experts, bytes13, paddle::DataType::UINT8, "w13", op);
  check_expert_rows(w2, num_experts, bytes2, paddle::DataType::UINT8, "w2", op);
  const SharedExperts shared(shared_w13, shared_w2, shared_weights, shared_inter, shared_dtype, shared_w13_segments,
                             shared_w2_segments, shared_gguf_isa, num_tokens, hidden, op);
  auto out = paddle::empty({num_tokens, hidden}, paddle::DataType::FLOAT32, x.place());
  if (num_tokens == 0) return {out};
  const uint8_t *p13 = w13.data<uint8_t>(), *p2 = w2.data<uint8_t>();
  const int64_t n13 = static_cast<int64_t>(w13_segments.size() / 2), n2 = static_cast<int64_t>(w2_segments.size() / 2);
  const auto gemm = [&](int64_t e, int proj, const float* in, int64_t rows, float* dst) {
    if (e == num_experts) {
      shared.gemm(proj, in, rows, dst);
    } else if (proj == fastdeploy_cpu::kMoeW13) {
      fastdeploy_cpu::gguf_gemm(in, rows, hidden, p13 + e * bytes13, w13_segments.data(), n13, nullptr, rows13, isa,
                                dst);
    } else {
      fastdeploy_cpu::gguf_gemm(in, rows, inter, p2 + e * bytes2, w2_segments.data(), n2, nullptr, hidden, isa, dst);
    }
  };
  fastdeploy_cpu::fused_moe_grouped(x.data<float>(), num_tokens, hidden, topk_ids.data<int64_t>(),
                                    topk_weights.data<float>(), top_k, num_experts, inter, gemm, out.data<float>(),
                                    shared.settings(), bytes13 + bytes2);
  return {out};
}

PD_BUILD_OP(fd_gguf_fused_moe)
    .Inputs({"x", "topk_ids", "topk_weights", "w13", "w2", paddle::Optional("shared_w13"), paddle::Optional("shared_w2"),
             paddle::Optional("shared_weights")})
    .Outputs({"out"})
    .Attrs({"w13_segments: std::vector<int64_t>", "w2_segments: std::vector<int64_t>", "isa: int",
            "shared_inter: int64_t", "shared_dtype: std::string", "shared_w13_segments: std::vector<int64_t>",
            "shared_w2_segments: std::vector<int64_t>", "shared_gguf_isa: int"})
    .SetKernelFn(PD_KERNEL(GgufFusedMoE));
