"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

Per token the cache keeps one row ``[c_kv ; k_pe]`` of ``kv_lora_rank + qk_rope_head_dim``
values (``c_kv`` the normalized KV latent, ``k_pe`` the rotated, head-shared RoPE key), not
per-head keys and values. With ``W_UK`` / ``W_UV`` the key / value halves of ``kv_b_proj``
(``[H, nope, r]`` and ``[H, r, v]``):

- **naive** (prefills): up-project the context latents, ``k = [c W_UK^T ; k_pe]``,
  ``v = c W_UV``, and attend per head as in the paper;
- **absorbed** (decodes): fold ``W_UK`` into the query, ``q_lat = q_nope W_UK``, score
  ``[q_lat ; q_pe] . [c ; k_pe]`` straight against the cached rows (multi-query over one
  latent "head"), take ``probs @ c`` and fold ``W_UV`` into the output. Same numbers up to
  rounding, without materializing per-head keys for the whole context at every step.

Plain Paddle ops: decodes are batched over the padded ``decode_slots`` view of the
metadata, prefills run one sequence at a time (causal with an offset), as in
:mod:`~fastdeploy.model_executor.layers.attention.paddle_attn`.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata
from fastdeploy.model_executor.layers.attention.paddle_attn import _causal_mask


class _LatentRows:
    """The cache as ``[slots, r + rope]`` rows: written at slots, gathered by slot, read back as fp32.

    Paddle's CPU scatter kernel takes no bfloat16, so a bf16 cache is written as int32 words (two
    bf16 values each, an exact bit copy) through a view of the same memory.
    """

    def __init__(self, cache: paddle.Tensor, latent_size: int) -> None:
        self.dtype = cache.dtype
        self.rows = cache.reshape([-1, latent_size])  # a view: writes land in the cache
        self.bits = self.rows.view("int32") if self.dtype == paddle.bfloat16 else self.rows

    def write(self, slots: paddle.Tensor, latent: paddle.Tensor) -> paddle.Tensor:
        """Store ``latent`` ``[T, r + rope]`` at ``slots``; returns it as stored, fp32."""
        stored = latent.astype(self.dtype) if latent.dtype != self.dtype else latent
        words = stored.view("int32") if self.dtype == paddle.bfloat16 else stored
        paddle.scatter_(self.bits, slots, words, overwrite=True)
        return stored.astype("float32") if stored.dtype != paddle.float32 else stored

    def gather(self, slots: paddle.Tensor) -> paddle.Tensor:
        """Rows at ``slots`` (any shape ``S``) -> ``[*S, r + rope]`` fp32."""
        out = F.embedding(slots, self.rows)
        return out.astype("float32") if out.dtype != paddle.float32 else out


