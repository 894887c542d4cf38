// Linear layers through oneDNN's matmul with weights packed once at load time.
//
// `fd_linear_pack` reorders a [K, N] fp32 weight into the blocked layout oneDNN's
// brgemm kernels read (bf16 or fp32), `fd_linear` computes y = x @ W (+ bias) with
// fp32 input and output and fp32 accumulation. On CPUs with AMX or AVX512-BF16 the
// bf16 path runs on those units and reads half the bytes of fp32 weights, which is
// what bounds a decode step. On AVX2 CPUs without those, every linear runs on the panel
// kernel of panel_gemm.cc instead (see there why).
//
// The packed layout is chosen for a reference M and serves every M (checked: the
// brgemm implementation accepts it for M = 1 .. thousands); primitives are cached
// per exact (M, K, N) because a runtime-M primitive falls back to the reference
// implementation. The key holds the OpenMP thread count too: a primitive keeps the count it
// was created with, and the engine widens long steps to more threads (cpu_binding.WideSteps).
#include <omp.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cpu_utils.h"
#include "kernels.h"

namespace {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

// M the packed layout is negotiated for (any M works with it; see above).
constexpr int64_t kPackReferenceM = 32;
// Distinct (M, K, N) primitives kept; a prefill of a new length adds one per weight shape.
constexpr size_t kMaxCachedPrimitives = 512;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// One stream per calling thread: oneDNN streams must not be shared across threads.
dnnl::stream& cpu_stream() {
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

dt weight_type(const std::string& dtype) {
  if (dtype == "bfloat16") return dt::bf16;
  if (dtype == "float32") return dt::f32;
  PD_THROW("fd_linear: weight dtype must be 'bfloat16' or 'float32', got '" + dtype + "'.");
}

// W8A8 is keyed by its weights' type s8: u8 activations (with zero points, w8a8.cc) times s8
// weights into exact int32 sums, scaled afterwards. A u8 source needs no compensation for the
// weights (an s8 one does, and packs it beside them), and VNNI's vpdpbusd takes u8 x s8 as is.
dt int8_src_type(dt wdt) { return wdt == dt::s8 ? dt::u8 : wdt; }
dt int8_dst_type(dt wdt) { return wdt == dt::s8 ? dt::s32 : dt::f32; }

// Weight decompression (wint8 / wint4 / AWQ / GPTQ): bf16 activations x s8 weights whose scales
// cover `group` rows of K each (group = K: one scale per column). oneDNN widens the weights to
// bf16 inside its brgemm kernel (AVX512-BF16 / AMX); 4-bit values arrive as s8 (q - zero, exact)
// because oneDNN 3.6 has no optimized s4/u4 kernel without AMX, and grouped zero points send it
// to its reference code (checked on an AVX512-BF16 EPYC with ONEDNN_VERBOSE: s4/u4 weights, or
// u8 zero points per group, give "ref:any"; s8/u8 with per-channel or grouped scales give
// brg_matmul:avx512_core_bf16).
dnnl::primitive_attr weight_only_attr(int64_t group) {
  dnnl::primitive_attr attr;
  attr.set_fpmath_mode(dnnl::fpmath_mode::bf16, true);
  attr.set_scales(DNNL_ARG_WEIGHTS, (1 << 0) | (1 << 1), {group, 1}, dt::f32);
  return attr;
}

// The matmul's attributes: weight decompression when `group` > 0, else none (W8A8 scales its
// int32 sums afterwards).
dnnl::primitive_attr matmul_attr(int64_t group) { return group > 0 ? weight_only_attr(group) : dnnl::primitive_attr(); }

// The activations' and the output's types: bf16 in, fp32 out for weight decompression (its s8
// weights are not W8A8's), else W8A8's or the float weights' own.
dt source_type(dt wdt, int64_t group) { return group > 0 ? dt::bf16 : int8_src_type(wdt); }
dt dest_type(dt wdt, int64_t group) { return group > 0 ? dt::f32 : int8_dst_type(wdt); }

// The packed weight layout for (K, N, dtype[, group]), negotiated once with format_tag::any.
memory::desc packed_weight_desc(int64_t k, int64_t n, dt wdt, int64_t group = 0) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int64_t, int, int64_t>, memory::desc> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(k, n, static_cast<int>(wdt), group);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  dnnl::matmul::primitive_desc pd(cpu_engine(), memory::desc({kPackReferenceM, k}, source_type(wdt, group), tag::ab),
                                  memory::desc({k, n}, wdt, tag::any),
                                  memory::desc({kPackReferenceM, n}, dest_type(wdt, group), tag::ab),
                                  matmul_attr(group));
  memory::desc md = pd.weights_desc();
  cache.emplace(key, md);
  return md;
}

// W8A8's weights as a batch over K's groups: the source [G, M, group] u8, the weights
// [G, group, N] s8 in the layout negotiated once (format_tag::any), the sums [G, M, N] s32.
memory::desc w8a8_weight_desc(int64_t groups, int64_t group, int64_t n) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int64_t, int64_t>, memory::desc> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(groups, group, n);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  dnnl::matmul::primitive_desc pd(cpu_engine(), memory::desc({groups, kPackReferenceM, group}, dt::u8, tag::abc),
                                  memory::desc({groups, group, n}, dt::s8, tag::any),
                                  memory::desc({groups, kPackReferenceM, n}, dt::s32, tag::abc));
  memory::desc md = pd.weights_desc();
  cache.emplace(key, md);
  return md;
}

