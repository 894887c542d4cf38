"""Python signatures of the C++ kernels in ``csrc/cpu`` (vLLM's ``_custom_ops``).

Which of them the layers use is the platform's choice (:meth:`Platform.get_op_backend`),
made once; the first call builds or loads the library (see :mod:`fastdeploy._C`).
Each wrapper calls Paddle's custom-op runner directly: the generated Python API of
``cpp_extension`` adds a mode check and a decorator per call, which a decode step
would pay ~300 times.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import paddle
from paddle import _C_ops

from fastdeploy import _C


def _run(name: str, *args: object) -> list[paddle.Tensor]:
    """First call: register the library, then rebind ``_run`` to Paddle's runner (no per-call check after)."""
    global _run
    _C.load()
    _run = _C_ops._run_custom_op
    return _run(name, *args)


def has(op: str = "fd_paged_attention") -> bool:
    """Whether the kernel ``op`` is built and registered in this process."""
    return op in _C.load()


def linear_pack(weight: paddle.Tensor, dtype: str) -> paddle.Tensor:
    """Reorder a ``[K, N]`` fp32 weight into oneDNN's blocked layout in ``dtype`` ("bfloat16"/"float32"): uint8 bytes."""
    return _run("fd_linear_pack", weight, dtype)[0]


def linear_unpack(packed: paddle.Tensor, k: int, n: int, dtype: str) -> paddle.Tensor:
    """The ``[K, N]`` fp32 weight back from :func:`linear_pack`'s bytes (bf16-rounded for "bfloat16")."""
    return _run("fd_linear_unpack", packed, k, n, dtype)[0]


def linear(x: paddle.Tensor, packed: paddle.Tensor, bias: paddle.Tensor | None, n: int, dtype: str) -> paddle.Tensor:
    """``x [..., K] @ W (+ bias)`` -> ``[..., n]`` fp32, with ``W`` packed by :func:`linear_pack` in ``dtype``."""
    return _run("fd_linear", x, packed, bias, n, dtype)[0]


def fused_moe(x: paddle.Tensor, topk_ids: paddle.Tensor, topk_weights: paddle.Tensor, w13: paddle.Tensor,
              w2: paddle.Tensor, inter: int, dtype: str) -> paddle.Tensor:
    """Mixture-of-experts SwiGLU over ``x [T, H]`` -> ``[T, H]`` fp32 (csrc/cpu/moe.cc).

    ``topk_ids`` (int64) / ``topk_weights`` ``[T, K]`` are the router's choice; ``w13`` / ``w2``
    ``[E, bytes]`` hold each expert's gate|up ``[H, 2I]`` and down ``[I, H]`` weights packed by
    :func:`linear_pack` in ``dtype``.
    """
    return _run("fd_fused_moe", x, topk_ids, topk_weights, w13, w2, inter, dtype)[0]


def select_experts(router_logits: paddle.Tensor, e_score_correction_bias: paddle.Tensor | None, top_k: int,
                   renormalize: bool, scoring_func: str, num_expert_group: int, topk_group: int,
                   routed_scaling_factor: float, renormalize_min: float) -> tuple[paddle.Tensor, paddle.Tensor]:
    """MoE routing of ``router_logits [T, E]`` fp32 (``e_score_correction_bias [E]`` fp32 or None) ->
    ``(topk_weights [T, K] fp32, topk_ids [T, K] int64)`` (csrc/cpu/moe_routing.cc; the bias ``[E]`` or ``[1, E]``; the variants and
    arguments of :func:`fastdeploy.model_executor.layers.fused_moe.router.select_experts`, ``num_expert_group``
    0 for none)."""
    weights, ids = _run("fd_select_experts", router_logits, e_score_correction_bias, top_k, renormalize, scoring_func,
                        num_expert_group, topk_group, float(routed_scaling_factor), float(renormalize_min))
    return weights, ids


# The weight formats of the shared experts the quantized fused MoE ops run (KernelWeight dtypes).
SHARED_EXPERT_DTYPES = ("int", "gguf")


class SharedExperts(NamedTuple):
    """An MoE block's shared experts as :func:`int_fused_moe` / :func:`gguf_fused_moe` run them: a dense SwiGLU of
    ``inter`` columns, gate|up ``[H, 2S]`` and down ``[S, H]`` in one format those ops multiply (``dtype`` "int"
    or "gguf", each weight with its segment values as the fused decoder layers take them)."""

    w13: paddle.Tensor
    w2: paddle.Tensor
    inter: int
    dtype: str
    w13_segments: list[int]
    w2_segments: list[int]
    gguf_isa: int = 0


