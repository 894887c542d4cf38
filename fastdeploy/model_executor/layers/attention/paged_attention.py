"""The attention layer of every model: paged KV cache, implementation chosen by the platform.

:class:`PagedAttention` (vLLM's ``Attention`` layer) builds, once, the implementation class
the platform names (:meth:`Platform.get_attn_backend_cls`, carried by the op backend the
model is built with): :class:`~fastdeploy.model_executor.layers.attention.cpu_attn.CpuPagedAttentionImpl`
on our CPU kernels, or :class:`~fastdeploy.model_executor.layers.attention.paddle_attn.PaddleAttentionImpl`
in plain Paddle ops.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

import paddle
from paddle import nn

from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.attention.paddle_attn import PaddleAttentionImpl


@cache
def resolve_attn_backend(dotted_path: str) -> type[PaddleAttentionImpl]:
    """The implementation class at ``dotted_path`` ("package.module.Class")."""
    module, _, name = dotted_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class PagedAttention(nn.Layer):
    """Scaled dot-product attention of one layer over its paged KV cache.

    Args:
        num_heads: query heads H.
        head_dim: per-head dimension D.
        scale: softmax scale (usually ``D ** -0.5``).
        num_kv_heads: key/value heads KVH (H must be a multiple); defaults to H.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None) -> None:
        super().__init__()
        impl_cls = resolve_attn_backend(get_op_backend().attn_backend_cls)
        # A plain attribute: the forward reaches it without Layer.__getattr__.
        object.__setattr__(self, "impl", impl_cls(num_heads, head_dim, scale, num_kv_heads))
        # The implementation's own method, bound here: forward_qkv(qkv, positions, rotary_emb, kv_cache,
        # attn_metadata, qk_norm) -> [T, H * D], with no extra call per layer and step.
        object.__setattr__(self, "forward_qkv", self.impl.forward_qkv)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = self.impl.num_kv_heads

    @property
    def scale(self) -> float:
        return self.impl.scale

    @scale.setter
    def scale(self, value: float) -> None:
        self.impl.scale = float(value)

    def forward(self, *args: Any) -> paddle.Tensor:
        """The implementation's ``forward(q, k, v, kv_cache, attn_metadata)``: ``q`` ``[T, H*D]``, ``k``/``v``
        ``[T, KVH*D]`` (``[T, heads, D]`` accepted too) -> ``[T, H*D]``."""
        return self.impl.forward(*args)

    def extra_repr(self) -> str:
        impl = self.impl
        return (f"{type(impl).__name__}, heads={impl.num_heads}, kv_heads={impl.num_kv_heads}, "
                f"head_dim={impl.head_dim}, scale={impl.scale:.4g}")