struct PrimitiveKey {
  int64_t m, k, n;
  int wdt;
  bool bias;
  int threads;
  int64_t group = 0;  // > 0: weight decompression with scales per `group` rows of K
  int64_t batch = 0;  // > 0: W8A8's matmul batched over `batch` groups of K (k is then one group's rows)
  bool operator==(const PrimitiveKey& o) const {
    return m == o.m && k == o.k && n == o.n && wdt == o.wdt && bias == o.bias && threads == o.threads &&
           group == o.group && batch == o.batch;
  }
};

struct PrimitiveKeyHash {
  size_t operator()(const PrimitiveKey& key) const {
    size_t h = std::hash<int64_t>()(key.m);
    h = h * 1000003u ^ std::hash<int64_t>()(key.k);
    h = h * 1000003u ^ std::hash<int64_t>()(key.n);
    h = h * 1000003u ^ std::hash<int>()(key.threads);
    h = h * 1000003u ^ std::hash<int64_t>()(key.group);
    h = h * 1000003u ^ std::hash<int64_t>()(key.batch);
    return h * 31u + static_cast<size_t>(key.wdt) * 2u + (key.bias ? 1u : 0u);
  }
};

struct CachedMatmul {
  dnnl::matmul primitive;
  memory::desc src, weights, bias, dst;
};

// LRU cache of matmul primitives by exact shape.
class MatmulCache {
 public:
  CachedMatmul get(const PrimitiveKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    if (it != map_.end()) {
      order_.splice(order_.begin(), order_, it->second.second);
      return it->second.first;
    }
    CachedMatmul entry = create(key);
    order_.push_front(key);
    map_.emplace(key, std::make_pair(entry, order_.begin()));
    if (map_.size() > kMaxCachedPrimitives) {
      map_.erase(order_.back());
      order_.pop_back();
    }
    return entry;
  }

 private:
  static CachedMatmul create(const PrimitiveKey& key) {
    const dt wdt = static_cast<dt>(key.wdt);
    CachedMatmul c;
    if (key.batch > 0) {
      c.src = memory::desc({key.batch, key.m, key.k}, dt::u8, tag::abc);
      c.weights = w8a8_weight_desc(key.batch, key.k, key.n);
      c.dst = memory::desc({key.batch, key.m, key.n}, dt::s32, tag::abc);
      c.primitive = dnnl::matmul(dnnl::matmul::primitive_desc(cpu_engine(), c.src, c.weights, c.dst));
      return c;
    }
    c.src = memory::desc({key.m, key.k}, source_type(wdt, key.group), tag::ab);
    c.weights = packed_weight_desc(key.k, key.n, wdt, key.group);
    c.dst = memory::desc({key.m, key.n}, dest_type(wdt, key.group), tag::ab);
    const dnnl::primitive_attr attr = matmul_attr(key.group);
    dnnl::matmul::primitive_desc pd;
    if (key.bias) {
      c.bias = memory::desc({1, key.n}, dt::f32, tag::ab);
      pd = dnnl::matmul::primitive_desc(cpu_engine(), c.src, c.weights, c.bias, c.dst, attr);
    } else {
      pd = dnnl::matmul::primitive_desc(cpu_engine(), c.src, c.weights, c.dst, attr);
    }
    // oneDNN's reference matmul is hundreds of times slower: never let a shape land there unseen.
    PD_CHECK(key.group == 0 || std::string(pd.impl_info_str()).rfind("ref", 0) != 0,
             "fd_weight_only_linear: oneDNN has no optimized weight-decompression kernel for K=" +
                 std::to_string(key.k) + ", N=" + std::to_string(key.n) + ", group=" + std::to_string(key.group) +
                 " on this CPU.");
    c.primitive = dnnl::matmul(pd);
    return c;
  }

