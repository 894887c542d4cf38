// Fused mixture-of-experts forward on packed expert weights.
//
// `fd_fused_moe` takes the router's choice (top-k expert ids and weights per token) and:
//   1. groups the (token, slot) pairs by expert with a counting sort (stable: token order,
//      then slot order, so the grouping is a pure function of the ids);
//   2. for every expert that got tokens, gathers their rows and runs one GEMM over them
//      (gate/up fused, [n, H] x [H, 2I]), SiLU-and-mul, one GEMM for down ([n, I] x [I, H]);
//      experts that got no token cost nothing;
//   3. writes each pair's output into its own row, and reduces every token's k rows in slot
//      order, weighted by the router.
// The GEMMs are linear.cc's (oneDNN, or the panel kernel on AVX2 CPUs) on weights packed by
// fd_linear_pack, each expert's packed bytes one row of a [E, bytes] tensor.
//
// Batch invariance: a token's output depends only on its own row and its experts. The GEMM
// kernels compute each row independently of the other rows (linear_forward keeps that for
// M = 1 too), SiLU-and-mul is per row, and the final sum runs over the token's own slots in
// a fixed order; so which other tokens share an expert, and how many, changes nothing.
#include <algorithm>
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"

namespace {

// Per-call scratch, kept per thread so steps do not reallocate.
struct MoeScratch {
  std::vector<int64_t> counts, offsets, order;
  std::vector<float> x_rows, gate_up, act, y_rows;
};

MoeScratch& scratch() {
  thread_local MoeScratch s;
  return s;
}

}  // namespace

namespace fastdeploy_cpu {

void fused_moe(const float* x, int64_t num_tokens, int64_t hidden, const int64_t* topk_ids,
               const float* topk_weights, int64_t top_k, const uint8_t* w13, int64_t w13_stride, const uint8_t* w2,
               int64_t w2_stride, int64_t num_experts, int64_t inter, bool bf16, float* out) {
  const int64_t pairs = num_tokens * top_k;
  MoeScratch& s = scratch();
  s.counts.assign(num_experts, 0);
  for (int64_t p = 0; p < pairs; ++p) s.counts[topk_ids[p]]++;
  s.offsets.assign(num_experts + 1, 0);
  int64_t max_rows = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    s.offsets[e + 1] = s.offsets[e] + s.counts[e];
    max_rows = std::max(max_rows, s.counts[e]);
  }
  // order[offsets[e] .. offsets[e + 1]) = the pairs (t * top_k + slot) routed to e, ascending.
  s.order.resize(pairs);
  std::vector<int64_t>& fill = s.counts;
  std::fill(fill.begin(), fill.end(), 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = topk_ids[p];
    s.order[s.offsets[e] + fill[e]++] = p;
  }
  s.x_rows.resize(max_rows * hidden);
  s.gate_up.resize(max_rows * 2 * inter);
  s.act.resize(max_rows * inter);
  s.y_rows.resize(pairs * hidden);
  std::vector<float> expert_out(max_rows * hidden);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t begin = s.offsets[e], rows = s.offsets[e + 1] - begin;
    if (rows == 0) continue;
    const int64_t* pair_ids = s.order.data() + begin;
#pragma omp parallel for if (rows * hidden >= (1 << 15)) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(s.x_rows.data() + r * hidden, x + (pair_ids[r] / top_k) * hidden, hidden * sizeof(float));
    linear_forward(s.x_rows.data(), rows, hidden, w13 + e * w13_stride, nullptr, 2 * inter, bf16, s.gate_up.data());
    silu_and_mul(s.gate_up.data(), rows, inter, s.act.data());
    linear_forward(s.act.data(), rows, inter, w2 + e * w2_stride, nullptr, hidden, bf16, expert_out.data());
#pragma omp parallel for if (rows * hidden >= (1 << 15)) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(s.y_rows.data() + pair_ids[r] * hidden, expert_out.data() + r * hidden, hidden * sizeof(float));
  }
  // Each token's slots in slot order: the same sum whatever else ran in the step.
