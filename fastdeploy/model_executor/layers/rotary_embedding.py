"""Rotary position embedding with a precomputed cos/sin cache.

Rotation is written as ``x * cos + (x @ R) * sin`` where ``R`` is a constant ``[D, D]``
signed permutation: ``x @ R`` is ``rotate_half(x)`` for the NeoX style and the pairwise
``(-x1, x0)`` swap for the GPT-J (interleaved) style. That is four eager ops for any
style and any number of heads, where slicing and concatenating halves would take
more. Dimensions past ``rotary_dim`` (partial rotary) get ``cos = 1, sin = 0`` and a
zero block in ``R``, so they pass through unchanged.

The C++ kernel (``csrc/cpu/pos_encoding.cc``) reads the compact ``cos_sin_cache``
``[max_pos, rotary_dim]`` (cos of the rotary_dim / 2 frequencies, then their sin, as in
vLLM) and rotates in place while writing K/V into the paged cache.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import paddle
from paddle import nn

_SUPPORTED_SCALING = ("default", "linear", "llama3", "yarn")


def _inv_freq(base: float, rotary_dim: int) -> np.ndarray:
    # float32 throughout, as transformers computes it, so the angles match bit for bit.
    exponent = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    return (np.float32(1.0) / (np.float32(base) ** exponent)).astype(np.float32)


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are slowed, short ones kept."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor ``0.1 * mscale * ln(scale) + 1`` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, rotary_dim: int, scaling: dict[str, Any], max_position: int) -> tuple[np.ndarray, float]:
    """YaRN (arXiv 2309.00071): ``(inv_freq, attention_factor)``.

    Frequencies below the ``beta_slow`` rotation count are interpolated by ``factor``, those above
    ``beta_fast`` kept, with a linear ramp between; cos/sin are scaled by the attention factor,
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given (DeepSeek's
    form), else ``mscale(factor)``, unless ``attention_factor`` sets it outright.
    """
    orig = int(scaling.get("original_max_position_embeddings") or max_position)
    factor = scaling.get("factor") or max_position / orig
    factor = float(factor)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `orig`
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    pos_freqs = np.float32(base) ** (np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32)
                                     / np.float32(rotary_dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = np.float32(1.0) - ramp  # 1: the frequency is kept (extrapolated), 0: interpolated
    inv_freq = interpolation * (np.float32(1.0) - keep) + extrapolation * keep
    return inv_freq.astype(np.float32), float(attention_factor)


class RotaryEmbedding(nn.Layer):
    """RoPE for queries and keys laid out ``[tokens, heads, head_size]``.

    Args:
        head_size: per-head dimension.
        rotary_dim: leading dimensions that rotate (``head_size`` unless partial rotary).
        max_position_embeddings: positions the cache covers.
        base: rope theta.
        is_neox_style: True for rotate-half (Llama, Qwen), False for interleaved pairs (GPT-J, ERNIE 4.5).
        scaling: a ``rope_scaling`` / ``rope_parameters`` dict, or None.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
        scaling: dict[str, Any] | None = None,
        dtype: str = "float32",
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"rotary_dim must be even and <= head_size, got {rotary_dim} for head_size {head_size}.")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        scaling = dict(scaling or {})
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "deepseek_yarn":  # the name DeepSeek's own configs used before "yarn"
            rope_type = "yarn"
        if rope_type not in _SUPPORTED_SCALING:
            raise NotImplementedError(
                f"RoPE scaling type {rope_type!r} is not supported yet; supported: {list(_SUPPORTED_SCALING)}."
            )
        inv_freq = _inv_freq(base, rotary_dim)
        # YaRN scales cos and sin (so q.k) by its attention factor; 1 for every other type.
        self.attention_factor = 1.0
        if rope_type == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(base, rotary_dim, scaling, max_position_embeddings)
        elif rope_type == "linear":
            inv_freq = (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        cos, sin, rot, cos_sin = self._tables(inv_freq, max_position_embeddings)
        # [max_pos, 1, D]: one gather by position gives a tensor that broadcasts over heads.
        self.register_buffer("cos_cache", paddle.to_tensor(cos.astype(dtype)), persistable=False)
        self.register_buffer("sin_cache", paddle.to_tensor(sin.astype(dtype)), persistable=False)
        self.register_buffer("rotation", paddle.to_tensor(rot.astype(dtype)), persistable=False)
        # Always fp32: the kernel computes in fp32 whatever the model dtype.
        self.register_buffer("cos_sin_cache", paddle.to_tensor(cos_sin), persistable=False)
        # The same tensor as a plain attribute for the per-layer hot path (buffers go through Layer.__getattr__).
        object.__setattr__(self, "kernel_cos_sin", self.cos_sin_cache)

    def _tables(self, inv_freq: np.ndarray, max_pos: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Full-width ``cos``/``sin`` ``[P, 1, D]``, the rotation ``R`` ``[D, D]`` and the kernel's ``[P, rotary_dim]``."""
        d, rd, half = self.head_size, self.rotary_dim, self.rotary_dim // 2
        freqs = np.outer(np.arange(max_pos, dtype=np.float32), inv_freq).astype(np.float32)  # [P, rd/2]
        cos_half, sin_half = np.cos(freqs), np.sin(freqs)
        if self.attention_factor != 1.0:
            cos_half = (cos_half * np.float32(self.attention_factor)).astype(np.float32)
            sin_half = (sin_half * np.float32(self.attention_factor)).astype(np.float32)
        cos = np.ones((max_pos, d), dtype=np.float32)
        sin = np.zeros((max_pos, d), dtype=np.float32)
        rot = np.zeros((d, d), dtype=np.float32)
        idx = np.arange(half)
        if self.is_neox_style:
            cos[:, :rd] = np.concatenate([cos_half, cos_half], axis=1)
            sin[:, :rd] = np.concatenate([sin_half, sin_half], axis=1)
            # rotate_half: out[:half] = -x[half:], out[half:] = x[:half]
            rot[idx + half, idx] = -1.0
            rot[idx, idx + half] = 1.0
        else:
            cos[:, :rd] = np.repeat(cos_half, 2, axis=1)
            sin[:, :rd] = np.repeat(sin_half, 2, axis=1)
            # pairs: out[2i] = -x[2i + 1], out[2i + 1] = x[2i]
            rot[2 * idx + 1, 2 * idx] = -1.0
            rot[2 * idx, 2 * idx + 1] = 1.0
        cos_sin = np.concatenate([cos_half, sin_half], axis=1).astype(np.float32)
        return cos[:, None, :], sin[:, None, :], rot, cos_sin

    def get_cos_sin(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``(cos, sin)`` of shape ``[T, 1, head_size]`` for int64 ``positions`` ``[T]``; compute once per forward."""
        return paddle.gather(self.cos_cache, positions), paddle.gather(self.sin_cache, positions)

    def rotate(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        """Rotate ``x`` ``[T, heads, head_size]`` (queries and keys may be stacked along heads)."""
        return x * cos + paddle.matmul(x, self.rotation) * sin

    def forward(
        self, positions: paddle.Tensor, query: paddle.Tensor, key: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """vLLM's interface: ``query`` ``[T, H * D]`` and ``key`` ``[T, KVH * D]`` -> rotated, same shapes."""
        cos, sin = self.get_cos_sin(positions)
        q = self.rotate(query.reshape([query.shape[0], -1, self.head_size]), cos, sin)
        k = self.rotate(key.reshape([key.shape[0], -1, self.head_size]), cos, sin)
        return q.reshape(query.shape), k.reshape(key.shape)

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_pos={self.max_position_embeddings}, "
            f"base={self.base}, neox={self.is_neox_style}"
        )


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    head_size: int,
    max_position: int,
    base: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    is_neox_style: bool = True,
    rotary_dim: int | None = None,
    dtype: str = "float32",
    rope_parameters: dict[str, Any] | None = None,
) -> RotaryEmbedding:
    """A shared :class:`RotaryEmbedding` (one per distinct configuration, as in vLLM).

    ``rope_parameters`` (transformers 5) and ``rope_scaling`` (older configs) are the same thing;
    a ``rope_theta`` inside ``rope_parameters`` overrides ``base``.
    """
    scaling = dict(rope_parameters or rope_scaling or {})
    base = float(scaling.pop("rope_theta", base))
    if scaling.get("rope_type", scaling.get("type")) == "default" and len(scaling) == 1:
        scaling = {}
    rotary_dim = rotary_dim or head_size
    key = (head_size, rotary_dim, max_position, base, is_neox_style, repr(sorted(scaling.items())), dtype)
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style, scaling, dtype)
    return _ROPE_CACHE[key]