class MLAAttentionImpl:
    """The attention core of one MLA layer: cache write, naive prefill, absorbed (or naive) decode.

    Args:
        num_heads: query heads H.
        qk_nope_head_dim / qk_rope_head_dim / v_head_dim: per-head dimensions.
        kv_lora_rank: r, the latent width.
        scale: softmax scale (``qk_head_dim ** -0.5``, times YaRN's ``mscale ** 2``).
        absorbed_decode: False runs decodes through the naive formulation too (for checking one against the other).
    """

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float, absorbed_decode: bool = True) -> None:
        self.num_heads = num_heads
        self.nope, self.rope, self.v_dim, self.rank = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
        self.scale = float(scale)
        self.absorbed_decode = absorbed_decode
        # [H, nope, r] and [H, r, v], fp32, set by set_kv_b_weight once the checkpoint is loaded.
        self.w_uk: paddle.Tensor | None = None
        self.w_uv: paddle.Tensor | None = None

    @property
    def latent_size(self) -> int:
        """Values cached per token: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.rank + self.rope

    def set_kv_b_weight(self, weight: paddle.Tensor) -> None:
        """Split ``kv_b_proj``'s ``[r, H * (nope + v)]`` weight into the absorbed ``W_UK`` / ``W_UV``."""
        w = weight.astype("float32").reshape([self.rank, self.num_heads, self.nope + self.v_dim])
        self.w_uk = w[:, :, : self.nope].transpose([1, 2, 0]).contiguous()  # [H, nope, r]
        self.w_uv = w[:, :, self.nope :].transpose([1, 0, 2]).contiguous()  # [H, r, v]

    def forward(
        self,
        q: paddle.Tensor,
        latent: paddle.Tensor,
        kv_b_proj: paddle.nn.Layer,
        kv_cache: tuple[paddle.Tensor, ...],
        attn_metadata: AttentionMetadata,
    ) -> paddle.Tensor:
        """Write this step's latents, attend.

        Args:
            q: ``[T, H, nope + rope]`` queries, RoPE already applied to the last ``rope`` dims.
            latent: ``[T, r + rope]`` this step's ``[c_kv ; k_pe]`` (``k_pe`` rotated).
            kv_b_proj: the layer's up-projection ``r -> H * (nope + v)`` (the naive path's).
            kv_cache: ``(latent_cache,)`` of ``[num_blocks, block_size, 1, r + rope]``.

        Returns:
            ``[T, H * v]``, ready for ``o_proj``.
        """
        md = attn_metadata
        cache = kv_cache[0]
        rows = _LatentRows(cache, self.latent_size)
        latent = rows.write(md.slot_mapping, latent)
        outs = []
        nd = md.num_decodes
        if nd:
            ctx = rows.gather(md.decode_slots)  # [nd, L, r + rope]
            mask = md.decode_mask.reshape([nd, 1, -1])  # [nd, 1, L]
            qd = q[:nd]
            if self.absorbed_decode:
                outs.append(self.attend_absorbed(qd, ctx, mask))
            else:
                outs.append(self.attend_naive(qd, ctx, kv_b_proj, mask))
        for p in md.prefills:
            end = p.query_start + p.query_len
            fresh = p.context_len == p.query_len
            ctx = latent[p.query_start : end] if fresh else rows.gather(p.context_slots)
            mask = p.causal_mask if p.causal_mask is not None else _causal_mask(p.query_len, p.context_len)
            out = self.attend_naive(q[p.query_start : end].unsqueeze(0), ctx.unsqueeze(0),
                                    kv_b_proj, mask.unsqueeze(0))
            outs.append(out)
        if not outs:
            return paddle.zeros([q.shape[0], self.num_heads * self.v_dim], dtype=q.dtype)
        return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)

    def attend_naive(self, q: paddle.Tensor, ctx: paddle.Tensor, kv_b_proj: paddle.nn.Layer,
                     mask: paddle.Tensor) -> paddle.Tensor:
        """Per-head attention on up-projected keys and values.

        ``q`` ``[B, Lq, H, nope + rope]`` (or ``[B, H, ...]`` for one query each), ``ctx`` ``[B, L, r + rope]``,
        ``mask`` additive, broadcasting to ``[B, Lq, L]``; returns ``[B * Lq, H * v]``.
        """
        if q.ndim == 3:  # decodes: one query per sequence
            q = q.unsqueeze(1)
        b, lq, h = q.shape[0], q.shape[1], self.num_heads
        lc = ctx.shape[1]
        c, k_pe = paddle.split(ctx, [self.rank, self.rope], axis=-1)
        kv = kv_b_proj(c.reshape([b * lc, self.rank])).reshape([b, lc, h, self.nope + self.v_dim])
        k_nope, v = paddle.split(kv, [self.nope, self.v_dim], axis=-1)
        k = paddle.concat([k_nope, k_pe.unsqueeze(2).expand([b, lc, h, self.rope])], axis=-1)
        qh = q.transpose([0, 2, 1, 3])  # [B, H, Lq, D]
        scores = paddle.matmul(qh, k.transpose([0, 2, 1, 3]), transpose_y=True) * self.scale + mask.unsqueeze(1)
        out = paddle.matmul(F.softmax(scores, axis=-1), v.transpose([0, 2, 1, 3]))  # [B, H, Lq, v]
        return out.transpose([0, 2, 1, 3]).reshape([b * lq, h * self.v_dim])

    def attend_absorbed(self, q: paddle.Tensor, ctx: paddle.Tensor, mask: paddle.Tensor) -> paddle.Tensor:
        """Multi-query attention on the latents with ``W_UK`` / ``W_UV`` folded in.

        ``q`` ``[B, H, nope + rope]`` (one query per sequence), ``ctx`` ``[B, L, r + rope]``,
        ``mask`` ``[B, 1, L]``; returns ``[B, H * v]``.
        """
        if self.w_uk is None:
            raise RuntimeError("MLA absorbed decode needs set_kv_b_weight() after loading the checkpoint.")
        b, h = q.shape[0], self.num_heads
        q_nope, q_pe = paddle.split(q, [self.nope, self.rope], axis=-1)
        q_lat = paddle.matmul(q_nope.transpose([1, 0, 2]), self.w_uk).transpose([1, 0, 2])  # [B, H, r]
        q_full = paddle.concat([q_lat, q_pe], axis=-1)  # [B, H, r + rope]
        scores = paddle.matmul(q_full, ctx, transpose_y=True) * self.scale + mask  # [B, H, L]
        o_lat = paddle.matmul(F.softmax(scores, axis=-1), ctx[:, :, : self.rank])  # [B, H, r]
        out = paddle.matmul(o_lat.transpose([1, 0, 2]), self.w_uv)  # [H, B, v]
        return out.transpose([1, 0, 2]).reshape([b, h * self.v_dim])