  std::mutex mu_;
  std::list<PrimitiveKey> order_;
  std::unordered_map<PrimitiveKey, std::pair<CachedMatmul, std::list<PrimitiveKey>::iterator>, PrimitiveKeyHash>
      map_;
};

MatmulCache& matmul_cache() {
  static MatmulCache cache;
  return cache;
}

// fp32 activations -> bf16 in a per-thread scratch buffer reused across calls.
const uint16_t* to_bf16_scratch(const float* x, int64_t count) {
  thread_local std::vector<uint16_t> scratch;
  if (static_cast<int64_t>(scratch.size()) < count) scratch.resize(count);
  uint16_t* out = scratch.data();
#pragma omp parallel for simd if (count >= (1 << 16)) schedule(static)
  for (int64_t i = 0; i < count; ++i) out[i] = fastdeploy_cpu::float_to_bf16(x[i]);
  return out;
}

}  // namespace

// weight [K, N] float32 -> packed bytes (uint8 [size of oneDNN's blocked layout]).
std::vector<paddle::Tensor> LinearPack(const paddle::Tensor& weight, const std::string& dtype) {
  fastdeploy_cpu::check_cpu_contiguous(weight, "weight");
  fastdeploy_cpu::check_dtype(weight, paddle::DataType::FLOAT32, "weight");
  PD_CHECK(weight.shape().size() == 2, "fd_linear_pack: weight must be [K, N].");
  const int64_t k = weight.shape()[0], n = weight.shape()[1];
  const dt wdt = weight_type(dtype);
  if (fastdeploy_cpu::kPanelGemm) {
    const bool bf16 = wdt == dt::bf16;
    auto packed = paddle::empty({fastdeploy_cpu::panel_packed_bytes(k, n, bf16)}, paddle::DataType::UINT8, weight.place());
    fastdeploy_cpu::panel_pack(weight.data<float>(), k, n, bf16, packed.data());
    return {packed};
  }
  memory::desc packed_md = packed_weight_desc(k, n, wdt);
  auto packed = paddle::empty({static_cast<int64_t>(packed_md.get_size())}, paddle::DataType::UINT8, weight.place());
  memory src(memory::desc({k, n}, dt::f32, tag::ab), cpu_engine(), const_cast<float*>(weight.data<float>()));
  memory dst(packed_md, cpu_engine(), packed.data());
  dnnl::reorder(src, dst).execute(cpu_stream(), src, dst);
  cpu_stream().wait();
  return {packed};
}

// The inverse of fd_linear_pack: packed bytes -> [K, N] float32 (exact for float32; bf16-rounded values for bf16).
std::vector<paddle::Tensor> LinearUnpack(const paddle::Tensor& packed, int64_t k, int64_t n, const std::string& dtype) {
  fastdeploy_cpu::check_cpu_contiguous(packed, "packed");
  const bool bf16 = weight_type(dtype) == dt::bf16;
  PD_CHECK(fastdeploy_cpu::linear_packed_size_ok(packed.numel(), k, n, bf16),
           "fd_linear_unpack: the packed weight does not match [K, N] in " + dtype + ".");
  auto weight = paddle::empty({k, n}, paddle::DataType::FLOAT32, packed.place());
  if (fastdeploy_cpu::kPanelGemm) {
    fastdeploy_cpu::panel_unpack(packed.data(), k, n, bf16, weight.data<float>());
    return {weight};
  }
  memory::desc packed_md = packed_weight_desc(k, n, weight_type(dtype));
  memory src(packed_md, cpu_engine(), const_cast<void*>(packed.data()));
  memory dst(memory::desc({k, n}, dt::f32, tag::ab), cpu_engine(), weight.data<float>());
  dnnl::reorder(src, dst).execute(cpu_stream(), src, dst);
  cpu_stream().wait();
  return {weight};
}