def _shared_args(shared: SharedExperts | None, shared_weights: paddle.Tensor | None) -> tuple[tuple, tuple]:
    """(inputs, attributes) of the fused MoE ops' shared experts; ``shared_weights``: one weight per token or None."""
    if shared is None:
        if shared_weights is not None:
            raise ValueError("shared_weights weighs the shared experts, but no shared experts were given.")
        return (None, None, None), (0, "", [0], [0], 0)
    return ((shared.w13, shared.w2, shared_weights),
            (shared.inter, shared.dtype, shared.w13_segments, shared.w2_segments, shared.gguf_isa))


def int_fused_moe(x: paddle.Tensor, topk_ids: paddle.Tensor, topk_weights: paddle.Tensor, w13: paddle.Tensor,
                  w13_scales: paddle.Tensor, w13_mins: paddle.Tensor | None, w2: paddle.Tensor,
                  w2_scales: paddle.Tensor, w2_mins: paddle.Tensor | None, inter: int, bits: int, group: int,
                  isa: int, shared: SharedExperts | None = None,
                  shared_weights: paddle.Tensor | None = None) -> paddle.Tensor:
    """:func:`fused_moe` with wint8 / wint4 experts (csrc/cpu/moe_quant.cc, each expert's GEMM int_gemm.cc's).

    ``w13`` / ``w2`` ``[E, bytes]`` hold each expert's ``[H, 2I]`` / ``[I, H]`` integers in the panel
    layout of :func:`int_linear`, ``*_scales`` (and the 4-bit ``*_mins``) ``[E, n]`` theirs; ``bits``,
    ``group`` and ``isa`` as :func:`int_linear`'s. ``shared``: the block's shared experts, added to every
    token's output (times ``shared_weights [T]`` where given) inside the op.
    """
    inputs, attrs = _shared_args(shared, shared_weights)
    return _run("fd_int_fused_moe", x, topk_ids, topk_weights, w13, w13_scales, w13_mins, w2, w2_scales, w2_mins,
                *inputs, inter, bits, group, isa, *attrs)[0]


def gguf_fused_moe(x: paddle.Tensor, topk_ids: paddle.Tensor, topk_weights: paddle.Tensor, w13: paddle.Tensor,
                   w2: paddle.Tensor, w13_segments: list[int], w2_segments: list[int], isa: int,
                   shared: SharedExperts | None = None, shared_weights: paddle.Tensor | None = None) -> paddle.Tensor:
    """:func:`fused_moe` with GGUF block experts (csrc/cpu/moe_quant.cc, each expert's GEMM gguf_gemm.cc's).

    ``w13`` ``[E, bytes]``: each expert's gate then up rows (``[2I, H]``) packed by :func:`gguf_pack`
    with their ``(ggml type, rows)`` ``w13_segments``; ``w2`` likewise its down rows ``[H, I]``;
    ``isa`` as :func:`gguf_linear`'s; ``shared`` / ``shared_weights`` as :func:`int_fused_moe`'s.
    """
    inputs, attrs = _shared_args(shared, shared_weights)
    return _run("fd_gguf_fused_moe", x, topk_ids, topk_weights, w13, w2, *inputs, w13_segments, w2_segments, isa,
                *attrs)[0]


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """RMSNorm over the last dimension (fp32)."""
    return _run("fd_rms_norm", x, weight, eps)[0]


