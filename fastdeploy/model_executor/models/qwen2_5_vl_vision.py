"""Qwen2.5-VL's vision tower in Paddle: patch embedding, windowed ViT with 2-D RoPE, patch merger.

The tower takes the image processor's flattened patches ``pixel_values`` ``[N, C * tp * p * p]``
and ``grid_thw`` (patches per image along time, height, width) and returns one embedding of the
language model's width per merged 2x2 patch group, in the order the placeholder tokens follow.

Most blocks attend within windows of ``window_size`` pixels (the patches are reordered so each
window is contiguous); the blocks in ``fullatt_block_indexes`` attend over the whole image. Both
run as one batched attention over the segments (:class:`SegmentAttention`): every window (or
image) is a batch row, padded to the longest with masked keys where their lengths differ. The
projections are the project's :class:`~fastdeploy.model_executor.layers.linear.ReplicatedLinear`
(the language model's linear-method interface: packed for the linear kernel in bf16 or fp32
after loading; replicated, not sharded, under tensor parallelism) and the norms its RMSNorm.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.linear import ReplicatedLinear


def vision_linear(in_features: int, out_features: int, bias: bool = True) -> ReplicatedLinear:
    """A tower projection ``x @ W (+ b)``; its loader takes Hugging Face's ``[out, in]`` tensor.

    Unquantized: the quantized checkpoints (AWQ, GPTQ) ship the vision tower in 16 bits.
    """
    return ReplicatedLinear(in_features, out_features, bias=bias)


def rotate_half(x: paddle.Tensor) -> paddle.Tensor:
    """NeoX rotation: ``[x1, x2] -> [-x2, x1]`` over the last dimension."""
    x1, x2 = paddle.chunk(x, 2, axis=-1)
    return paddle.concat([-x2, x1], axis=-1)


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "quick_gelu": lambda x: x * F.sigmoid(1.702 * x),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate=True)}


def activation(name: str):
    """The activation function a config names (Hugging Face's spellings)."""
    if name not in _ACTIVATIONS:
        raise NotImplementedError(f"Vision activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}.")
    return _ACTIVATIONS[name]


class SegmentAttention:
    """Attention of each ``[cu[i], cu[i+1])`` segment of a ``[S, H, D]`` sequence to itself, batched.

    The segments become the batch of one ``scaled_dot_product_attention`` call ``[B, L, H, D]``
    (L the longest segment): the work is ``sum(len^2)``, not ``S^2`` as a block-diagonal mask
    over the whole sequence would cost. Segments of unequal length are padded to ``L`` with a
    zero row whose keys the additive mask removes; the padded rows are dropped again after.
    Built once per forward and shared by every block attending over the same segments.
    """

    def __init__(self, cu_seqlens: np.ndarray) -> None:
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        lens = np.diff(cu)
        self.total, self.batch, self.length = int(cu[-1]), len(lens), int(lens.max())
        self.gather = self.scatter = self.mask = None
        if (lens == self.length).all():  # a plain reshape: no padding
            return
        # Row `total` of the padded input is zeros; every padded slot points at it.
        slots = np.arange(self.length)[None, :]
        valid = slots < lens[:, None]
        index = np.where(valid, cu[:-1, None] + slots, self.total)
        self.gather = paddle.to_tensor(index.ravel())
        self.scatter = paddle.to_tensor(np.flatnonzero(valid.ravel()))  # segment order is sequence order
        mask = np.where(valid, 0.0, -np.inf).astype(np.float32)
        self.mask = paddle.to_tensor(mask[:, None, None, :])  # [B, 1, 1, L]: masks keys only

    def __call__(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
        """``q, k, v`` ``[S, H, D]`` -> ``[S, H * D]``."""
        heads, dim = q.shape[1], q.shape[2]
        if self.gather is not None:
            pad = paddle.zeros([1, heads, dim], dtype=q.dtype)
            q, k, v = (paddle.gather(paddle.concat([t, pad]), self.gather) for t in (q, k, v))
        q, k, v = (t.reshape([self.batch, self.length, heads, dim]) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, training=False)
        out = out.reshape([self.batch * self.length, heads * dim])
        return out if self.scatter is None else paddle.gather(out, self.scatter)


def image_segments(grid_thw: np.ndarray) -> np.ndarray:
    """``cu_seqlens`` of the frames of ``grid_thw`` ``[I, 3]``: each frame attends to itself."""
    return np.concatenate([[0], np.cumsum(np.repeat(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]))])


def rope_cos_sin(pos: np.ndarray, inv_freq: np.ndarray) -> tuple[paddle.Tensor, paddle.Tensor]:
    """2-D rotary tables ``[S, 1, head_dim]`` from each patch's ``(row, column)`` ``pos`` ``[S, 2]``:
    the first half of the bands turns with the row, the second with the column."""
    freqs = (pos.astype(np.float32)[:, :, None] * inv_freq[None, None, :]).reshape(len(pos), -1)
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    return paddle.to_tensor(np.cos(emb)), paddle.to_tensor(np.sin(emb))


def rope_inv_freq(head_dim: int) -> np.ndarray:
    """Inverse frequencies of the towers' 2-D RoPE (half of each head's dims per axis, base 10000)."""
    rot = head_dim // 2
    return (1.0 / (10000.0 ** (np.arange(0, rot, 2, dtype=np.float32) / np.float32(rot)))).astype(np.float32)


def rope_attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor,
                   segments: SegmentAttention) -> paddle.Tensor:
    """NeoX-rotated ``q``/``k`` ``[S, H, D]`` attending within ``segments``: ``[S, H * D]``."""
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    return segments(q, k, v)