namespace fastdeploy_cpu {

bool linear_packed_size_ok(int64_t packed_bytes, int64_t k, int64_t n, bool bf16) {
  if (kPanelGemm) return packed_bytes == panel_packed_bytes(k, n, bf16);
  return packed_bytes == static_cast<int64_t>(packed_weight_desc(k, n, bf16 ? dt::bf16 : dt::f32).get_size());
}

namespace {

// Runs `key`'s cached matmul (key.m rows) on `src_data` (rows of `elem`-byte values) and the packed
// weights, with `extra` execution arguments (the weights' scales). A single row runs as two (the
// second zero): oneDNN's M = 1 kernel splits long K differently from M >= 2, and a request's
// output must not depend on how many rows share its step (batch invariance). The weights are
// read once either way.
void execute_rows(PrimitiveKey key, const void* src_data, size_t elem, const void* packed, const float* bias,
                  float* out, const std::unordered_map<int, memory>& extra = {}) {
  const int64_t m = key.m, k = key.k, n = key.n;
  key.m = std::max<int64_t>(m, 2);
  thread_local std::vector<char> one_row_src;
  thread_local std::vector<float> one_row_dst;
  CachedMatmul mm = matmul_cache().get(key);
  float* dst_data = out;
  if (m == 1) {
    one_row_src.assign(2 * k * elem, 0);
    std::memcpy(one_row_src.data(), src_data, k * elem);
    src_data = one_row_src.data();
    one_row_dst.resize(2 * n);
    dst_data = one_row_dst.data();
  }
  auto& eng = cpu_engine();
  memory src(mm.src, eng, const_cast<void*>(src_data));
  memory weights(mm.weights, eng, const_cast<void*>(packed));
  memory dst(mm.dst, eng, dst_data);
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst}};
  if (bias != nullptr) args.emplace(DNNL_ARG_BIAS, memory(mm.bias, eng, const_cast<float*>(bias)));
  args.insert(extra.begin(), extra.end());
  mm.primitive.execute(cpu_stream(), args);
  cpu_stream().wait();
  if (m == 1) std::memcpy(out, dst_data, n * sizeof(float));
}

}  // namespace

void linear_forward(const float* x, int64_t m, int64_t k, const void* packed, const float* bias, int64_t n, bool bf16,
                    float* out) {
  if (m == 0) return;
  if (kPanelGemm) return panel_gemm(x, m, k, packed, bf16, bias, n, out);
  const dt wdt = bf16 ? dt::bf16 : dt::f32;
  const void* src_data = bf16 ? static_cast<const void*>(to_bf16_scratch(x, m * k)) : x;
  execute_rows({m, k, n, static_cast<int>(wdt), bias != nullptr, omp_get_max_threads()}, src_data,
               bf16 ? sizeof(uint16_t) : sizeof(float), packed, bias, out);
}

}  // namespace fastdeploy_cpu

// x [..., K] float32, packed weight from fd_linear_pack, optional bias [N] -> [..., N] float32.
std::vector<paddle::Tensor> Linear(const paddle::Tensor& x, const paddle::Tensor& packed,
                                   const paddle::optional<paddle::Tensor>& bias, int64_t n, const std::string& dtype) {
  const auto [m, k] = fastdeploy_cpu::check_linear_x(x, "fd_linear");
  const bool bf16 = weight_type(dtype) == dt::bf16;
  auto out = fastdeploy_cpu::linear_output(x, n);
  if (m == 0) return {out};
  PD_CHECK(fastdeploy_cpu::linear_packed_size_ok(packed.numel(), k, n, bf16),
           "fd_linear: the packed weight does not match [K, N] = [" + std::to_string(k) + ", " + std::to_string(n) +
               "] in " + dtype + ".");
  const float* bias_data = fastdeploy_cpu::optional_bias(bias, n, "fd_linear");
  fastdeploy_cpu::linear_forward(x.data<float>(), m, k, packed.data(), bias_data, n, bf16, out.data<float>());
  return {out};
}

