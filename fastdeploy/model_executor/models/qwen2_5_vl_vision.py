"""Qwen2.5-VL's vision tower in Paddle: patch embedding, windowed ViT with 2-D RoPE, patch merger.

The tower takes the image processor's flattened patches ``pixel_values`` ``[N, C * tp * p * p]``
and ``grid_thw`` (patches per image along time, height, width) and returns one embedding of the
language model's width per merged 2x2 patch group, in the order the placeholder tokens follow.

Most blocks attend within windows of ``window_size`` pixels (the patches are reordered so each
window is contiguous); the blocks in ``fullatt_block_indexes`` attend over the whole image. Both
are expressed as one masked attention over the step's patches: a block-diagonal mask keeps every
window (or image) to itself. Weights are kept in Hugging Face's ``[out, in]`` layout, so the
checkpoint loads without transposes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy.model_executor.utils import new_parameter


class _Linear(nn.Layer):
    """``x @ W.T + b`` with ``W`` ``[out, in]`` as Hugging Face stores it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = new_parameter([out_features, in_features])
        self.bias = new_parameter([out_features]) if bias else None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = paddle.matmul(x, self.weight, transpose_y=True)
        return out if self.bias is None else out + self.bias


class _RMSNorm(nn.Layer):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = new_parameter([dim], fill=1.0)
        self.eps = eps

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return x * paddle.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


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


def segment_mask(cu_seqlens: np.ndarray, total: int) -> paddle.Tensor:
    """Additive ``[1, total, total]`` mask: 0 within each ``[cu[i], cu[i+1])`` segment, -inf across."""
    seg = np.zeros(total, dtype=np.int64)
    for i in range(len(cu_seqlens) - 1):
        seg[cu_seqlens[i]:cu_seqlens[i + 1]] = i
    mask = np.where(seg[:, None] == seg[None, :], 0.0, -np.inf).astype(np.float32)
    return paddle.to_tensor(mask[None])


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
        self.qkv = _Linear(dim, 3 * dim)
        self.proj = _Linear(dim, dim)

    def forward(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, mask: paddle.Tensor) -> paddle.Tensor:
        seq = x.shape[0]
        qkv = self.qkv(x).reshape([seq, 3, self.num_heads, self.head_dim])
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # [S, H, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        q, k, v = (t.transpose([1, 0, 2]) for t in (q, k, v))  # [H, S, D]
        scores = paddle.matmul(q, k, transpose_y=True) * (self.head_dim**-0.5) + mask
        out = paddle.matmul(F.softmax(scores, axis=-1), v)  # [H, S, D]
        return self.proj(out.transpose([1, 0, 2]).reshape([seq, -1]))


class Qwen2_5_VisionMLP(nn.Layer):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        # Not "gate_proj"/"up_proj": the decoder's loader fuses those names into gate_up_proj.
        self.gate = _Linear(dim, hidden)
        self.up = _Linear(dim, hidden)
        self.down_proj = _Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(self.act(self.gate(x)) * self.up(x))


class Qwen2_5_VisionBlock(nn.Layer):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.norm1 = _RMSNorm(cfg.hidden_size)
        self.norm2 = _RMSNorm(cfg.hidden_size)
        self.attn = Qwen2_5_VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = Qwen2_5_VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, mask: paddle.Tensor) -> paddle.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class Qwen2_5_VLPatchMerger(nn.Layer):
    """RMSNorm, then each 2x2 group of patches concatenated and projected to the LM's width."""

    def __init__(self, out_dim: int, context_dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = context_dim * merge * merge
        self.ln_q = _RMSNorm(context_dim)
        self.fc1 = _Linear(self.hidden, self.hidden)
        self.fc2 = _Linear(self.hidden, out_dim)

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
        self.patch_embed_weight = new_parameter([cfg.hidden_size, in_dim])
        self.blocks = nn.LayerList([Qwen2_5_VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = Qwen2_5_VLPatchMerger(cfg.out_hidden_size, cfg.hidden_size, self.merge)
        head_dim = cfg.hidden_size // cfg.num_heads
        rot = head_dim // 2  # half of each head's rotary dims encode the row, half the column
        self._inv_freq = (1.0 / (10000.0 ** (np.arange(0, rot, 2, dtype=np.float32) / np.float32(rot)))).astype(
            np.float32)

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
        x = paddle.matmul(pixel_values.astype("float32"), self.patch_embed_weight, transpose_y=True)
        seq = x.shape[0]
        pos = self._rot_pos(grid_thw)
        window_index, cu_window = self._window_index(grid_thw)
        # Patch order follows the windows: groups of `unit` patches move together.
        order = (window_index[:, None] * unit + np.arange(unit)[None, :]).ravel()
        x = paddle.gather(x, paddle.to_tensor(order))
        freqs = pos[order].astype(np.float32)[:, :, None] * self._inv_freq[None, None, :]  # [S, 2, rot/2]
        freqs = freqs.reshape(seq, -1)
        emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [S, 1, head_dim]
        cos, sin = paddle.to_tensor(np.cos(emb)), paddle.to_tensor(np.sin(emb))
        cu_full = np.concatenate([[0], np.cumsum(np.repeat(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]))])
        full_mask, window_mask = segment_mask(cu_full, seq), segment_mask(cu_window, seq)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, full_mask if i in self.fullatt_block_indexes else window_mask)
        merged = self.merger(x)
        return paddle.gather(merged, paddle.to_tensor(np.argsort(window_index)))

    # ---- weights ---------------------------------------------------------------------------
    @staticmethod
    def hf_to_ours(name: str, array: np.ndarray) -> tuple[str, np.ndarray]:
        """A ``visual.*`` checkpoint tensor under our parameter name (the Conv3d kernel flattened)."""
        if name.endswith("patch_embed.proj.weight"):
            return name.replace("patch_embed.proj.weight", "patch_embed_weight"), np.asarray(array).reshape(
                array.shape[0], -1)
        for hf, ours in (("merger.mlp.0.", "merger.fc1."), ("merger.mlp.2.", "merger.fc2."), ("mlp.gate_proj.", "mlp.gate."),
                         ("mlp.up_proj.", "mlp.up.")):
            name = name.replace(hf, ours)
        return name, array