#pragma omp parallel for if (pairs * hidden >= (1 << 15)) schedule(static)
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* dst = out + t * hidden;
    std::fill(dst, dst + hidden, 0.0f);
    for (int64_t k = 0; k < top_k; ++k) {
      const float w = topk_weights[t * top_k + k];
      const float* src = s.y_rows.data() + (t * top_k + k) * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) dst[i] += w * src[i];
    }
  }
}

}  // namespace fastdeploy_cpu

// x [T, H] fp32; topk_ids [T, K] int64 in [0, E); topk_weights [T, K] fp32; w13 [E, bytes] uint8 (each row
// one expert's [H, 2I] gate|up weight packed by fd_linear_pack); w2 [E, bytes] ([I, H] packed) -> [T, H] fp32.
std::vector<paddle::Tensor> FusedMoE(const paddle::Tensor& x, const paddle::Tensor& topk_ids,
                                     const paddle::Tensor& topk_weights, const paddle::Tensor& w13,
                                     const paddle::Tensor& w2, int64_t inter, const std::string& dtype) {
  using fastdeploy_cpu::check_cpu_contiguous;
  using fastdeploy_cpu::check_dtype;
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(topk_ids, "topk_ids");
  check_cpu_contiguous(topk_weights, "topk_weights");
  check_cpu_contiguous(w13, "w13");
  check_cpu_contiguous(w2, "w2");
  check_dtype(x, paddle::DataType::FLOAT32, "x");
  check_dtype(topk_ids, paddle::DataType::INT64, "topk_ids");
  check_dtype(topk_weights, paddle::DataType::FLOAT32, "topk_weights");
  PD_CHECK(dtype == "bfloat16" || dtype == "float32", "fd_fused_moe: dtype must be 'bfloat16' or 'float32'.");
  PD_CHECK(x.shape().size() == 2 && topk_ids.shape().size() == 2, "fd_fused_moe: x must be [T, H], topk_ids [T, K].");
  PD_CHECK(topk_weights.shape() == topk_ids.shape(), "fd_fused_moe: topk_weights must have topk_ids' shape.");
  PD_CHECK(w13.shape().size() == 2 && w2.shape().size() == 2 && w13.shape()[0] == w2.shape()[0],
           "fd_fused_moe: w13 and w2 must be [E, bytes] with the same E.");
  const int64_t num_tokens = x.shape()[0], hidden = x.shape()[1], top_k = topk_ids.shape()[1];
  const int64_t num_experts = w13.shape()[0];
  const bool bf16 = dtype == "bfloat16";
  PD_CHECK(topk_ids.shape()[0] == num_tokens, "fd_fused_moe: topk_ids must have one row per token.");
  PD_CHECK(fastdeploy_cpu::linear_packed_size_ok(w13.shape()[1], hidden, 2 * inter, bf16) &&
               fastdeploy_cpu::linear_packed_size_ok(w2.shape()[1], inter, hidden, bf16),
           "fd_fused_moe: the packed expert weights do not match H = " + std::to_string(hidden) +
               ", I = " + std::to_string(inter) + " in " + dtype + ".");
  const int64_t* ids = topk_ids.data<int64_t>();
  for (int64_t p = 0; p < num_tokens * top_k; ++p)
    PD_CHECK(ids[p] >= 0 && ids[p] < num_experts, "fd_fused_moe: an expert id is out of range.");
  auto out = paddle::empty({num_tokens, hidden}, paddle::DataType::FLOAT32, x.place());
  if (num_tokens == 0) return {out};
  fastdeploy_cpu::fused_moe(x.data<float>(), num_tokens, hidden, ids, topk_weights.data<float>(), top_k,
                            w13.data<uint8_t>(), w13.shape()[1], w2.data<uint8_t>(), w2.shape()[1], num_experts, inter,
                            bf16, out.data<float>());
  return {out};
}

PD_BUILD_OP(fd_fused_moe)
    .Inputs({"x", "topk_ids", "topk_weights", "w13", "w2"})
    .Outputs({"out"})
    .Attrs({"inter: int64_t", "dtype: std::string"})
    .SetKernelFn(PD_KERNEL(FusedMoE));
