"""Attention over the paged KV cache on our CPU kernels (``csrc/cpu``).

:meth:`CpuPagedAttentionImpl.forward_qkv` takes the fused QKV projection output and runs
two ops: ``fd_rope_and_cache`` (optional q/k RMSNorm, RoPE in place, this step's K/V written
to the cache at ``slot_mapping``) and ``fd_paged_attention``, which reads the queries from
the same buffer and every key and value through the block table, for decodes and (chunked)
prefills in one call.

Metadata without block tables is the one case left to the plain-Paddle implementation this
class extends: the PaddleFormers backend's sliding-window copies of a step's metadata,
whose windows live in masks the kernel does not read.
"""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata
from fastdeploy.model_executor.layers.attention.paddle_attn import PaddleAttentionImpl
from fastdeploy.model_executor.layers.rotary_embedding import RotaryEmbedding


class CpuPagedAttentionImpl(PaddleAttentionImpl):
    """Paged attention of one layer on ``fd_rope_and_cache`` + ``fd_paged_attention`` (fp32 activations)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None) -> None:
        super().__init__(num_heads, head_dim, scale, num_kv_heads)
        # The platform's kernel path, handed to every call.
        self.attn_isa = get_op_backend().attn_isa

    def forward_qkv(
        self,
        qkv: paddle.Tensor,
        positions: paddle.Tensor,
        rotary_emb: RotaryEmbedding,
        kv_cache: tuple[paddle.Tensor, paddle.Tensor],
        attn_metadata: AttentionMetadata,
        qk_norm: nn.Layer | None = None,
    ) -> paddle.Tensor:
        """As :meth:`PaddleAttentionImpl.forward_qkv`, with ``qkv`` modified in place."""
        md = attn_metadata
        if not md.has_kernel_fields:
            return super().forward_qkv(qkv, positions, rotary_emb, kv_cache, md, qk_norm)
        k_cache, v_cache = kv_cache
        norm_weight, eps = (None, 0.0) if qk_norm is None else qk_norm.kernel_args()
        ops.rope_and_cache(qkv, positions, rotary_emb.kernel_cos_sin, k_cache, v_cache, md.slot_mapping, norm_weight,
                           self.num_heads, rotary_emb.is_neox_style, eps)
        return ops.paged_attention(qkv, k_cache, v_cache, md.block_tables, md.query_start_loc, md.seq_lens,
                                   self.num_heads, self.scale, self.attn_isa)

    def attend(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor,
               kv_cache: tuple[paddle.Tensor, paddle.Tensor], attn_metadata: AttentionMetadata) -> paddle.Tensor:
        md = attn_metadata
        if not md.has_kernel_fields:
            return super().attend(q, k, v, kv_cache, md)
        q = q.reshape([q.shape[0], self.num_heads * self.head_dim])
        return ops.paged_attention(q if q.is_contiguous() else q.contiguous(), kv_cache[0], kv_cache[1],
                                   md.block_tables, md.query_start_loc, md.seq_lens, self.num_heads, self.scale,
                                   self.attn_isa)