PD_BUILD_OP(fd_linear_pack)
    .Inputs({"weight"})
    .Outputs({"packed"})
    .Attrs({"dtype: std::string"})
    .SetKernelFn(PD_KERNEL(LinearPack));

PD_BUILD_OP(fd_linear_unpack)
    .Inputs({"packed"})
    .Outputs({"weight"})
    .Attrs({"k: int64_t", "n: int64_t", "dtype: std::string"})
    .SetKernelFn(PD_KERNEL(LinearUnpack));

PD_BUILD_OP(fd_linear)
    .Inputs({"x", "packed", paddle::Optional("bias")})
    .Outputs({"out"})
    .Attrs({"n: int64_t", "dtype: std::string"})
    .SetKernelFn(PD_KERNEL(Linear));

// ----------------------------------------------------------------------------- W8A8 (oneDNN)
//
// int8 weights [K, N] with scales per (group of K rows, column); activations quantized per row and
// group to u8 with a zero point when each call starts (fastdeploy_cpu::quantize_rows_u8, w8a8.cc).
// oneDNN sums each group's u8 x s8 products in int32 as one matmul batched over the groups (exact:
// a row's result is the same whatever M is, so no M = 1 special case is needed); w8a8_epilogue
// then scales and adds the groups into fp32.

namespace fastdeploy_cpu {

int64_t w8a8_weight_bytes(int64_t k, int64_t n, int64_t group) {
  if (k <= 0 || n <= 0 || group <= 0 || group > k) return -1;
  const int64_t groups = w8a8_groups(k, group);
  return static_cast<int64_t>(w8a8_weight_desc(groups, group, n).get_size()) + groups * n * 8;
}

void w8a8_forward(const float* x, int64_t m, int64_t k, const uint8_t* weight, int64_t weight_bytes, const float* bias,
                  int64_t n, int64_t group, float* out) {
  if (m == 0) return;
  const int64_t groups = w8a8_groups(k, group);
  // The scales and sums end the buffer (its size checked by the caller against w8a8_weight_bytes): no
  // second look-up of oneDNN's packed size per call.
  const float* wscale = reinterpret_cast<const float*>(weight + weight_bytes - groups * n * 8);
  const int32_t* wsum = reinterpret_cast<const int32_t*>(wscale + groups * n);
  // One group: all rows at once, the sums straight into the output. Several: chunks of rows whose
  // [G, rows, N] int32 sums stay near kW8A8SumsPerChunk elements, read back while still cached.
  constexpr int64_t kW8A8SumsPerChunk = int64_t(1) << 20;
  const int64_t chunk = groups == 1 ? m : std::clamp<int64_t>(kW8A8SumsPerChunk / (groups * n), 1, m);
  // Per-thread scratch that only grows: no allocation per call once the longest prefill has run.
  thread_local std::vector<uint8_t> q;
  thread_local std::vector<float> xscale;
  thread_local std::vector<int32_t> xzero, sums;
  if (static_cast<int64_t>(q.size()) < groups * chunk * group) q.resize(groups * chunk * group);
  if (static_cast<int64_t>(xscale.size()) < chunk * groups) xscale.resize(chunk * groups), xzero.resize(chunk * groups);
  if (groups > 1 && static_cast<int64_t>(sums.size()) < groups * chunk * n) sums.resize(groups * chunk * n);
  auto& eng = cpu_engine();
  for (int64_t r0 = 0; r0 < m; r0 += chunk) {
    const int64_t rows = std::min(chunk, m - r0);
    float* o = out + r0 * n;
    quantize_rows_u8(x + r0 * k, rows, k, group, q.data(), xscale.data(), xzero.data());
    CachedMatmul mm = matmul_cache().get({rows, group, n, static_cast<int>(dt::s8), false, omp_get_max_threads(), 0,
                                          groups});
    void* acc = groups == 1 ? static_cast<void*>(o) : static_cast<void*>(sums.data());
    memory src_m(mm.src, eng, q.data());
    memory w_m(mm.weights, eng, const_cast<uint8_t*>(weight));
    memory dst_m(mm.dst, eng, acc);
    mm.primitive.execute(cpu_stream(), {{DNNL_ARG_SRC, src_m}, {DNNL_ARG_WEIGHTS, w_m}, {DNNL_ARG_DST, dst_m}});
    cpu_stream().wait();
    w8a8_epilogue(static_cast<const int32_t*>(acc), rows, n, groups, xscale.data(), xzero.data(), wscale, wsum, bias, o);
  }
}

}  // namespace fastdeploy_cpu

