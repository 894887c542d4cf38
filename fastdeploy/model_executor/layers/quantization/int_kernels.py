"""Integer weights for ``csrc/cpu/int_gemm.cc``: quantization at load, the kernel's panel layout, the reference.

A weight is ``[K, N]`` (our ``[in, out]``). The kernel reads 16 output columns at a time:
int8 as ``[ceil(N/16), K, 16]``, int4 as ``[ceil(N/16), K/2, 16]`` bytes (``q[2p]`` in the low
nibble, ``q[2p+1]`` in the high one), scales and mins ``[ceil(N/16), G, 16]`` fp32 for
``G = ceil(K / group)`` groups (the last one may be part-filled). An int4 weight is
``scale * (q - zero)`` with ``q`` in 0..15; the kernel takes ``min = -scale * zero``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

PANEL = 16
# The kernel path names (OpBackend.int_gemm) -> the op's isa argument.
KERNEL_PATHS = {"scalar": 0, "avx2": 1, "avx512": 2}


class Int4Weight(NamedTuple):
    """Group-wise 4-bit weights in HF-free terms: ``w[k, n] = scales[g, n] * (q[k, n] - zeros[g, n])``, ``g = k // group``."""

    q: np.ndarray  # [K, N] uint8 in 0..15
    scales: np.ndarray  # [G, N] float32
    zeros: np.ndarray  # [G, N] float32 (integers in 0..15)
    group: int

    def dequantize(self) -> np.ndarray:
        """The fp32 ``[K, N]`` weight (the reference the kernel is tested against)."""
        g = np.arange(self.q.shape[0]) // self.group
        return (self.scales[g] * (self.q.astype(np.float32) - self.zeros[g])).astype(np.float32)


def quantize_int8(w: np.ndarray, qmax: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel symmetric int8 of ``w [K, N]``: ``(q int8 [K, N], scales [N])``, ``w ~ q * scale``.

    ``qmax`` bounds ``|q|`` (63 keeps 7 bits for CPUs whose int8 dot products saturate).
    """
    amax = np.abs(w).max(axis=0)
    scales = (amax / np.float32(qmax)).astype(np.float32)
    inv = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales != 0)
    q = np.clip(np.rint(w * inv), -qmax, qmax).astype(np.int8)
    return q, scales


def quantize_int4(w: np.ndarray, group: int = 128) -> Int4Weight:
    """Group-wise asymmetric 4-bit of ``w [K, N]`` (groups of ``group`` rows of K, per column): min/max to 0..15.

    Round to nearest on the full range (widened to hold 0, which is then one of the 16 levels).
    Tried on the default model (its bf16 weights are its GGUF's Q4_1 blocks of 32, dequantized), and
    worse at group 128: a clipped range per group for the least squared error (perplexity 8.50 ->
    8.87 in benchmark_perplexity.py), and Q4_1's own [min, max] -> 0..15 with a real zero point
    (9.53 -> 11.96 on 768 tokens, though at group 32 it gives the file's weights back exactly).
    """
    k, n = w.shape
    groups = -(-k // group)
    pad = np.zeros((groups * group, n), dtype=np.float32)
    pad[:k] = w
    blocks = pad.reshape(groups, group, n)
    # The padding rows of a part-filled last group must not widen its range.
    valid = (np.arange(groups * group) < k).reshape(groups, group, 1)
    lo = np.where(valid, blocks, np.inf).min(axis=1).clip(max=0)
    hi = np.where(valid, blocks, -np.inf).max(axis=1).clip(min=0)
    scales = ((hi - lo) / np.float32(15)).astype(np.float32)
    inv = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales != 0)
    zeros = np.clip(np.rint(-lo * inv), 0, 15).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[:, None, :]) + zeros[:, None, :], 0, 15).astype(np.uint8)
    return Int4Weight(q.reshape(groups * group, n)[:k], scales, zeros, group)


def _panels(a: np.ndarray) -> np.ndarray:
    """``[R, N]`` -> ``[ceil(N/16), R, 16]``, zero past N."""
    rows, n = a.shape
    p = -(-n // PANEL)
    out = np.zeros((rows, p * PANEL), dtype=a.dtype)
    out[:, :n] = a
    return np.ascontiguousarray(out.reshape(rows, p, PANEL).transpose(1, 0, 2))


def pack_int8(q: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's ``(qweight uint8, scales fp32)`` of per-channel int8 ``q [K, N]``."""
    return _panels(q).view(np.uint8).reshape(-1), _panels(scales[None, :].astype(np.float32)).reshape(-1)


def pack_int4(weight: Int4Weight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's ``(qweight uint8, scales, mins)`` of ``weight``."""
    q = weight.q
    if q.shape[0] % 2 or weight.group % 2:
        raise ValueError(f"4-bit weights need an even K and group size, got K={q.shape[0]}, group={weight.group}.")
    pairs = (q[0::2] & 15) | ((q[1::2] & 15) << 4)
    mins = -weight.scales * weight.zeros
    return (_panels(pairs.astype(np.uint8)).reshape(-1), _panels(weight.scales.astype(np.float32)).reshape(-1),
            _panels(mins.astype(np.float32)).reshape(-1))


def unpack_int8(qweight: np.ndarray, scales: np.ndarray, k: int, n: int) -> np.ndarray:
    """The fp32 ``[K, N]`` weight of :func:`pack_int8`'s output."""
    p = -(-n // PANEL)
    q = qweight.view(np.int8).reshape(p, k, PANEL).transpose(1, 0, 2).reshape(k, p * PANEL)[:, :n]
    return q.astype(np.float32) * scales.reshape(p * PANEL)[:n]


def unpack_int4(qweight: np.ndarray, scales: np.ndarray, mins: np.ndarray, k: int, n: int, group: int) -> np.ndarray:
    """The fp32 ``[K, N]`` weight of :func:`pack_int4`'s output."""
    p, groups = -(-n // PANEL), -(-k // group)
    pairs = qweight.reshape(p, k // 2, PANEL).transpose(1, 0, 2).reshape(k // 2, p * PANEL)[:, :n]
    q = np.empty((k, n), dtype=np.float32)
    q[0::2], q[1::2] = pairs & 15, pairs >> 4
    s = scales.reshape(p, groups, PANEL).transpose(1, 0, 2).reshape(groups, p * PANEL)[:, :n]
    m = mins.reshape(p, groups, PANEL).transpose(1, 0, 2).reshape(groups, p * PANEL)[:, :n]
    g = np.arange(k) // group
    return (s[g] * q + m[g]).astype(np.float32)
