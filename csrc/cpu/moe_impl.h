// The one grouping / gather / SwiGLU / weighted-sum code path of the fused MoE ops, over any
// expert weight format. Included by moe.cc (weights packed by fd_linear_pack, oneDNN / panel
// GEMM) and moe_quant.cc (int_gemm.cc's integers, gguf_gemm.cc's blocks); each supplies the
// per-expert GEMM as a functor:
//
//   gemm(e, proj, in, rows, out): out[rows, n] = in[rows, k] @ expert e's matrix `proj`, where
//     proj kMoeW13: k = H, n = 2I (gate columns, then up columns); proj kMoeW2: k = I, n = H.
//
// `fused_moe_grouped`:
//   1. groups the (token, slot) pairs by expert with a counting sort (stable: token order,
//      then slot order, so the grouping is a pure function of the ids);
//   2. for every expert that got tokens, gathers their rows and runs the format's GEMM over
//      them (gate/up fused), SiLU-and-mul, the GEMM for down; experts that got no token cost nothing;
//   3. writes each pair's output into its own row, and reduces every token's k rows in slot
//      order, weighted by the router.
//
// Batch invariance: a token's output depends only on its own row and its experts, provided the
// format's GEMM computes each row independently of the other rows (every kernel here does:
// oneDNN / panel rows, int_gemm's per-row FMAs, gguf_gemm's per-row activation quantization);
// SiLU-and-mul is per row and the final sum runs over the token's own slots in a fixed order.
#pragma once

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"

namespace fastdeploy_cpu {

enum MoeProj : int { kMoeW13 = 0, kMoeW2 = 1 };

// Per-call scratch, kept per thread so steps do not reallocate.
struct MoeScratch {
  std::vector<int64_t> counts, offsets, order;
  std::vector<float> x_rows, gate_up, act, y_rows, expert_out;
};

inline MoeScratch& moe_scratch() {
  thread_local MoeScratch s;
  return s;
}

template <class ExpertGemm>
void fused_moe_grouped(const float* x, int64_t num_tokens, int64_t hidden, const int64_t* topk_ids,
                       const float* topk_weights, int64_t top_k, int64_t num_experts, int64_t inter,
                       const ExpertGemm& gemm, float* out) {
  const int64_t pairs = num_tokens * top_k;
  MoeScratch& s = moe_scratch();
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
  s.expert_out.resize(max_rows * hidden);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t begin = s.offsets[e], rows = s.offsets[e + 1] - begin;
    if (rows == 0) continue;
    const int64_t* pair_ids = s.order.data() + begin;
#pragma omp parallel for if (rows * hidden >= (1 << 15)) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(s.x_rows.data() + r * hidden, x + (pair_ids[r] / top_k) * hidden, hidden * sizeof(float));
    gemm(e, kMoeW13, s.x_rows.data(), rows, s.gate_up.data());
    silu_and_mul(s.gate_up.data(), rows, inter, s.act.data());
    gemm(e, kMoeW2, s.act.data(), rows, s.expert_out.data());
#pragma omp parallel for if (rows * hidden >= (1 << 15)) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(s.y_rows.data() + pair_ids[r] * hidden, s.expert_out.data() + r * hidden, hidden * sizeof(float));
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

// The ops' common checks of x [T, H] fp32, topk_ids [T, K] int64 in [0, num_experts) and
// topk_weights [T, K] fp32; returns (T, H, K).
struct MoeRouting {
  int64_t num_tokens, hidden, top_k;
};

inline MoeRouting check_moe_routing(const paddle::Tensor& x, const paddle::Tensor& topk_ids,
                                    const paddle::Tensor& topk_weights, int64_t num_experts, const std::string& op) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(topk_ids, "topk_ids");
  check_cpu_contiguous(topk_weights, "topk_weights");
  check_dtype(x, paddle::DataType::FLOAT32, "x");
  check_dtype(topk_ids, paddle::DataType::INT64, "topk_ids");
  check_dtype(topk_weights, paddle::DataType::FLOAT32, "topk_weights");
  PD_CHECK(x.shape().size() == 2 && topk_ids.shape().size() == 2, op + ": x must be [T, H], topk_ids [T, K].");
  PD_CHECK(topk_weights.shape() == topk_ids.shape(), op + ": topk_weights must have topk_ids' shape.");
  const MoeRouting r{x.shape()[0], x.shape()[1], topk_ids.shape()[1]};
  PD_CHECK(topk_ids.shape()[0] == r.num_tokens, op + ": topk_ids must have one row per token.");
  const int64_t* ids = topk_ids.data<int64_t>();
  for (int64_t p = 0; p < r.num_tokens * r.top_k; ++p)
    PD_CHECK(ids[p] >= 0 && ids[p] < num_experts, op + ": an expert id is out of range.");
  return r;
}

}  // namespace fastdeploy_cpu
