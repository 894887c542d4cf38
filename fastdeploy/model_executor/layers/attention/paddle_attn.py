"""Attention over the paged KV cache in plain Paddle ops: the backend every platform can run.

Each step writes this step's K/V into the cache through ``slot_mapping``, then reads every
sequence's context back through its slots:

- decodes (the first ``num_decodes`` rows, one query each) run batched: the cache is
  viewed as ``[num_slots * KVH, D]`` and gathered with per-(request, kv head) row
  indices so K lands directly as ``[decodes, KVH, L, D]`` (no transpose), queries are
  grouped as ``[decodes, KVH, group, D]`` (no repeat of KV heads);
- each prefill (or chunked prefill) sequence runs on its own, causal with an offset.

Index tensors derived from the metadata are built once per step and shared by all
layers: they are cached on the class, keyed by the identity of the metadata object,
so the model runner must build a new :class:`AttentionMetadata` every step rather than
mutate one in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata
from fastdeploy.model_executor.layers.rotary_embedding import RotaryEmbedding


@dataclass
class _PrefillPlan:
    start: int
    query_len: int
    context_len: int
    kv_rows: paddle.Tensor | None  # [KVH, context_len] rows of the [slots * KVH, D] view; None: use this step's K/V
    mask: paddle.Tensor  # [query_len, context_len] additive


@dataclass
class _StepPlan:
    metadata: AttentionMetadata
    num_kv_heads: int
    decode_rows: paddle.Tensor | None  # [num_decodes, KVH, max_context_len]
    prefills: list[_PrefillPlan]
    # (cos, sin) of this step's positions per rotary embedding, gathered once for all layers.
    rope: dict[int, tuple[paddle.Tensor, paddle.Tensor]] = field(default_factory=dict)


def _causal_mask(query_len: int, context_len: int) -> paddle.Tensor:
    """Query i (at position context_len - query_len + i) sees keys 0 .. that position."""
    offset = context_len - query_len
    mask = np.triu(np.full((query_len, context_len), -np.inf, dtype=np.float32), k=offset + 1)
    return paddle.to_tensor(mask)


def _kv_rows(slots: paddle.Tensor, num_kv_heads: int) -> paddle.Tensor:
    """Rows ``slot * KVH + h`` of the ``[slots * KVH, D]`` cache view, laid out ``[..., KVH, L]``."""
    heads = paddle.arange(num_kv_heads, dtype="int64").reshape([num_kv_heads, 1])
    return slots.unsqueeze(-2) * num_kv_heads + heads


def _build_plan(md: AttentionMetadata, num_kv_heads: int) -> _StepPlan:
    decode_rows = None
    if md.num_decodes:
        if md.decode_slots is None or md.decode_mask is None:
            raise ValueError("AttentionMetadata has num_decodes > 0 but no decode_slots / decode_mask.")
        decode_rows = _kv_rows(md.decode_slots, num_kv_heads)
    prefills = []
    for seq in md.prefills:
        # A sequence with no cached context attends only to this step's K/V: use them directly.
        fresh = seq.context_len == seq.query_len
        rows = None if fresh else _kv_rows(seq.context_slots, num_kv_heads)
        mask = seq.causal_mask if seq.causal_mask is not None else _causal_mask(seq.query_len, seq.context_len)
        prefills.append(_PrefillPlan(seq.query_start, seq.query_len, seq.context_len, rows, mask))
    return _StepPlan(md, num_kv_heads, decode_rows, prefills)


class PaddleAttentionImpl:
    """Scaled dot-product attention of one layer over its paged KV cache, in plain Paddle ops.

    Args:
        num_heads: query heads H.
        head_dim: per-head dimension D.
        scale: softmax scale (usually ``D ** -0.5``).
        num_kv_heads: key/value heads KVH (H a multiple of it).
    """

    _plan: _StepPlan | None = None  # shared by the layers of one forward
    # The C++ kernels' attention path (OpBackend.attn_isa) for the fused decoder layer; 0 (fp32) unless
    # a kernel implementation sets it from the platform.
    attn_isa: int = 0

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}).")
        self.group = num_heads // self.num_kv_heads
        # Views of this layer's cache tensors, kept while the runner keeps the same tensors.
        self._views: tuple[paddle.Tensor, ...] | None = None

    def _cache_views(self, kv_cache: tuple[paddle.Tensor, paddle.Tensor]) -> tuple[paddle.Tensor, ...]:
        k_cache, v_cache = kv_cache
        views = self._views
        if views is None or views[0] is not k_cache or views[1] is not v_cache:
            kvh, d = self.num_kv_heads, self.head_dim
            # reshape of a contiguous tensor is a view in Paddle: writes go to the cache itself.
            views = (
                k_cache,
                v_cache,
                k_cache.reshape([-1, kvh, d]),  # [slots, KVH, D] for the per-token writes
                v_cache.reshape([-1, kvh, d]),
                k_cache.reshape([-1, d]),  # [slots * KVH, D] for the per-(slot, head) reads
                v_cache.reshape([-1, d]),
            )
            self._views = views
        return views

    def _step_plan(self, md: AttentionMetadata) -> _StepPlan:
        plan = PaddleAttentionImpl._plan
        if plan is None or plan.metadata is not md or plan.num_kv_heads != self.num_kv_heads:
            plan = _build_plan(md, self.num_kv_heads)
            PaddleAttentionImpl._plan = plan
        return plan

    def forward_qkv(
        self,
        qkv: paddle.Tensor,
        positions: paddle.Tensor,
        rotary_emb: RotaryEmbedding,
        kv_cache: tuple[paddle.Tensor, paddle.Tensor],
        attn_metadata: AttentionMetadata,
        qk_norm: nn.Layer | None = None,
    ) -> paddle.Tensor:
        """Attention of a fused QKV projection output ``[T, (H + 2 KVH) D]`` -> ``[T, H D]``.

        Applies ``qk_norm`` (per-head RMSNorm of queries and keys stacked ``[T, H + KVH, D]``,
        with ``weight`` and ``eps``) when given and RoPE to q and k, writes this step's K/V into
        the cache, and attends.
        """
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = paddle.split(qkv, [(h + kvh) * d, kvh * d], axis=-1)
        # Q and K stacked along heads get norm and rotation in one go.
        qk = qk.reshape([qk.shape[0], h + kvh, d])
        if qk_norm is not None:
            qk = qk_norm(qk)
        plan = self._step_plan(attn_metadata)
        cos_sin = plan.rope.get(id(rotary_emb))
        if cos_sin is None:
            cos_sin = plan.rope[id(rotary_emb)] = rotary_emb.get_cos_sin(positions)
        qk = rotary_emb.rotate(qk, *cos_sin)
        q, k = paddle.split(qk, [h, kvh], axis=1)
        return self.forward(q, k, v, kv_cache, attn_metadata)

    def forward(
        self,
        q: paddle.Tensor,
        k: paddle.Tensor,
        v: paddle.Tensor,
        kv_cache: tuple[paddle.Tensor, paddle.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> paddle.Tensor:
        """``q`` ``[T, H*D]``, ``k``/``v`` ``[T, KVH*D]`` (``[T, heads, D]`` accepted too) -> ``[T, H*D]``."""
        k, v = self.write_kv(k, v, kv_cache, attn_metadata)
        return self.attend(q, k, v, kv_cache, attn_metadata)

    def write_kv(self, k: paddle.Tensor, v: paddle.Tensor, kv_cache: tuple[paddle.Tensor, paddle.Tensor],
                 attn_metadata: AttentionMetadata) -> tuple[paddle.Tensor, paddle.Tensor]:
        """This step's keys and values into the cache at ``slot_mapping``; returns them as ``[T, KVH, D]``."""
        kvh, d = self.num_kv_heads, self.head_dim
        k_cache, _, k_slots, v_slots, _, _ = self._cache_views(kv_cache)
        if k.ndim == 2:
            k = k.reshape([k.shape[0], kvh, d])
        if v.ndim == 2:
            v = v.reshape([v.shape[0], kvh, d])
        if k.dtype != k_cache.dtype:  # a bf16 cache under fp32 activations
            k, v = k.astype(k_cache.dtype), v.astype(k_cache.dtype)
        paddle.scatter_(k_slots, attn_metadata.slot_mapping, k, overwrite=True)
        paddle.scatter_(v_slots, attn_metadata.slot_mapping, v, overwrite=True)
        return k, v

    def attend(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor,
               kv_cache: tuple[paddle.Tensor, paddle.Tensor], attn_metadata: AttentionMetadata) -> paddle.Tensor:
        """Attention of ``q`` over each sequence's context; ``k``/``v`` ``[T, KVH, D]`` are this step's,
        already written (a prefill without cached context reads them directly)."""
        h, kvh, g, d = self.num_heads, self.num_kv_heads, self.group, self.head_dim
        num_tokens = q.shape[0]
        _, _, _, _, k_rows, v_rows = self._cache_views(kv_cache)
        plan = self._step_plan(attn_metadata)
        q = q * self.scale

        outs = []
        nd = attn_metadata.num_decodes
        if nd:
            qd = (q if nd == num_tokens else q[:nd]).reshape([nd, kvh, g, d])
            kd = F.embedding(plan.decode_rows, k_rows)  # [nd, KVH, L, D]
            vd = F.embedding(plan.decode_rows, v_rows)
            scores = paddle.matmul(qd, kd, transpose_y=True) + attn_metadata.decode_mask  # [nd, KVH, g, L]
            out = paddle.matmul(F.softmax(scores, axis=-1), vd)  # [nd, KVH, g, D]
            outs.append(out.reshape([nd, h * d]))
        for p in plan.prefills:
            lq, lc = p.query_len, p.context_len
            end = p.start + lq
            # [Lq, KVH, g, D] -> [KVH, g * Lq, D]: each kv head serves its g query heads in one matmul.
            qp = q[p.start : end].reshape([lq, kvh, g, d]).transpose([1, 2, 0, 3]).reshape([kvh, g * lq, d])
            if p.kv_rows is None:
                kp = k[p.start : end].transpose([1, 0, 2])  # [KVH, Lc, D]
                vp = v[p.start : end].transpose([1, 0, 2])
            else:
                kp = F.embedding(p.kv_rows, k_rows)
                vp = F.embedding(p.kv_rows, v_rows)
            scores = paddle.matmul(qp, kp, transpose_y=True).reshape([kvh, g, lq, lc]) + p.mask
            probs = F.softmax(scores, axis=-1).reshape([kvh, g * lq, lc])
            out = paddle.matmul(probs, vp).reshape([kvh, g, lq, d]).transpose([2, 0, 1, 3])
            outs.append(out.reshape([lq, h * d]))
        if not outs:
            return q.reshape([num_tokens, h * d])
        return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)

