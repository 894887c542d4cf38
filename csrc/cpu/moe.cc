// Fused mixture-of-experts forward on expert weights packed by fd_linear_pack (bf16 or fp32).
//
// The grouping, gather, SiLU-and-mul and weighted sum are moe_impl.h's (shared with the
// quantized formats of moe_quant.cc); the per-expert GEMM here is linear.cc's (oneDNN, or the
// panel kernel on AVX2 CPUs), each expert's packed bytes one row of a [E, bytes] tensor.
// linear_forward computes each row independently of the others (M = 1 too), which keeps the
// op batch-invariant (see moe_impl.h).
#include "moe_impl.h"

namespace fastdeploy_cpu {

void fused_moe(const float* x, int64_t num_tokens, int64_t hidden, const int64_t* topk_ids,
               const float* topk_weights, int64_t top_k, const uint8_t* w13, int64_t w13_stride, const uint8_t* w2,
               int64_t w2_stride, int64_t num_experts, int64_t inter, bool bf16, float* out) {
  const auto gemm = [&](int64_t e, int proj, const float* in, int64_t rows, float* dst) {
    if (proj == kMoeW13) {
      linear_forward(in, rows, hidden, w13 + e * w13_stride, nullptr, 2 * inter, bf16, dst);
    } else {
      linear_forward(in, rows, inter, w2 + e * w2_stride, nullptr, hidden, bf16, dst);
    }
  };
  fused_moe_grouped(x, num_tokens, hidden, topk_ids, topk_weights, top_k, num_experts, inter, gemm, out);
}

}  // namespace fastdeploy_cpu

// x [T, H] fp32; topk_ids [T, K] int64 in [0, E); topk_weights [T, K] fp32; w13 [E, bytes] uint8 (each row
// one expert's [H, 2I] gate|up weight packed by fd_linear_pack); w2 [E, bytes] ([I, H] packed) -> [T, H] fp32.
std::vector<paddle::Tensor> FusedMoE(const paddle::Tensor& x, const paddle::Tensor& topk_ids,
                                     const paddle::Tensor& topk_weights, const paddle::Tensor& w13,
                                     const paddle::Tensor& w2, int64_t inter, const std::string& dtype) {
  PD_CHECK(dtype == "bfloat16" || dtype == "float32", "fd_fused_moe: dtype must be 'bfloat16' or 'float32'.");
  fastdeploy_cpu::check_cpu_contiguous(w13, "w13");
  fastdeploy_cpu::check_cpu_contiguous(w2, "w2");
  PD_CHECK(w13.shape().size() == 2 && w2.shape().size() == 2 && w13.shape()[0] == w2.shape()[0],
           "fd_fused_moe: w13 and w2 must be [E, bytes] with the same E.");
  const int64_t num_experts = w13.shape()[0];
  const auto [num_tokens, hidden, top_k] =
      fastdeploy_cpu::check_moe_routing(x, topk_ids, topk_weights, num_experts, "fd_fused_moe");
  const bool bf16 = dtype == "bfloat16";
  PD_CHECK(fastdeploy_cpu::linear_packed_size_ok(w13.shape()[1], hidden, 2 * inter, bf16) &&
               fastdeploy_cpu::linear_packed_size_ok(w2.shape()[1], inter, hidden, bf16),
           "fd_fused_moe: the packed expert weights do not match H = " + std::to_string(hidden) +
               ", I = " + std::to_string(inter) + " in " + dtype + ".");
  auto out = paddle::empty({num_tokens, hidden}, paddle::DataType::FLOAT32, x.place());
  if (num_tokens == 0) return {out};
  fastdeploy_cpu::fused_moe(x.data<float>(), num_tokens, hidden, topk_ids.data<int64_t>(), topk_weights.data<float>(), top_k,
                            w13.data<uint8_t>(), w13.shape()[1], w2.data<uint8_t>(), w2.shape()[1], num_experts, inter,
                            bf16, out.data<float>());
  return {out};
}

PD_BUILD_OP(fd_fused_moe)
    .Inputs({"x", "topk_ids", "topk_weights", "w13", "w2"})
    .Outputs({"out"})
    .Attrs({"inter: int64_t", "dtype: std::string"})
    .SetKernelFn(PD_KERNEL(FusedMoE));