// weight int8 [K, N], wscale [G, N] float32, wsum [G, N] int32 -> one uint8 buffer for fd_w8a8_linear and
// fd_decoder_layers (dtype "w8a8"): the weights as [G, group, N] (K zero-padded to G * group) in oneDNN's
// layout, then the scales, then the column sums.
std::vector<paddle::Tensor> W8A8Pack(const paddle::Tensor& weight, const paddle::Tensor& wscale,
                                     const paddle::Tensor& wsum, int64_t group) {
  fastdeploy_cpu::check_cpu_contiguous(weight, "weight");
  fastdeploy_cpu::check_dtype(weight, paddle::DataType::INT8, "weight");
  PD_CHECK(weight.shape().size() == 2, "fd_w8a8_pack: weight must be [K, N].");
  const int64_t k = weight.shape()[0], n = weight.shape()[1];
  fastdeploy_cpu::check_w8a8_operands(wscale, wsum, paddle::optional<paddle::Tensor>(), k, n, group, "fd_w8a8_pack");
  const int64_t groups = fastdeploy_cpu::w8a8_groups(k, group);
  std::vector<int8_t> padded(groups * group * n, 0);
  std::copy(weight.data<int8_t>(), weight.data<int8_t>() + k * n, padded.begin());
  memory::desc packed_md = w8a8_weight_desc(groups, group, n);
  auto packed = paddle::empty({fastdeploy_cpu::w8a8_weight_bytes(k, n, group)}, paddle::DataType::UINT8, weight.place());
  memory src(memory::desc({groups, group, n}, dt::s8, tag::abc), cpu_engine(), padded.data());
  memory dst(packed_md, cpu_engine(), packed.data());
  dnnl::reorder(src, dst).execute(cpu_stream(), src, dst);
  cpu_stream().wait();
  uint8_t* tail = packed.data<uint8_t>() + packed_md.get_size();
  std::memcpy(tail, wscale.data<float>(), groups * n * sizeof(float));
  std::memcpy(tail + groups * n * sizeof(float), wsum.data<int32_t>(), groups * n * sizeof(int32_t));
  return {packed};
}

// x [..., K] float32, the buffer of fd_w8a8_pack, optional bias [N] -> [..., N] float32.
std::vector<paddle::Tensor> W8A8Linear(const paddle::Tensor& x, const paddle::Tensor& weight,
                                       const paddle::optional<paddle::Tensor>& bias, int64_t n, int64_t group) {
  fastdeploy_cpu::check_cpu_contiguous(weight, "weight");
  const auto [m, k] = fastdeploy_cpu::check_linear_x(x, "fd_w8a8_linear");
  PD_CHECK(group > 0 && group <= std::max<int64_t>(k, 1), "fd_w8a8_linear: group must be in 1..K.");
  PD_CHECK(weight.numel() == fastdeploy_cpu::w8a8_weight_bytes(k, n, group),
           "fd_w8a8_linear: the packed weight does not match [K, N] in groups of `group`.");
  const float* bias_data = fastdeploy_cpu::optional_bias(bias, n, "fd_w8a8_linear");
  auto out = fastdeploy_cpu::linear_output(x, n);
  fastdeploy_cpu::w8a8_forward(x.data<float>(), m, k, weight.data<uint8_t>(), weight.numel(), bias_data, n, group,
                               out.data<float>());
  return {out};
}

PD_BUILD_OP(fd_w8a8_pack)
    .Inputs({"weight", "wscale", "wsum"})
    .Outputs({"packed"})
    .Attrs({"group: int64_t"})
    .SetKernelFn(PD_KERNEL(W8A8Pack));

PD_BUILD_OP(fd_w8a8_linear)
    .Inputs({"x", "weight", paddle::Optional("bias")})
    .Outputs({"out"})
    .Attrs({"n: int64_t", "group: int64_t"})
    .SetKernelFn(PD_KERNEL(W8A8Linear));

