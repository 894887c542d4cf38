// Random sampling's two passes over the whole vocabulary, for fastdeploy's numpy sampler
// (model_executor/layers/sampler.py), which ran them as seven numpy passes (row max, subtract,
// scale, exp; block sums, their cumulative sum, the search): ~0.85 ms of a 16-row step over a
// 49,152-token vocabulary on one AVX-512 core, ~5% of a 16-stream GGUF decode step.
//
//   fd_exp_scaled(x, inv_temperature):  x = exp((x - max(x)) * inv_t) per row, in place (the row's
//     unnormalised probabilities: its maximum is 1; -inf gives exactly 0)
//   fd_inverse_cdf_sample(weights, uniform) -> ids:  per row the first column whose cumulative
//     weight exceeds uniform * total; past the end by rounding, the last positive one. Two levels,
//     as the numpy sampler: the block of kCdfBlock columns holding the quantile from the block
//     sums (in double), then the column inside it.
//   fd_sample_random(x, inv_temperature, uniform) -> ids:  the two in one call, the block sums taken
//     in the exp pass (rows that sample the whole vocabulary).
//
// Rows are independent (one thread each where the batch is large enough), so a row's result
// never depends on the rest of the batch.
#include <limits>
#include <vector>

#include "cpu_utils.h"

namespace {

// The numpy sampler's _CDF_BLOCK.
constexpr int64_t kCdfBlock = 256;

double block_sum(const float* w, int64_t n) {
  double s = 0.0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(w[i]);
  return s;
}

// The first column of w[0, n) whose running sum exceeds target; past the end, the last positive one.
int64_t first_above(const float* w, int64_t n, double target) {
  double cum = 0.0;
  int64_t last_positive = n - 1;
  for (int64_t i = 0; i < n; ++i) {
    cum += static_cast<double>(w[i]);
    if (cum > target) return i;
  }
  while (last_positive > 0 && !(w[last_positive] > 0.0f)) --last_positive;
  return last_positive;
}

// block_cum[b]: the weights of blocks 0..b, summed in double.
void block_sums(const float* w, int64_t n, std::vector<double>& block_cum) {
  const int64_t blocks = (n + kCdfBlock - 1) / kCdfBlock;
  block_cum.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    total += block_sum(w + b * kCdfBlock, std::min(kCdfBlock, n - b * kCdfBlock));
    block_cum[b] = total;
  }
}

// x = exp((x - max) * inv_t); with block_cum also what block_sums gives, each block summed while it is in L1.
void exp_scaled_row(float* x, int64_t n, float inv_t, std::vector<double>* block_cum) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  // numpy gives NaN for a row with no finite logit: every weight 0 instead (sampling then takes the last column).
  const bool empty = m == -std::numeric_limits<float>::infinity();
  const int64_t blocks = (n + kCdfBlock - 1) / kCdfBlock;
  if (block_cum != nullptr) block_cum->resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    float* xb = x + b * kCdfBlock;
    const int64_t len = std::min(kCdfBlock, n - b * kCdfBlock);
    if (empty) {
      std::fill(xb, xb + len, 0.0f);
    } else {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) xb[i] = fastdeploy_cpu::exp_approx((xb[i] - m) * inv_t);
    }
    if (block_cum != nullptr) {
      total += block_sum(xb, len);
      (*block_cum)[b] = total;
    }
  }
}

int64_t draw(const float* w, int64_t n, double u, const std::vector<double>& block_cum) {
  const int64_t blocks = static_cast<int64_t>(block_cum.size());
  double target = u * block_cum.back();
  int64_t b = 0;
  while (b < blocks - 1 && block_cum[b] <= target) ++b;
  if (b > 0) target -= block_cum[b - 1];
  return b * kCdfBlock + first_above(w + b * kCdfBlock, std::min(kCdfBlock, n - b * kCdfBlock), target);
}

