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
//      them (gate/up fused), SiLU-and-mul, the GEMM for down; experts that got no token cost nothing.
//      The block's shared experts, where the op runs them, are expert index E (num_experts) of the
//      functor, over every token. Each GEMM is split over the threads, or in a decode step each
//      expert runs whole on one thread (expert tasks, below);
//   3. writes each pair's output into its own row, and reduces every token's k rows in slot
//      order, weighted by the router, then adds its shared experts' row.
//
// Batch invariance: a token's output depends only on its own row and its experts, provided the
// format's GEMM computes each row independently of the other rows (every kernel here does:
// oneDNN / panel rows, int_gemm's per-row FMAs, gguf_gemm's per-row activation quantization);
// SiLU-and-mul is per row and the final sum runs over the token's own slots in a fixed order.
#pragma once

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"

namespace fastdeploy_cpu {

enum MoeProj : int { kMoeW13 = 0, kMoeW2 = 1 };

// Expert tasks: a step of up to kMoeTaskTokens tokens with at least kMoeTasksPerThread routed
// experts per thread runs each expert whole on one thread. A decode step's experts get a few rows
// each, so their GEMMs read weights: the threads stream different experts at once instead of
// meeting at a barrier after every GEMM. The shared experts' GEMMs, over every token, are bound by
// arithmetic from a few rows on: they go first in the task list, so that one thread computes them
// while the others stream, when one thread takes no longer over them than the others over the
// routed experts' bytes (kSharedMacsPerRoutedByte: one thread's 16-row int4 GEMM rate over its
// routed-expert read rate, ~75 GMAC/s over ~16 GB/s on the AVX512-BF16 EPYC); else (more threads)
// they run first, split over the threads.
constexpr int64_t kMoeTaskTokens = 32;
constexpr int64_t kMoeTasksPerThread = 2;
constexpr int64_t kSharedMacsPerRoutedByte = 4;

// Per-call scratch, kept per thread so steps do not reallocate: the grouping and the routed /
// shared outputs (the calling thread's), and one expert's rows (each thread running experts).
struct MoeScratch {
  std::vector<int64_t> counts, offsets, order, tasks;
  std::vector<float> y_rows, shared_out;
};

struct ExpertScratch {
  std::vector<float> x_rows, gate_up, act, expert_out;
};

inline MoeScratch& moe_scratch() {
  thread_local MoeScratch s;
  return s;
}

inline ExpertScratch& expert_scratch() {
  thread_local ExpertScratch s;
  return s;
}

// The shared experts of an MoE block run by the op itself: a SwiGLU of `inter` columns over every
// token, expert index E of the format's gemm; each token's output adds it after its routed experts',
// times token_weights[t] (Qwen2-MoE's sigmoid gate) where given. inter 0: none.
struct MoeShared {
  int64_t inter = 0;
  const float* token_weights = nullptr;
};

// One expert over its rows: gather them (pair_ids: the (token, slot) pairs it serves; none: every
// token in order, the shared experts), gate|up GEMM, SiLU-and-mul, down GEMM, each row written to
// dst's row pair_ids[r] (none: row r).
template <class ExpertGemm>
void expert_forward(int64_t e, const int64_t* pair_ids, int64_t rows, const float* x, int64_t hidden, int64_t top_k,
                    int64_t inter, const ExpertGemm& gemm, float* dst) {
  ExpertScratch& s = expert_scratch();
  const float* in = x;
  if (pair_ids != nullptr) {
    float* x_rows = sized(s.x_rows, rows * hidden);
#pragma omp parallel for if (rows * hidden >= (1 << 15) && !omp_in_parallel()) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(x_rows + r * hidden, x + (pair_ids[r] / top_k) * hidden, hidden * sizeof(float));
    in = x_rows;
  }
  float* gate_up = sized(s.gate_up, rows * 2 * inter);
  float* act = sized(s.act, rows * inter);
  gemm(e, kMoeW13, in, rows, gate_up);
  silu_and_mul(gate_up, rows, inter, act);
  if (pair_ids == nullptr) {
    gemm(e, kMoeW2, act, rows, dst);
    return;
  }
  float* expert_out = sized(s.expert_out, rows * hidden);
  gemm(e, kMoeW2, act, rows, expert_out);
#pragma omp parallel for if (rows * hidden >= (1 << 15) && !omp_in_parallel()) schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(dst + pair_ids[r] * hidden, expert_out + r * hidden, hidden * sizeof(float));
}

// expert_bytes: the bytes of one routed expert's weights where the format's gemm may run inside a
// parallel region (on the calling thread), which allows expert tasks (see there); 0: never.
template <class ExpertGemm>
void fused_moe_grouped(const float* x, int64_t num_tokens, int64_t hidden, const int64_t* topk_ids,
                       const float* topk_weights, int64_t top_k, int64_t num_experts, int64_t inter,
                       const ExpertGemm& gemm, float* out, const MoeShared& shared = {}, int64_t expert_bytes = 0) {
  const int64_t pairs = num_tokens * top_k;
  MoeScratch& s = moe_scratch();
  s.counts.assign(num_experts, 0);
  for (int64_t p = 0; p < pairs; ++p) s.counts[topk_ids[p]]++;
  s.offsets.assign(num_experts + 1, 0);
  for (int64_t e = 0; e < num_experts; ++e) s.offsets[e + 1] = s.offsets[e] + s.counts[e];
  // order[offsets[e] .. offsets[e + 1]) = the pairs (t * top_k + slot) routed to e, ascending.
  s.order.resize(pairs);
  std::vector<int64_t>& fill = s.counts;
  std::fill(fill.begin(), fill.end(), 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = topk_ids[p];
    s.order[s.offsets[e] + fill[e]++] = p;
  }
  // Every expert that got tokens (experts that got none cost nothing).
  s.tasks.clear();
  for (int64_t e = 0; e < num_experts; ++e)
    if (s.offsets[e + 1] > s.offsets[e]) s.tasks.push_back(e);
  float* y_rows = sized(s.y_rows, pairs * hidden);
  float* shared_out = shared.inter > 0 ? sized(s.shared_out, num_tokens * hidden) : nullptr;
  const int64_t* order = s.order.data();
  const int64_t* offsets = s.offsets.data();
  const auto run = [&](int64_t e) {
    if (e == num_experts) {
      expert_forward(e, nullptr, num_tokens, x, hidden, top_k, shared.inter, gemm, shared_out);
    } else {
      expert_forward(e, order + offsets[e], offsets[e + 1] - offsets[e], x, hidden, top_k, inter, gemm, y_rows);
    }
  };
  const int64_t routed = static_cast<int64_t>(s.tasks.size());
  const int threads = team_size(routed);
  const bool expert_tasks = expert_bytes > 0 && threads > 1 && num_tokens <= kMoeTaskTokens &&
                            routed >= kMoeTasksPerThread * threads;
  if (shared.inter > 0) {
    const int64_t shared_macs = num_tokens * 3 * hidden * shared.inter;
    if (expert_tasks && shared_macs * (threads - 1) <= kSharedMacsPerRoutedByte * routed * expert_bytes) {
      s.tasks.insert(s.tasks.begin(), num_experts);
    } else {
      run(num_experts);
    }
  }
  if (expert_tasks) {
    const int64_t num_tasks = static_cast<int64_t>(s.tasks.size());
    const int64_t* tasks = s.tasks.data();
    int64_t next = 0;
    // An error may not leave a parallel region (it would end the process): the first one stops the
    // tasks and is raised after it.
    std::exception_ptr error;
#pragma omp parallel num_threads(threads)
    for (;;) {
      int64_t i;
#pragma omp atomic capture
      i = next++;
      if (i >= num_tasks) break;
      try {
        run(tasks[i]);
      } catch (...) {
#pragma omp critical(fd_moe_task_error)
        if (!error) error = std::current_exception();
#pragma omp atomic write
        next = num_tasks;
      }
    }
    if (error) std::rethrow_exception(error);
  } else {
    for (const int64_t e : s.tasks) run(e);
  }
  // Each token's slots in slot order, then its shared experts: the same sum whatever else ran in
  // the step.
#pragma omp parallel for if (pairs * hidden >= (1 << 15)) schedule(static)
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* dst = out + t * hidden;
    std::fill(dst, dst + hidden, 0.0f);
    for (int64_t k = 0; k < top_k; ++k) {
      const float w = topk_weights[t * top_k + k];
      const float* src = y_rows + (t * top_k + k) * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) dst[i] += w * src[i];
    }
    if (shared_out != nullptr) {
      const float w = shared.token_weights != nullptr ? shared.token_weights[t] : 1.0f;
      const float* src = shared_out + t * hidden;
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
