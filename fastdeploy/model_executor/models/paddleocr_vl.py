"""PaddleOCR-VL: a NaViT-style SigLIP encoder + 2x2 projector feeding ERNIE-4.5 with M-RoPE.

The encoder takes each image at its own resolution: patch embedding, the learned position
table bilinearly resized to the image's patch grid, pre-norm blocks with 2-D RoPE (row and
column) attending within each image, a final LayerNorm. The projector LayerNorms the patches,
concatenates each 2x2 group and maps it through a GELU MLP to the language model's width. The
language model is ERNIE-4.5 (dense) with NeoX-style M-RoPE; it runs on the Qwen2.5-VL decoder
path (:class:`~fastdeploy.model_executor.models.qwen2_5_vl.Qwen2_5_VLForConditionalGeneration`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy.model_executor.models.llama import DecoderOptions
from fastdeploy.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from fastdeploy.model_executor.models.qwen2_5_vl_vision import (
    SegmentAttention,
    activation,
    image_segments,
    rope_attention,
    rope_cos_sin,
    rope_inv_freq,
    vision_linear,
)
from fastdeploy.model_executor.utils import new_parameter


class _LayerNorm(nn.Layer):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = new_parameter([dim], fill=1.0)
        self.bias = new_parameter([dim])
        self.eps = eps

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class _EncoderLayer(nn.Layer):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, dim // cfg.num_attention_heads
        self.layer_norm1 = _LayerNorm(dim, cfg.layer_norm_eps)
        self.layer_norm2 = _LayerNorm(dim, cfg.layer_norm_eps)
        # q/k/v, not q_proj/k_proj/v_proj: the decoder's loader fuses those names into qkv_proj.
        self.q, self.k, self.v, self.out_proj = (vision_linear(dim, dim) for _ in range(4))
        self.fc1 = vision_linear(dim, cfg.intermediate_size)
        self.fc2 = vision_linear(cfg.intermediate_size, dim)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor,
                segments: SegmentAttention) -> paddle.Tensor:
        seq = x.shape[0]
        h = self.layer_norm1(x)
        q, k, v = (p(h).reshape([seq, self.num_heads, self.head_dim]) for p in (self.q, self.k, self.v))
        x = x + self.out_proj(rope_attention(q, k, v, cos, sin, segments))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class PaddleOCRVisionTower(nn.Layer):
    """Encoder + projector: ``(pixel_values [N, C*p*p], grid_thw [I, 3]) -> [N / merge^2, text hidden]``."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        cfg = hf_config.vision_config
        self.merge = cfg.spatial_merge_size
        dim = cfg.hidden_size
        self.patch_embedding = vision_linear(cfg.num_channels * cfg.patch_size**2, dim)
        self.grid_side = cfg.image_size // cfg.patch_size
        self.position_embedding = new_parameter([self.grid_side**2, dim])
        self.layers = nn.LayerList([_EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.post_layernorm = _LayerNorm(dim, cfg.layer_norm_eps)
        merged = dim * self.merge * self.merge
        self.pre_norm = _LayerNorm(dim, 1e-5)
        self.linear_1 = vision_linear(merged, merged)
        self.linear_2 = vision_linear(merged, hf_config.get_text_config().hidden_size)
        self._inv_freq = rope_inv_freq(dim // cfg.num_attention_heads)

    def _positions(self, h: int, w: int) -> paddle.Tensor:
        """The learned ``[side, side]`` position table resized (bilinear, half-pixel) to ``h x w``."""
        table = self.position_embedding.reshape([1, self.grid_side, self.grid_side, -1]).transpose([0, 3, 1, 2])
        table = F.interpolate(table, size=[h, w], mode="bilinear", align_corners=False)
        return table.transpose([0, 2, 3, 1]).reshape([h * w, -1])

    def forward(self, pixel_values: paddle.Tensor, grid_thw: np.ndarray) -> paddle.Tensor:
        grid_thw = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        x = self.patch_embedding(pixel_values.reshape([pixel_values.shape[0], -1]).astype("float32"))
        parts, rows, cols, start = [], [], [], 0
        for t, h, w in grid_thw.tolist():
            n = t * h * w
            parts.append(x[start:start + n] + paddle.tile(self._positions(h, w), [t, 1]))
            ids = np.arange(n) % (h * w)
            rows.append(ids // w)
            cols.append(ids % w)
            start += n
        x = paddle.concat(parts, axis=0) if len(parts) > 1 else parts[0]
        cos, sin = rope_cos_sin(np.stack([np.concatenate(rows), np.concatenate(cols)], -1), self._inv_freq)
        segments = SegmentAttention(image_segments(grid_thw))
        for layer in self.layers:
            x = layer(x, cos, sin, segments)
        x = self.pre_norm(self.post_layernorm(x))
        out, start, m = [], 0, self.merge
        for t, h, w in grid_thw.tolist():
            feat = x[start:start + t * h * w].reshape([t, h // m, m, w // m, m, -1]).transpose([0, 1, 3, 2, 4, 5])
            out.append(feat.reshape([t * (h // m) * (w // m), -1]))
            start += t * h * w
        merged = paddle.concat(out, axis=0) if len(out) > 1 else out[0]
        return self.linear_2(F.gelu(self.linear_1(merged)))

    _RENAMES = (("visual.vision_model.embeddings.patch_embedding.", "visual.patch_embedding."),
                ("visual.vision_model.embeddings.position_embedding.weight", "visual.position_embedding"),
                ("visual.vision_model.encoder.layers.", "visual.layers."),
                ("visual.vision_model.post_layernorm.", "visual.post_layernorm."),
                ("projector.", "visual."), (".self_attn.", "."), (".mlp.", "."), (".q_proj.", ".q."),
                (".k_proj.", ".k."), (".v_proj.", ".v."))

    @classmethod
    def hf_to_ours(cls, name: str, array: np.ndarray) -> tuple[str, np.ndarray]:
        if name.endswith("patch_embedding.weight"):
            array = np.asarray(array).reshape(array.shape[0], -1)
        for hf, ours in cls._RENAMES:
            name = name.replace(hf, ours)
        return name, array


class PaddleOCRVLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """PaddleOCR-VL (``PaddleOCRVLForConditionalGeneration``)."""

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        bias = bool(getattr(hf_config, "use_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bias)

    @classmethod
    def build_vision_tower(cls, hf_config: Any) -> nn.Layer:
        return PaddleOCRVisionTower(hf_config)

    def rename_weight(self, name: str, array: np.ndarray) -> tuple[str, np.ndarray]:
        """transformers 5 names (``model.visual.*``, ``model.projector.*``, ``model.language_model.*``)
        and the released checkpoint's (``visual.*``, ``mlp_AR.*``, ``model.*``)."""
        if name.startswith(("model.visual.", "model.projector.")):
            name = name[len("model."):]
        if name.startswith("mlp_AR."):
            name = "projector." + name[len("mlp_AR."):]
        if name.startswith(("visual.", "projector.")):
            return PaddleOCRVisionTower.hf_to_ours(name, array)
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        return name, array
