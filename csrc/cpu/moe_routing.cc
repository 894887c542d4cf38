// Mixture-of-experts routing in one op (vLLM's `topk_softmax` and `grouped_topk`): each token's
// router logits -> its top-k experts and their weights, the variants of
// fastdeploy/model_executor/layers/fused_moe/router.py's select_experts (its reference):
//
//   scores  = softmax(logits) or sigmoid(logits), fp32;
//   choice  = scores (+ a per-expert correction bias, which chooses but does not weigh);
//   grouped = experts split into G equal groups, each scored by its best choice (by the sum of its
//             two best where there is a bias: DeepSeek-V3), the best `topk_group` groups kept;
//   ids     = the k largest choices of the kept experts, descending (equal values: lower id first);
//   weights = scores[ids] (/ their sum, floored at renormalize_min when > 0) * routed_scaling_factor.
//
// The Python version is seven to fifteen Paddle ops per MoE layer and step (35-150 us at decode
// sizes, measured on an EPYC core); this is one pass over each token's row. Rows are independent:
// a token's experts never depend on the rest of the batch.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cpu_utils.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// a before b in the top-k order: NaN counts as the largest value, as paddle.topk takes it (a NaN
// router output then shows in the weights instead of being routed around).
inline bool above(float a, float b) { return (std::isnan(a) && !std::isnan(b)) || a > b; }

// The indices of the k largest of v[0, n), descending (equal values: the lower index first), in one
// pass: an insertion into the k best so far, which most values skip after one comparison.
void top_k(const float* v, int64_t n, int64_t k, int64_t* idx, float* val) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (count == k && !above(v[i], val[k - 1])) continue;
    int64_t pos = count < k ? count++ : k - 1;
    for (; pos > 0 && above(v[i], val[pos - 1]); --pos) {
      val[pos] = val[pos - 1];
      idx[pos] = idx[pos - 1];
    }
    val[pos] = v[i];
    idx[pos] = i;
  }
}

struct Routing {
  int64_t experts, top_k, groups, topk_group;
  bool renormalize, sigmoid;
  float scaling, renormalize_min;
  const float* bias;
};

// Per-thread scratch of route_token.
struct Scratch {
  std::vector<float> scores, choice, masked, group_scores, best_val;
  std::vector<int64_t> best;
  Scratch(int64_t experts, int64_t groups, int64_t top_k)
      : scores(experts), choice(experts), masked(experts), group_scores(groups), best_val(std::max(groups, top_k)),
        best(std::max(groups, top_k)) {}
};

// One token: logits [E] -> ids [K], weights [K].
void route_token(const Routing& r, const float* logits, int64_t* ids, float* weights, Scratch& s) {
  std::vector<float>& scores = s.scores;
  std::vector<float>& choice = s.choice;
  const int64_t e_count = r.experts;
  if (r.sigmoid) {
    for (int64_t e = 0; e < e_count; ++e) scores[e] = 1.0f / (1.0f + std::exp(-logits[e]));
  } else {
    float mx = logits[0];
    for (int64_t e = 1; e < e_count; ++e) mx = std::max(mx, logits[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < e_count; ++e) sum += scores[e] = std::exp(logits[e] - mx);
    for (int64_t e = 0; e < e_count; ++e) scores[e] /= sum;
  }
  for (int64_t e = 0; e < e_count; ++e) choice[e] = r.bias != nullptr ? scores[e] + r.bias[e] : scores[e];
  if (r.groups > 1) {
    const int64_t size = e_count / r.groups;
    for (int64_t g = 0; g < r.groups; ++g) {
      const float* c = choice.data() + g * size;
      if (r.bias != nullptr && size > 1) {  // the sum of the group's two best
        int64_t two[2];
        float top2[2];
        top_k(c, size, 2, two, top2);
        s.group_scores[g] = top2[0] + top2[1];
      } else {
        int64_t one;
        top_k(c, size, 1, &one, &s.group_scores[g]);
      }
    }
    top_k(s.group_scores.data(), r.groups, r.topk_group, s.best.data(), s.best_val.data());
    std::fill(s.masked.begin(), s.masked.end(), kNegInf);
    for (int64_t i = 0; i < r.topk_group; ++i) {
      const int64_t g = s.best[i];
      std::copy(choice.begin() + g * size, choice.begin() + (g + 1) * size, s.masked.begin() + g * size);
    }
    choice.swap(s.masked);
  }
  top_k(choice.data(), e_count, r.top_k, ids, s.best_val.data());
  float sum = 0.0f;
  for (int64_t k = 0; k < r.top_k; ++k) {
    weights[k] = scores[ids[k]];
    sum += weights[k];
  }
  if (r.renormalize) {
    const float denom = r.renormalize_min > 0.0f ? std::max(sum, r.renormalize_min) : sum;
    for (int64_t k = 0; k < r.top_k; ++k) weights[k] /= denom;
  }
  if (r.scaling != 1.0f) {
    for (int64_t k = 0; k < r.top_k; ++k) weights[k] *= r.scaling;
  }
}

}  // namespace