def fused_add_rms_norm(
    x: paddle.Tensor, residual: paddle.Tensor, weight: paddle.Tensor, eps: float
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """In place: ``residual += x``, ``x = rms_norm(residual) * weight``; returns ``(x, residual)``."""
    _run("fd_fused_add_rms_norm", x, residual, weight, eps)
    return x, residual


def silu_and_mul(x: paddle.Tensor) -> paddle.Tensor:
    """``silu(x[..., :d]) * x[..., d:]``."""
    return _run("fd_silu_and_mul", x)[0]


def rope_and_cache(
    qkv: paddle.Tensor,
    positions: paddle.Tensor,
    cos_sin_cache: paddle.Tensor,
    key_cache: paddle.Tensor,
    value_cache: paddle.Tensor,
    slot_mapping: paddle.Tensor,
    qk_norm_weight: paddle.Tensor | None,
    num_heads: int,
    is_neox: bool,
    eps: float,
) -> None:
    """In place on ``qkv [T, (H + 2 KVH) D]``: optional per-head q/k RMSNorm, RoPE on q and k; k and v go to the cache."""
    _run(
        "fd_rope_and_cache",
        qkv,
        positions,
        cos_sin_cache,
        key_cache,
        value_cache,
        slot_mapping,
        qk_norm_weight,
        num_heads,
        is_neox,
        eps,
    )


def paged_attention(
    query: paddle.Tensor,
    key_cache: paddle.Tensor,
    value_cache: paddle.Tensor,
    block_tables: paddle.Tensor,
    query_start_loc: paddle.Tensor,
    seq_lens: paddle.Tensor,
    num_heads: int,
    scale: float,
    attn_isa: int,
) -> paddle.Tensor:
    """Causal attention of the queries (first ``H * D`` columns of ``query``) over the paged cache -> ``[T, H * D]``.

    ``attn_isa`` is the platform's path (:attr:`OpBackend.attn_isa`): 1 multiplies bf16 caches with
    AVX512-BF16 dot products (queries and probabilities rounded to bf16), 2 takes their scores from AMX
    tiles, 0 widens them to fp32; plus 8 (``ATTN_PREFETCH_L2``), the rows read next are fetched into L2
    rather than L1 (the same results).
    """
    return _run(
        "fd_paged_attention", query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, num_heads, scale,
        attn_isa,
    )[0]


def decoder_layers(hidden: paddle.Tensor, residual: paddle.Tensor, *args: object
                   ) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Consecutive fused Llama-style decoder layers, in place on ``hidden`` and ``residual`` (and the KV caches).

    ``args`` follow the op's inputs and attributes after those two, a list per per-layer input
    (see csrc/cpu/decoder_layer.cc); :class:`fastdeploy.model_executor.models.fused_layers.FusedLayerRun`
    assembles them.
    """
    _run("fd_decoder_layers", hidden, residual, *args)
    return hidden, residual


def _numpy_view(a: np.ndarray) -> paddle.Tensor:
    """A Paddle tensor over the memory of the C-contiguous array ``a`` (no copy)."""
    return paddle.utils.dlpack.from_dlpack(a)


def exp_scaled(x: np.ndarray, inv_temperature: np.ndarray) -> None:
    """In place on ``x [S, V]`` float32: ``exp((x - row max) * inv_temperature[row])`` (csrc/cpu/sampling.cc)."""
    _run("fd_exp_scaled", _numpy_view(x), _numpy_view(inv_temperature))


def inverse_cdf_sample(weights: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Per row of ``weights [S, V]`` float32 the column drawn with probability proportional to its weight,
    given ``uniform [S]`` float64 in [0, 1) (csrc/cpu/sampling.cc; the numpy sampler's ``inverse_cdf_sample``)."""
    return _run("fd_inverse_cdf_sample", _numpy_view(weights), _numpy_view(uniform))[0].numpy()


def sample_random(x: np.ndarray, inv_temperature: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """:func:`exp_scaled` then :func:`inverse_cdf_sample` in one call (``x`` is left holding the weights)."""
    return _run("fd_sample_random", _numpy_view(x), _numpy_view(inv_temperature), _numpy_view(uniform))[0].numpy()


def gguf_linear(x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None, segments: list[int],
                isa: int) -> paddle.Tensor:
    """``x [..., K] @ W^T (+ bias)`` -> ``[..., N]`` fp32 from GGUF blocks (csrc/cpu/gguf_gemm.cc).

    ``weight`` holds the blocks of consecutive row segments packed by :func:`gguf_pack`,
    ``segments`` their ``(ggml type, rows)`` pairs in output order; ``isa`` the kernel path
    (0 scalar, 1 AVX2, 2 AVX512-VNNI), chosen by the platform.
    """
    return _run("fd_gguf_linear", x, weight, bias, segments, isa)[0]


def gguf_pack(weight: paddle.Tensor, segments: list[int], k: int) -> paddle.Tensor:
    """The uint8 GGUF blocks of ``segments`` (rows of ``k`` elements) in the block kernels' packed layout (uint8)."""
    return _run("fd_gguf_pack", weight, segments, k)[0]


def gguf_embedding(ids: paddle.Tensor, weight: paddle.Tensor, ggml_type: int, rows: int, dim: int) -> paddle.Tensor:
    """Rows ``ids`` of a GGUF table (``rows`` rows of ``dim`` elements of ``ggml_type``, packed by
    :func:`gguf_pack`) as fp32."""
    return _run("fd_gguf_embedding", ids, weight, ggml_type, rows, dim)[0]


def int_linear(x: paddle.Tensor, packed: paddle.Tensor, bias: paddle.Tensor | None, n: int, bits: int, group: int,
               isa: int) -> paddle.Tensor:
    """``x [..., K] @ W (+ bias)`` -> ``[..., n]`` fp32 with integer weights widened in registers (csrc/cpu/int_gemm.cc).

    ``packed`` is one uint8 buffer of the panels, scales and (int4) mins in the layout of ``int_gemm_impl.h``
    (:func:`fastdeploy.model_executor.layers.quantization.int_kernels.linear_buffer` of ``pack_int8`` /
    ``pack_int4``); ``bits`` 8 (per-channel scales) or 4 (``group`` rows of K per scale and min); ``isa``
    the kernel path (0 scalar, 1 AVX2, 2 AVX-512, 3 AVX512-BF16), chosen by the platform.
    """
    return _run("fd_int_linear", x, packed, bias, n, bits, group, isa)[0]


def fp8_linear(x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None, n: int, group: int,
               isa: int) -> paddle.Tensor:
    """``x [..., K] @ W (+ bias)`` -> ``[..., n]`` fp32 with e4m3 weights widened in registers (csrc/cpu/fp8_gemm.cc).

    ``weight`` is :func:`fastdeploy.model_executor.layers.quantization.fp8.pack_fp8`'s uint8 buffer (the codes
    in the layout of ``pair_gemm_impl.h``, then the scales), ``group`` (even) rows of K per scale; ``isa`` the
    kernel path (0 scalar, 1 AVX2, 2 AVX-512, 3 AVX512-BF16, 4 AMX-BF16), chosen by the platform.
    """
    return _run("fd_fp8_linear", x, weight, bias, n, group, isa)[0]


def weight_only_pack(q: paddle.Tensor, group: int) -> paddle.Tensor:
    """int8 ``[K, N]`` weights reordered for oneDNN's weight-decompression matmul (uint8 bytes for
    :func:`weight_only_linear`, scales per ``group`` rows of K)."""
    return _run("fd_weight_only_pack", q, group)[0]


def weight_only_linear(x: paddle.Tensor, packed: paddle.Tensor, scales: paddle.Tensor, bias: paddle.Tensor | None,
                       n: int, group: int) -> paddle.Tensor:
    """``x [..., K] @ (q * scales) (+ bias)`` -> ``[..., n]`` fp32 on oneDNN (csrc/cpu/linear.cc): bf16 activations
    times the s8 weights of :func:`weight_only_pack`, fp32 ``scales [K / group, n]``, fp32 sums."""
    return _run("fd_weight_only_linear", x, packed, scales, bias, n, group)[0]


def w8a8_pack(weight: paddle.Tensor, wscale: paddle.Tensor, wsum: paddle.Tensor, group: int) -> paddle.Tensor:
    """One uint8 buffer for :func:`w8a8_linear` and the fused decoder layers: int8 ``[K, N]`` weights reordered
    for oneDNN's int8 matmul batched over ``G = ceil(K / group)`` groups of ``group`` rows (K zero-padded), then
    their scales ``wscale [G, N]`` (fp32) and column sums ``wsum [G, N]`` (int32, for the zero points)."""
    return _run("fd_w8a8_pack", weight, wscale, wsum, group)[0]


def w8a8_linear(x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor | None, n: int, group: int) -> paddle.Tensor:
    """W8A8 on oneDNN: each row's groups of ``group`` columns of ``x`` quantized to u8 with their own scale and
    zero point, times the int8 weights of :func:`w8a8_pack`'s buffer ``weight``."""
    return _run("fd_w8a8_linear", x, weight, bias, n, group)[0]


def w8a8_linear_portable(x: paddle.Tensor, weight: paddle.Tensor, wscale: paddle.Tensor, wsum: paddle.Tensor,
                         bias: paddle.Tensor | None, group: int) -> paddle.Tensor:
    """W8A8 in portable C++ (int8 ``weight [N, K]``), where oneDNN's int8 matmul is not used."""
    return _run("fd_w8a8_linear_portable", x, weight, wscale, wsum, bias, group)[0]
