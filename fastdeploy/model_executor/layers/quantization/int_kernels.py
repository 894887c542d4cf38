"""Integer weights for ``csrc/cpu/int_gemm.cc``: quantization at load, the kernel's panel layout, the reference.

A weight is ``[K, N]`` (our ``[in, out]``). The kernel reads 16 output columns at a time:
int8 as ``[ceil(N/16), Kp, 16]`` (``Kp``: K rounded up to even with a zero row; the bf16 path reads
rows in pairs), int4 as ``[ceil(N/16), ceil(K/8), 32]`` little-endian uint16 words: block ``b`` of a
panel holds K rows ``8b .. 8b+7``, word ``2c + h`` of it column ``c``'s rows ``8b + 2i + h`` in its
nibble ``i`` (``i`` = 0..3, zeros past K), so one shift and one table lookup of the 64-byte block give
a k pair of all 16 columns in the register layout of the bf16 dot products; scales and mins
``[ceil(N/16), G, 16]`` fp32 for ``G = ceil(K / group)`` groups (the last one may be part-filled). An int4 weight is
``scale * (q - zero)`` with ``q`` in 0..15; the kernel takes ``min = -scale * zero``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from fastdeploy.logger import init_logger

logger = init_logger(__name__)

PANEL = 16
# K rows per 64-byte block of an int4 panel (four k pairs of 16 columns: int_gemm.cc's Int4Ops).
INT4_BLOCK_ROWS = 8
# The kernel path names (OpBackend.int_gemm) of int_gemm.cc -> the op's isa argument.
KERNEL_PATHS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512-bf16": 3, "amx-bf16": 4}
# The bf16 dot-product paths (int_gemm.cc, fp8_gemm.cc: AVX512-BF16 registers, AMX tiles), which
# round the activations to bf16.
BF16_DOT_PATHS = ("amx-bf16", "avx512-bf16")
# The path on oneDNN's weight-decompression matmul (csrc/cpu/linear.cc, AVX512-BF16 / AMX CPUs).
ONEDNN_PATH = "onednn"
# The smallest run of K rows per scale given to oneDNN (a finer split of a group: see onednn_operands).
ONEDNN_MIN_GROUP = 16


class Int8Weight(NamedTuple):
    """Per-output-channel int8: ``w[k, n] = q[k, n] * scales[n]``."""

    q: np.ndarray  # [K, N] int8
    scales: np.ndarray  # [N] float32

    def dequantize(self) -> np.ndarray:
        """The fp32 ``[K, N]`` weight."""
        return self.q.astype(np.float32) * self.scales


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


def quantize_int8(w: np.ndarray, qmax: int = 127) -> Int8Weight:
    """Per-output-channel symmetric int8 of ``w [K, N]``: ``(q int8 [K, N], scales [N])``, ``w ~ q * scale``.

    ``qmax`` bounds ``|q|`` (63 keeps 7 bits for CPUs whose int8 dot products saturate).
    """
    amax = np.abs(w).max(axis=0)
    scales = (amax / np.float32(qmax)).astype(np.float32)
    inv = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales != 0)
    q = np.clip(np.rint(w * inv), -qmax, qmax).astype(np.int8)
    return Int8Weight(q, scales)


def quantize_int4(w: np.ndarray, group: int = 128, shrinks: tuple[float, ...] = (1.0,)) -> Int4Weight:
    """Group-wise asymmetric 4-bit of ``w [K, N]`` (groups of ``group`` rows of K, per column): min/max to 0..15.

    Round to nearest on the range [min, max] (widened to hold 0, which is then one of the 16
    levels) scaled by each factor of ``shrinks``; each group keeps the factor of least squared error.

    wint4 uses the full range only: on the default model (its bf16 weights are its GGUF's Q4_1
    blocks of 32, dequantized) the least-squared-error search lowers the weights' relative error
    13% (0.0112 -> 0.0097 with shrinks 1.0 .. 0.8) yet raises perplexity, 8.50 -> 8.85
    (benchmark_perplexity.py, 2,048 tokens; bf16 6.01). Earlier, Q4_1's own [min, max] with a
    float zero point was worse too at group 128 (9.53 -> 11.96 on 768 tokens).
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
    best: tuple[np.ndarray, ...] = ()
    for f in shrinks:
        scales = ((hi - lo) * np.float32(f) / np.float32(15)).astype(np.float32)
        inv = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales != 0)
        zeros = np.clip(np.rint(-lo * np.float32(f) * inv), 0, 15).astype(np.float32)
        # q - zero, in place: the padding rows (zeros) land on level 0 exactly and add no error.
        qz = np.multiply(blocks, inv[:, None, :])
        np.rint(qz, out=qz)
        np.clip(qz, -zeros[:, None, :], 15 - zeros[:, None, :], out=qz)
        if len(shrinks) > 1:
            diff = qz * scales[:, None, :]
            diff -= blocks
            err = np.einsum("gkn,gkn->gn", diff, diff)
            if best:
                take = err < best[3]
                qz = np.where(take[:, None, :], qz, best[0])
                scales, zeros, err = np.where(take, scales, best[1]), np.where(take, zeros, best[2]), np.minimum(err, best[3])
        else:
            err = np.empty(0)
        best = (qz, scales, zeros, err)
    qz, scales, zeros = best[:3]
    q = (qz + zeros[:, None, :]).astype(np.uint8)
    return Int4Weight(q.reshape(groups * group, n)[:k], scales, zeros, group)