// ------------------------------------------------- weight-only int8 / int4 (oneDNN weight decompression)
//
// wint8 / wint4 / AWQ / GPTQ on CPUs with AVX512-BF16 or AMX (the platform's "onednn" integer
// path): the integer weights [K, N] as s8 (a 4-bit value as q - zero, -16..15), packed once into
// oneDNN's blocked layout; fp32 scales [K / group, N] (group = K for per-channel int8). The
// activations are rounded to bf16, as the bf16 linears' are; oneDNN sums in fp32.

// q int8 [K, N] -> packed bytes for fd_weight_only_linear with scales per `group` rows.
std::vector<paddle::Tensor> WeightOnlyPack(const paddle::Tensor& q, int64_t group) {
  fastdeploy_cpu::check_cpu_contiguous(q, "q");
  fastdeploy_cpu::check_dtype(q, paddle::DataType::INT8, "q");
  PD_CHECK(q.shape().size() == 2, "fd_weight_only_pack: q must be [K, N].");
  const int64_t k = q.shape()[0], n = q.shape()[1];
  PD_CHECK(group > 0 && k % group == 0, "fd_weight_only_pack: group must divide K.");
  memory::desc packed_md = packed_weight_desc(k, n, dt::s8, group);
  auto packed = paddle::empty({static_cast<int64_t>(packed_md.get_size())}, paddle::DataType::UINT8, q.place());
  memory src(memory::desc({k, n}, dt::s8, tag::ab), cpu_engine(), const_cast<int8_t*>(q.data<int8_t>()));
  memory dst(packed_md, cpu_engine(), packed.data());
  dnnl::reorder(src, dst).execute(cpu_stream(), src, dst);
  cpu_stream().wait();
  return {packed};
}

// x [..., K] float32, packed weights, scales [K / group, N] float32, optional bias [N] -> [..., N] float32.
std::vector<paddle::Tensor> WeightOnlyLinear(const paddle::Tensor& x, const paddle::Tensor& packed,
                                             const paddle::Tensor& scales,
                                             const paddle::optional<paddle::Tensor>& bias, int64_t n,
                                             int64_t group) {
  fastdeploy_cpu::check_cpu_contiguous(scales, "scales");
  fastdeploy_cpu::check_dtype(scales, paddle::DataType::FLOAT32, "scales");
  const auto [m, k] = fastdeploy_cpu::check_linear_x(x, "fd_weight_only_linear");
  PD_CHECK(group > 0 && k % group == 0, "fd_weight_only_linear: group must divide K.");
  PD_CHECK(packed.numel() == static_cast<int64_t>(packed_weight_desc(k, n, dt::s8, group).get_size()),
           "fd_weight_only_linear: the packed weight does not match [K, N] = [" + std::to_string(k) + ", " +
               std::to_string(n) + "].");
  PD_CHECK(scales.numel() == k / group * n, "fd_weight_only_linear: scales must be [K / group, N].");
  auto out = fastdeploy_cpu::linear_output(x, n);
  if (m == 0) return {out};
  const float* bias_data = fastdeploy_cpu::optional_bias(bias, n, "fd_weight_only_linear");
  memory scale_m(memory::desc({k / group, n}, dt::f32, tag::ab), cpu_engine(),
                 const_cast<float*>(scales.data<float>()));
  fastdeploy_cpu::execute_rows({m, k, n, static_cast<int>(dt::s8), bias_data != nullptr, omp_get_max_threads(), group},
                               to_bf16_scratch(x.data<float>(), m * k), sizeof(uint16_t), packed.data(), bias_data,
                               out.data<float>(), {{DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, scale_m}});
  return {out};
}

PD_BUILD_OP(fd_weight_only_pack)
    .Inputs({"q"})
    .Outputs({"packed"})
    .Attrs({"group: int64_t"})
    .SetKernelFn(PD_KERNEL(WeightOnlyPack));

PD_BUILD_OP(fd_weight_only_linear)
    .Inputs({"x", "packed", "scales", paddle::Optional("bias")})
    .Outputs({"out"})
    .Attrs({"n: int64_t", "group: int64_t"})
    .SetKernelFn(PD_KERNEL(WeightOnlyLinear));
