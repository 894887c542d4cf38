// One matmul weight in any format the CPU kernels multiply, with its format's arguments: what the
// fused decoder layers (decoder_layer.cc) and the fused MoE ops' shared experts (moe_quant.cc) run.
// OwnMatmul takes the formats whose kernels build without oneDNN (int_gemm.cc, gguf_gemm.cc,
// fp8_gemm.cc), so that a source outside the oneDNN build can use it; Matmul adds linear.cc's.
//
// dtype "bfloat16" / "float32": packed for the linear kernel (fd_linear_pack); "gguf": GGUF blocks
// packed by fd_gguf_pack, segments its (ggml type, rows) pairs; "int": one buffer of int_gemm.cc's
// (segments: bits, group, path); "w8a8": fd_w8a8_pack's buffer (segments: group); "fp8": pack_fp8's
// buffer (segments: group, fp8_gemm.cc's path).
#pragma once

#include <string>

#include "kernels.h"

namespace fastdeploy_cpu {

// A weight of the formats "int", "gguf" and "fp8".
struct OwnMatmul {
  const paddle::Tensor& weight;
  const float* bias;
  const int64_t* segments;
  int64_t num_segments;

  static bool own_format(const std::string& dtype) { return dtype == "int" || dtype == "gguf" || dtype == "fp8"; }

  // Whether the weight is a [k, n] matrix of `dtype` (one of own_format's).
  bool fits(int64_t k, int64_t n, const std::string& dtype) const {
    if (dtype == "fp8") return num_segments == 2 && weight.numel() == fp8_weight_bytes(k, n, segments[0]);
    if (dtype == "int") {
      if (num_segments != 3) return false;
      const int64_t bytes = int_linear_bytes(static_cast<int>(segments[0]), k, n, segments[1]);
      return bytes > 0 && weight.numel() == bytes;
    }
    if (dtype != "gguf") return false;
    int64_t rows = 0, bytes = 0;
    for (int64_t s = 0; s + 1 < num_segments; s += 2) {
      const int64_t packed = gguf_packed_bytes(static_cast<int>(segments[s]), segments[s + 1], k);
      if (packed <= 0) return false;
      rows += segments[s + 1];
      bytes += packed;
    }
    return num_segments > 0 && num_segments % 2 == 0 && rows == n && bytes == weight.numel();
  }

  // out[m, n] = x[m, k] @ W (+ bias).
  void run(const float* x, int64_t m, int64_t k, int64_t n, const std::string& dtype, int gguf_isa, float* out) const {
    if (dtype == "fp8") {
      fp8_forward(x, m, k, weight.data<uint8_t>(), segments[0], bias, n, static_cast<int>(segments[1]), out);
    } else if (dtype == "int") {
      const int bits = static_cast<int>(segments[0]);
      const auto parts = int_linear_parts(weight.data<uint8_t>(), bits, k, n, segments[1]);
      int_gemm(x, m, k, parts.w, bits, segments[1], parts.scales, parts.mins, bias, n, static_cast<int>(segments[2]),
               out);
    } else {
      gguf_gemm(x, m, k, weight.data<uint8_t>(), segments, num_segments / 2, bias, n, gguf_isa, out);
    }
  }
};

// A weight of any format: OwnMatmul's, "w8a8" (fd_w8a8_pack) or packed for the linear kernel
// ("bfloat16" / "float32"). Only sources built with oneDNN (linear.cc) may use it.
struct Matmul : OwnMatmul {
  bool fits(int64_t k, int64_t n, const std::string& dtype) const {
    if (own_format(dtype)) return OwnMatmul::fits(k, n, dtype);
    if (dtype == "w8a8") return num_segments == 1 && weight.numel() == w8a8_weight_bytes(k, n, segments[0]);
    return linear_packed_size_ok(weight.numel(), k, n, dtype == "bfloat16");
  }

  void run(const float* x, int64_t m, int64_t k, int64_t n, const std::string& dtype, int gguf_isa, float* out) const {
    if (own_format(dtype)) {
      OwnMatmul::run(x, m, k, n, dtype, gguf_isa, out);
    } else if (dtype == "w8a8") {
      w8a8_forward(x, m, k, weight.data<uint8_t>(), weight.numel(), bias, n, segments[0], out);
    } else {
      linear_forward(x, m, k, weight.data(), bias, n, dtype == "bfloat16", out);
    }
  }
};

}  // namespace fastdeploy_cpu