// logits [T, E] fp32, bias [E] or [1, E] fp32 (optional) -> (weights [T, K] fp32, ids [T, K] int64).
std::vector<paddle::Tensor> SelectExperts(const paddle::Tensor& logits, const paddle::optional<paddle::Tensor>& bias,
                                          int64_t top_k, bool renormalize, const std::string& scoring_func,
                                          int64_t num_expert_group, int64_t topk_group, float routed_scaling_factor,
                                          float renormalize_min) {
  const std::string op = "fd_select_experts";
  fastdeploy_cpu::check_cpu_contiguous(logits, "router_logits");
  fastdeploy_cpu::check_dtype(logits, paddle::DataType::FLOAT32, "router_logits");
  PD_CHECK(logits.shape().size() == 2, op + ": router_logits must be [T, E].");
  const int64_t tokens = logits.shape()[0], experts = logits.shape()[1];
  PD_CHECK(top_k > 0 && top_k <= experts, op + ": top_k must be in [1, " + std::to_string(experts) + "].");
  PD_CHECK(scoring_func == "softmax" || scoring_func == "sigmoid", op + ": scoring_func must be softmax or sigmoid.");
  const int64_t groups = std::max<int64_t>(num_expert_group, 1);
  PD_CHECK(experts % groups == 0, op + ": num_expert_group must divide the experts.");
  PD_CHECK(groups == 1 || (topk_group > 0 && topk_group <= groups && top_k <= topk_group * (experts / groups)),
           op + ": topk_group must be in [1, num_expert_group] and its groups hold at least top_k experts.");
  const float* bias_data = nullptr;
  if (bias.is_initialized()) {
    fastdeploy_cpu::check_cpu_contiguous(*bias, "e_score_correction_bias");
    fastdeploy_cpu::check_dtype(*bias, paddle::DataType::FLOAT32, "e_score_correction_bias");
    PD_CHECK(bias->numel() == experts, op + ": e_score_correction_bias must have one value per expert.");
    bias_data = bias->data<float>();
  }
  auto weights = paddle::empty({tokens, top_k}, paddle::DataType::FLOAT32, logits.place());
  auto ids = paddle::empty({tokens, top_k}, paddle::DataType::INT64, logits.place());
  if (tokens == 0) return {weights, ids};
  const Routing r{experts, top_k, groups, groups > 1 ? topk_group : 1, renormalize, scoring_func == "sigmoid",
                  routed_scaling_factor, renormalize_min, bias_data};
  const float* in = logits.data<float>();
  float* w = weights.data<float>();
  int64_t* id = ids.data<int64_t>();
#pragma omp parallel if (tokens >= 64)
  {
    Scratch scratch(experts, groups, top_k);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) route_token(r, in + t * experts, id + t * top_k, w + t * top_k, scratch);
  }
  return {weights, ids};
}

PD_BUILD_OP(fd_select_experts)
    .Inputs({"router_logits", paddle::Optional("e_score_correction_bias")})
    .Outputs({"topk_weights", "topk_ids"})
    .Attrs({"top_k: int64_t", "renormalize: bool", "scoring_func: std::string", "num_expert_group: int64_t",
            "topk_group: int64_t", "routed_scaling_factor: float", "renormalize_min: float"})
    .SetKernelFn(PD_KERNEL(SelectExperts));