// [rows, n] of a 2-D fp32 tensor.
std::pair<int64_t, int64_t> matrix_shape(const paddle::Tensor& t, const char* name) {
  fastdeploy_cpu::check_cpu_contiguous(t, name);
  fastdeploy_cpu::check_dtype(t, paddle::DataType::FLOAT32, name);
  PD_CHECK(t.shape().size() == 2, std::string(name) + " must be [rows, vocab].");
  return {t.shape()[0], t.shape()[1]};
}

void check_per_row(const paddle::Tensor& t, paddle::DataType dtype, int64_t rows, const char* name) {
  fastdeploy_cpu::check_cpu_contiguous(t, name);
  fastdeploy_cpu::check_dtype(t, dtype, name);
  PD_CHECK(t.numel() == rows, std::string(name) + " needs one value per row.");
}

}  // namespace

void ExpScaled(paddle::Tensor& x, const paddle::Tensor& inv_temperature) {
  const auto shape = matrix_shape(x, "x");
  const int64_t rows = shape.first, n = shape.second;
  check_per_row(inv_temperature, paddle::DataType::FLOAT32, rows, "inv_temperature");
  float* data = x.data<float>();
  const float* inv_t = inv_temperature.data<float>();
#pragma omp parallel for if (rows * n >= (1 << 17)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) exp_scaled_row(data + r * n, n, inv_t[r], nullptr);
}

// One draw per row of w [rows, n] from uniform; weigh(r, row, block_cum) leaves the row's weights
// in row and their block sums in block_cum.
template <class T, class Weigh>
paddle::Tensor draw_rows(T* w, int64_t rows, int64_t n, const paddle::Tensor& uniform, const paddle::Place& place,
                         Weigh weigh) {
  check_per_row(uniform, paddle::DataType::FLOAT64, rows, "uniform");
  PD_CHECK(n > 0, "sampling: a row needs at least one column.");
  auto out = paddle::empty({rows}, paddle::DataType::INT64, place);
  const double* u = uniform.data<double>();
  int64_t* ids = out.data<int64_t>();
#pragma omp parallel if (rows * n >= (1 << 17))
  {
    std::vector<double> block_cum;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      weigh(r, w + r * n, block_cum);
      ids[r] = draw(w + r * n, n, u[r], block_cum);
    }
  }
  return out;
}

std::vector<paddle::Tensor> InverseCdfSample(const paddle::Tensor& weights, const paddle::Tensor& uniform) {
  const auto shape = matrix_shape(weights, "weights");
  const int64_t n = shape.second;
  return {draw_rows(weights.data<float>(), shape.first, n, uniform, weights.place(),
                    [n](int64_t, const float* row, std::vector<double>& block_cum) { block_sums(row, n, block_cum); })};
}

// Both in one call, for rows sampled from the whole vocabulary (no min_p / top-k / top-p): x is
// left holding the weights.
std::vector<paddle::Tensor> SampleRandom(paddle::Tensor& x, const paddle::Tensor& inv_temperature,
                                         const paddle::Tensor& uniform) {
  const auto shape = matrix_shape(x, "x");
  const int64_t n = shape.second;
  check_per_row(inv_temperature, paddle::DataType::FLOAT32, shape.first, "inv_temperature");
  const float* inv_t = inv_temperature.data<float>();
  return {draw_rows(x.data<float>(), shape.first, n, uniform, x.place(),
                    [n, inv_t](int64_t r, float* row, std::vector<double>& block_cum) {
                      exp_scaled_row(row, n, inv_t[r], &block_cum);
                    })};
}

PD_BUILD_OP(fd_exp_scaled)
    .Inputs({"x", "inv_temperature"})
    .Outputs({"x_out"})
    .SetInplaceMap({{"x", "x_out"}})
    .SetKernelFn(PD_KERNEL(ExpScaled));

PD_BUILD_OP(fd_inverse_cdf_sample)
    .Inputs({"weights", "uniform"})
    .Outputs({"ids"})
    .SetKernelFn(PD_KERNEL(InverseCdfSample));

PD_BUILD_OP(fd_sample_random)
    .Inputs({"x", "inv_temperature", "uniform"})
    .Outputs({"ids", "x_out"})
    .SetInplaceMap({{"x", "x_out"}})
    .SetKernelFn(PD_KERNEL(SampleRandom));