def _panels(a: np.ndarray) -> np.ndarray:
    """``[R, N]`` -> ``[ceil(N/16), R, 16]``, zero past N."""
    rows, n = a.shape
    p = -(-n // PANEL)
    out = np.zeros((rows, p * PANEL), dtype=a.dtype)
    out[:, :n] = a
    return np.ascontiguousarray(out.reshape(rows, p, PANEL).transpose(1, 0, 2))


# K rows per AMX tile multiply (csrc/cpu/pair_gemm_amx.h): a layer's scale groups must span whole ones.
AMX_BLOCK_ROWS = 32


def path_for_dtype(path: str, dtype: str, k: int | None = None, group: int | None = None) -> str:
    """The kernel path for a layer computing in ``dtype`` with ``k`` input rows in scale groups of ``group``
    (None: one scale per column): bf16 dot products round the activations to bf16, so an fp32 model keeps fp32
    activations on the AVX-512 fp32 path instead; AMX tiles multiply 32 rows of K at a time, so a layer with
    several groups of another size runs on AVX512-BF16 registers (logged)."""
    if path in BF16_DOT_PATHS and dtype != "bfloat16":
        return "avx512"
    if path == "amx-bf16" and k is not None and group is not None and -(-k // group) > 1 and group % AMX_BLOCK_ROWS:
        logger.info("K=%d in groups of %d rows: avx512-bf16 instead of amx-bf16 (its tiles need groups of a "
                    "multiple of %d rows)", k, group, AMX_BLOCK_ROWS)
        return "avx512-bf16"
    return path


def pack_int8(q: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's ``(qweight uint8, scales fp32)`` of per-channel int8 ``q [K, N]``."""
    if q.shape[0] % 2:
        q = np.concatenate([q, np.zeros((1, q.shape[1]), dtype=q.dtype)])
    return _panels(q).view(np.uint8).reshape(-1), _panels(scales[None, :].astype(np.float32)).reshape(-1)


def int4_qweight_bytes(k: int, n: int) -> int:
    """Bytes of :func:`pack_int4`'s ``qweight`` for a ``[k, n]`` weight (int_gemm.cc's int_packed_bytes)."""
    return -(-n // PANEL) * -(-k // INT4_BLOCK_ROWS) * INT4_BLOCK_ROWS * PANEL // 2


def pack_int4(weight: Int4Weight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's ``(qweight uint8, scales, mins)`` of ``weight``."""
    q = weight.q
    if q.shape[0] % 2 or weight.group % 2:
        raise ValueError(f"4-bit weights need an even K and group size, got K={q.shape[0]}, group={weight.group}.")
    k, n = q.shape
    p, blocks = -(-n // PANEL), -(-k // INT4_BLOCK_ROWS)
    padded = np.zeros((blocks * INT4_BLOCK_ROWS, p * PANEL), dtype=np.uint16)
    padded[:k, :n] = q & 15
    # rows 8b + 2i + h -> [block, i, h, panel, column]; nibble i of word (column, h)
    rows = padded.reshape(blocks, INT4_BLOCK_ROWS // 2, 2, p, PANEL)
    words = np.bitwise_or.reduce(rows << (4 * np.arange(INT4_BLOCK_ROWS // 2, dtype=np.uint16))[:, None, None, None],
                                 axis=1)
    qweight = np.ascontiguousarray(words.transpose(2, 0, 3, 1)).astype("<u2").view(np.uint8).reshape(-1)
    mins = -weight.scales * weight.zeros
    return qweight, _panels(weight.scales.astype(np.float32)).reshape(-1), _panels(mins.astype(np.float32)).reshape(-1)


def linear_buffer(parts: tuple[np.ndarray, ...]) -> np.ndarray:
    """A linear layer's packed weight as the kernel takes it: :func:`pack_int8` / :func:`pack_int4`'s arrays one
    after the other in one uint8 buffer (panels, scales, mins; csrc/cpu/int_gemm.cc's int_linear_parts)."""
    return np.concatenate([np.ascontiguousarray(p).view(np.uint8).reshape(-1) for p in parts])


def split_linear_buffer(buffer: np.ndarray, bits: int, k: int, n: int, group: int) -> tuple[np.ndarray, ...]:
    """:func:`linear_buffer`'s parts back: ``(qweight, scales)`` for int8, ``(qweight, scales, mins)`` for int4."""
    p = -(-n // PANEL)
    qbytes = p * (k + k % 2) * PANEL if bits == 8 else int4_qweight_bytes(k, n)
    floats = p * (-(-k // group) if bits == 4 else 1) * PANEL
    scales = buffer[qbytes:qbytes + 4 * floats].view(np.float32)
    if bits == 8:
        return buffer[:qbytes], scales
    return buffer[:qbytes], scales, buffer[qbytes + 4 * floats:qbytes + 8 * floats].view(np.float32)


def unpack_int8(qweight: np.ndarray, scales: np.ndarray, k: int, n: int) -> np.ndarray:
    """The fp32 ``[K, N]`` weight of :func:`pack_int8`'s output."""
    p, kp = -(-n // PANEL), k + k % 2
    q = qweight.view(np.int8).reshape(p, kp, PANEL).transpose(1, 0, 2).reshape(kp, p * PANEL)[:k, :n]
    return q.astype(np.float32) * scales.reshape(p * PANEL)[:n]


def unpack_int4(qweight: np.ndarray, scales: np.ndarray, mins: np.ndarray, k: int, n: int, group: int) -> np.ndarray:
    """The fp32 ``[K, N]`` weight of :func:`pack_int4`'s output."""
    p, groups, blocks = -(-n // PANEL), -(-k // group), -(-k // INT4_BLOCK_ROWS)
    words = np.ascontiguousarray(qweight).view("<u2").reshape(p, blocks, PANEL, 2)
    nibbles = (words[..., None] >> (4 * np.arange(INT4_BLOCK_ROWS // 2, dtype=np.uint16))) & 15  # [p, b, c, h, i]
    q = nibbles.transpose(1, 4, 3, 0, 2).reshape(blocks * INT4_BLOCK_ROWS, p * PANEL)[:k, :n].astype(np.float32)
    s = scales.reshape(p, groups, PANEL).transpose(1, 0, 2).reshape(groups, p * PANEL)[:, :n]
    m = mins.reshape(p, groups, PANEL).transpose(1, 0, 2).reshape(groups, p * PANEL)[:, :n]
    g = np.arange(k) // group
    return (s[g] * q + m[g]).astype(np.float32)


def onednn_group(k: int, weight: Int8Weight | Int4Weight) -> int | None:
    """Rows of K per scale for oneDNN (which needs them to divide K), or None where that is too fine.

    int8: all of K. int4: the group, or where a part-filled last group makes it not divide K, the
    gcd of the two (each group's scale repeated over its pieces: the same weights exactly).
    """
    if isinstance(weight, Int8Weight):
        return k
    g = math.gcd(k, weight.group)
    return g if g >= ONEDNN_MIN_GROUP else None


def onednn_operands(weight: Int8Weight | Int4Weight, group: int) -> tuple[np.ndarray, np.ndarray]:
    """``(q int8 [K, N], scales fp32 [K / group, N])`` for csrc/cpu/linear.cc's fd_weight_only_pack / _linear.

    A 4-bit weight goes as ``q - zero`` (-16..15, exact in int8); its group's scale is repeated
    over the ``weight.group / group`` pieces of the group.
    """
    if isinstance(weight, Int8Weight):
        return np.ascontiguousarray(weight.q), weight.scales.astype(np.float32)[None, :]
    k = weight.q.shape[0]
    g = np.arange(k) // weight.group
    q = (weight.q.astype(np.int16) - weight.zeros.astype(np.int16)[g]).astype(np.int8)
    pieces = np.arange(k // group) * group // weight.group
    return np.ascontiguousarray(q), np.ascontiguousarray(weight.scales[pieces].astype(np.float32))