def merged_rot_pos(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """Per patch (in the processor's merge-grouped order) its row and column: ``[N, 2]``."""
    out = []
    for t, h, w in np.asarray(grid_thw).tolist():
        hpos = np.broadcast_to(np.arange(h)[:, None], (h, w)).reshape(h // merge, merge, w // merge, merge)
        wpos = np.broadcast_to(np.arange(w)[None, :], (h, w)).reshape(h // merge, merge, w // merge, merge)
        pos = np.stack([hpos.transpose(0, 2, 1, 3).ravel(), wpos.transpose(0, 2, 1, 3).ravel()], axis=-1)
        out.append(np.tile(pos, (t, 1)))
    return np.concatenate(out, axis=0)


class Qwen2_5_VisionAttention(nn.Layer):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = vision_linear(dim, 3 * dim)
        self.proj = vision_linear(dim, dim)

    def forward(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor,
                segments: SegmentAttention) -> paddle.Tensor:
        qkv = self.qkv(x).reshape([x.shape[0], 3, self.num_heads, self.head_dim])
        q, k, v = paddle.unbind(qkv, axis=1)  # [S, H, D] each
        return self.proj(rope_attention(q, k, v, cos, sin, segments))


class Qwen2_5_VisionMLP(nn.Layer):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        # Not "gate_proj"/"up_proj": the decoder's loader fuses those names into gate_up_proj.
        self.gate = vision_linear(dim, hidden)
        self.up = vision_linear(dim, hidden)
        self.down_proj = vision_linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(self.act(self.gate(x)) * self.up(x))


class Qwen2_5_VisionBlock(nn.Layer):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, 1e-6)
        self.norm2 = RMSNorm(cfg.hidden_size, 1e-6)
        self.attn = Qwen2_5_VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = Qwen2_5_VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor,
                segments: SegmentAttention) -> paddle.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class Qwen2_5_VLPatchMerger(nn.Layer):
    """RMSNorm, then each 2x2 group of patches concatenated and projected to the LM's width."""

    def __init__(self, out_dim: int, context_dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = context_dim * merge * merge
        self.ln_q = RMSNorm(context_dim, 1e-6)
        self.fc1 = vision_linear(self.hidden, self.hidden)
        self.fc2 = vision_linear(self.hidden, out_dim)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = self.ln_q(x).reshape([-1, self.hidden])
        return self.fc2(F.gelu(self.fc1(x)))


class Qwen2_5_VisionTransformer(nn.Layer):
    """The whole tower; :meth:`forward` maps ``(pixel_values, grid_thw)`` to merged patch embeddings."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        cfg = vision_config
        self.config = cfg
        self.patch_size = cfg.patch_size
        self.merge = cfg.spatial_merge_size
        self.window_size = cfg.window_size
        self.fullatt_block_indexes = set(cfg.fullatt_block_indexes)
        in_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        # Conv3d with kernel == stride over one flattened patch is a matmul with the flattened kernel.
        self.patch_embed = vision_linear(in_dim, cfg.hidden_size, bias=False)
        self.blocks = nn.LayerList([Qwen2_5_VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = Qwen2_5_VLPatchMerger(cfg.out_hidden_size, cfg.hidden_size, self.merge)
        self._inv_freq = rope_inv_freq(cfg.hidden_size // cfg.num_heads)

    # ---- host-side index computations ----------------------------------------------------
    def _rot_pos(self, grid_thw: np.ndarray) -> np.ndarray:
        return merged_rot_pos(grid_thw, self.merge)

    def _window_index(self, grid_thw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Order of the merged groups that makes each window contiguous, and the window boundaries (in patches)."""
        unit = self.merge * self.merge
        win = self.window_size // self.merge // self.patch_size
        index, cu, base = [], [0], 0
        for t, h, w in grid_thw.tolist():
            gh, gw = h // self.merge, w // self.merge
            ids = np.arange(t * gh * gw).reshape(t, gh, gw)
            ph, pw = win - gh % win, win - gw % win
            padded = np.pad(ids, ((0, 0), (0, ph), (0, pw)), constant_values=-1)
            nh, nw = (gh + ph) // win, (gw + pw) // win
            padded = padded.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, win * win)
            counts = (padded != -1).sum(-1).ravel()
            flat = padded.ravel()
            index.append(flat[flat != -1] + base)
            cu.extend((np.cumsum(counts) * unit + cu[-1]).tolist())
            base += t * gh * gw
        cu_arr = np.asarray(cu, dtype=np.int64)
        keep = np.concatenate([[True], np.diff(cu_arr) != 0])  # empty windows add no boundary
        return np.concatenate(index), cu_arr[keep]

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, pixel_values: paddle.Tensor, grid_thw: np.ndarray) -> paddle.Tensor:
        """``[N, in_dim]`` patches of the images in ``grid_thw`` ``[I, 3]`` -> ``[N / merge^2, out_hidden]``."""
        grid_thw = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        unit = self.merge * self.merge
        x = self.patch_embed(pixel_values.astype("float32"))
        window_index, cu_window = self._window_index(grid_thw)
        # Patch order follows the windows: groups of `unit` patches move together.
        order = (window_index[:, None] * unit + np.arange(unit)[None, :]).ravel()
        x = paddle.gather(x, paddle.to_tensor(order))
        cos, sin = rope_cos_sin(self._rot_pos(grid_thw)[order], self._inv_freq)
        full, windows = SegmentAttention(image_segments(grid_thw)), SegmentAttention(cu_window)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, full if i in self.fullatt_block_indexes else windows)
        merged = self.merger(x)
        return paddle.gather(merged, paddle.to_tensor(np.argsort(window_index)))

    # ---- weights ---------------------------------------------------------------------------
    @staticmethod
    def hf_to_ours(name: str, array: np.ndarray) -> tuple[str, np.ndarray]:
        """A ``visual.*`` checkpoint tensor under our parameter name (the Conv3d kernel flattened)."""
        if name.endswith("patch_embed.proj.weight"):
            return name.replace("patch_embed.proj.weight", "patch_embed.weight"), np.asarray(array).reshape(
                array.shape[0], -1)
        for hf, ours in (("merger.mlp.0.", "merger.fc1."), ("merger.mlp.2.", "merger.fc2."), ("mlp.gate_proj.", "mlp.gate."),
                         ("mlp.up_proj.", "mlp.up.")):
            name = name.replace(hf, ours)
        return name, array
