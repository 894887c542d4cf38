"""ERNIE-4.5-VL: a ViT + variable-resolution resampler feeding ERNIE 4.5 MoE with modality-split experts.

As transformers' ``Ernie4_5_VLMoeForConditionalGeneration`` (5.3) computes it:

- **Vision tower**: the image processor's merge-ordered patches through a linear patch
  embedding (no bias), pre-LayerNorm blocks (fused ``qkv`` attention within each image with
  Qwen2-VL's 2-D RoPE on row and column, a ``fc1 -> act -> fc2`` MLP), a final LayerNorm.
- **Resampler**: each 2x2 group of patches concatenated, ``spatial_linear`` (fc1, GELU, fc2,
  LayerNorm); an image's row is then concatenated with itself (the "temporal" pair a video's
  two frames would fill) through ``temporal_linear`` the same way, ``mlp`` to the text width and
  an RMSNorm.
- **Decoder**: ERNIE 4.5 attention with interleaved (GPT-J) RoPE on 3-D positions: frequency
  band ``j`` below ``mrope_section[0] + mrope_section[1]`` turns with the row when ``j`` is even
  and the column when odd, the last ``mrope_section[2]`` bands with time. Layers marked
  "sparse" in ``mlp_layer_types`` hold two routed pools, ``text_moe`` and ``vision_moe``
  (ERNIE 4.5's router: softmax, top-k on the probabilities plus each pool's own
  ``e_score_correction_bias``, renormalised), each token going to one pool by its modality, and
  shared experts every token passes through.

A token is routed to the vision pool when it is an image placeholder or the image start/end
marker around it, as the HF processor's ``moe_mm_token_type_ids`` marks the prompt. Video
inputs are not implemented (refused where they would enter: the resampler and the config).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.layers.fused_moe import FusedMoE
from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig
from fastdeploy.model_executor.models.llama import DecoderOptions, LlamaMLP
from fastdeploy.model_executor.models.moe import (
    COMMON_CHECKS,
    MoEModelMixin,
    MoEStatics,
    SparseMoeBlock,
    refuse_unsupported,
    shared_experts_for,
)
from fastdeploy.model_executor.models.paddleocr_vl import _LayerNorm
from fastdeploy.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from fastdeploy.model_executor.models.qwen2_5_vl_vision import (
    Qwen2_5_VisionAttention,
    SegmentAttention,
    activation,
    image_segments,
    merged_rot_pos,
    rope_cos_sin,
    rope_inv_freq,
    vision_linear,
)

_CHECKS = {
    **COMMON_CHECKS,
    "moe_num_experts": (lambda v: isinstance(v, int) and v > 0, "one expert count for both modality pools (an int, "
                                                                 "transformers' form)"),
    "moe_intermediate_size": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2,
                              "[text experts' size, vision experts' size]"),
    "moe_k": (lambda v: isinstance(v, int) and v > 0, "a positive int"),
}


class _VisionBlock(nn.Layer):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.norm1 = _LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = _LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Qwen2_5_VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.fc1 = vision_linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = vision_linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor,
                segments: SegmentAttention) -> paddle.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class _ResamplerMLP(nn.Layer):
    """``fc1 -> GELU -> fc2 -> LayerNorm`` (transformers' ``Ernie4_5_VLMoeVisionMLP``)."""

    def __init__(self, in_dim: int, out_dim: int, eps: float) -> None:
        super().__init__()
        self.fc1 = vision_linear(in_dim, out_dim)
        self.fc2 = vision_linear(out_dim, out_dim)
        self.ln = _LayerNorm(out_dim, eps)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.ln(self.fc2(F.gelu(self.fc1(x))))


class Ernie4_5_VLVisionTower(nn.Layer):
    """Tower + resampler: ``(pixel_values [N, C*p*p], grid_thw [I, 3]) -> [N / merge^2, text hidden]``."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        cfg = hf_config.vision_config
        text = hf_config.get_text_config()
        self.merge = cfg.spatial_merge_size
        dim = cfg.hidden_size
        self.patch_embed = vision_linear(cfg.in_channels * cfg.patch_size**2, dim, bias=False)
        self.blocks = nn.LayerList([_VisionBlock(cfg) for _ in range(cfg.depth)])
        self.ln = _LayerNorm(dim, cfg.rms_norm_eps)
        spatial = dim * self.merge**2
        self.temporal_merge = int(cfg.temporal_merge_size)
        self.spatial_linear = _ResamplerMLP(spatial, spatial, cfg.rms_norm_eps)
        self.temporal_linear = _ResamplerMLP(spatial * self.temporal_merge, spatial, cfg.rms_norm_eps)
        self.mlp = vision_linear(spatial, text.hidden_size)
        self.after_norm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self._inv_freq = rope_inv_freq(dim // cfg.num_heads)

    def forward(self, pixel_values: paddle.Tensor, grid_thw: np.ndarray) -> paddle.Tensor:
        grid_thw = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        if (grid_thw[:, 0] != 1).any():
            raise NotImplementedError("ERNIE-4.5-VL: inputs with more than one frame (videos) are not supported; "
                                      "only images are.")
        x = self.patch_embed(pixel_values.reshape([pixel_values.shape[0], -1]).astype("float32"))
        cos, sin = rope_cos_sin(merged_rot_pos(grid_thw, self.merge), self._inv_freq)
        segments = SegmentAttention(image_segments(grid_thw))
        for blk in self.blocks:
            x = blk(x, cos, sin, segments)
        x = self.spatial_linear(self.ln(x).reshape([-1, x.shape[-1] * self.merge**2]))
        # One frame: both temporal slots of the pair hold the image's own row.
        x = self.temporal_linear(paddle.concat([x] * self.temporal_merge, axis=-1))
        return self.after_norm(self.mlp(x))

    _RENAMES = (("vision_model.", "visual."), ("vision_tower.", "visual."), ("resampler_model.", "visual."),
                ("visual.patch_embed.proj.weight", "visual.patch_embed.weight"), (".mlp.fc", ".fc"),
                ("_linear.0.", "_linear.fc1."), ("_linear.2.", "_linear.fc2."), ("_linear.3.", "_linear.ln."))

    @classmethod
    def hf_to_ours(cls, name: str, array: np.ndarray) -> tuple[str, np.ndarray]:
        """The tower's and resampler's tensors (Baidu's ``vision_model.*`` / ``resampler_model.*`` with
        ``nn.Sequential`` indices, or transformers' ``vision_tower.*`` and named layers) -> ``visual.*``."""
        for hf, ours in cls._RENAMES:
            name = name.replace(hf, ours)
        return name, array


class ModalityMoeBlock(nn.Layer):
    """ERNIE-4.5-VL's sparse block: ``text_moe`` and ``vision_moe`` pools (each its own router and
    correction bias) and the shared experts; ``(hidden [T, H], vision_rows [V] or None) -> [T, H]``."""

    def __init__(self, text_moe: SparseMoeBlock, vision_moe: SparseMoeBlock, shared: LlamaMLP | None) -> None:
        super().__init__()
        self.text_moe = text_moe
        self.vision_moe = vision_moe
        self.shared_experts = shared

    # The shared experts as the text pool's op takes them in an all-text step (fuse_shared_experts); None:
    # they run as ops of their own.
    _fused_shared: ops.SharedExperts | None = None

    @property
    def has_shared_experts(self) -> bool:
        return self.shared_experts is not None

    def fuse_shared_experts(self) -> bool:
        """Let the text pool's op run the shared experts in steps without image tokens (decode), where it can
        (:func:`~fastdeploy.model_executor.models.moe.shared_experts_for`); True where it does."""
        object.__setattr__(self, "_fused_shared", shared_experts_for(self.shared_experts, self.text_moe.experts))
        return self._fused_shared is not None

    def forward(self, hidden: paddle.Tensor, vision_rows: paddle.Tensor | None = None,
                text_rows: paddle.Tensor | None = None) -> paddle.Tensor:
        if vision_rows is None and self._fused_shared is not None:
            return self.text_moe.experts(hidden, self.text_moe.gate(hidden), self._fused_shared)
        if vision_rows is None:
            out = self.text_moe(hidden)
        else:
            # Each pool sees only its tokens (routing is per token, so splitting changes nothing else).
            out = paddle.zeros_like(hidden)
            out = paddle.scatter(out, vision_rows, self.vision_moe(paddle.gather(hidden, vision_rows)))
            if text_rows is not None:
                out = paddle.scatter(out, text_rows, self.text_moe(paddle.gather(hidden, text_rows)))
        return out if self.shared_experts is None else out + self.shared_experts(hidden)


class Ernie4_5_VLMoeForConditionalGeneration(MoEModelMixin, Qwen2_5_VLForConditionalGeneration):
    """ERNIE-4.5-VL-28B-A3B / 424B-A47B (transformers' ``Ernie4_5_VLMoeForConditionalGeneration``), images only."""

    def __init__(self, hf_config: Any, dtype: str = "float32", quant_config: QuantizationConfig | None = None) -> None:
        text = hf_config.get_text_config()
        refuse_unsupported(text, _CHECKS)
        super().__init__(hf_config, dtype, quant_config)
        params = dict(getattr(text, "rope_parameters", None) or {})
        self.mrope_section = list(params.get("mrope_section") or [22, 22, 20])  # transformers' default
        s_h, s_w, s_t = self.mrope_section
        if s_h != s_w or s_h + s_w + s_t != len(self._inv_freq):
            raise ValueError(f"ERNIE-4.5-VL: mrope_section {self.mrope_section} must be [h, h, t] with 2h + t = "
                             f"rotary_dim / 2 = {len(self._inv_freq)}.")
        self._vision_ids = np.asarray([hf_config.image_token_id, hf_config.image_start_token_id,
                                       hf_config.image_end_token_id], dtype=np.int64)

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        bias = bool(getattr(hf_config, "use_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bias, is_neox_style=False)

    @classmethod
    def build_vision_tower(cls, hf_config: Any) -> nn.Layer:
        return Ernie4_5_VLVisionTower(hf_config)

    # ---- experts ---------------------------------------------------------------------------
    def is_moe_layer(self, layer_idx: int) -> bool:
        types = getattr(self.config, "mlp_layer_types", None) or []
        return layer_idx < len(types) and types[layer_idx] == "sparse"

    def _pool(self, intermediate: int, prefix: str, dtype: str,
              quant_config: QuantizationConfig | None) -> SparseMoeBlock:
        c = self.config
        statics = MoEStatics(c.moe_num_experts, dtype)
        experts = FusedMoE(
            c.moe_num_experts, c.moe_k, c.hidden_size, intermediate, renormalize=True, dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.experts", e_score_correction_bias=statics.e_score_correction_bias,
            renormalize_min=float(getattr(c, "moe_norm_min", 1e-12)),
        )  # fmt: skip
        return SparseMoeBlock(c.hidden_size, experts, dtype, prefix, statics=statics)

    def build_moe_block(self, prefix: str, dtype: str, quant_config: QuantizationConfig | None) -> nn.Layer:
        c = self.config
        text_size, vision_size = (int(v) for v in c.moe_intermediate_size)
        num_shared = getattr(c, "moe_num_shared_experts", 0) or 0
        shared = (self.shared_mlp(text_size * num_shared, bool(getattr(c, "use_bias", False)), dtype, quant_config,
                                  f"{prefix}.shared_experts") if num_shared > 0 else None)
        return ModalityMoeBlock(self._pool(text_size, f"{prefix}.text_moe", dtype, quant_config),
                                self._pool(vision_size, f"{prefix}.vision_moe", dtype, quant_config), shared)

    def run_mlp(self, mlp: nn.Layer, hidden: paddle.Tensor, input_ids: paddle.Tensor) -> paddle.Tensor:
        if not isinstance(mlp, ModalityMoeBlock):
            return mlp(hidden)
        rows = self._step_rows  # set once per step by forward
        return mlp(hidden, *rows) if rows is not None else mlp(hidden)

    def _modality_rows(self, input_ids: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor | None] | None:
        """``(vision rows, text rows or None)`` of the step, or None when every token is text."""
        ids = input_ids.numpy()
        is_vision = np.isin(ids, self._vision_ids)
        if not is_vision.any():
            return None
        text = np.flatnonzero(~is_vision)
        return (paddle.to_tensor(np.flatnonzero(is_vision)),
                paddle.to_tensor(text) if len(text) else None)

    def forward(self, input_ids: paddle.Tensor, *args: Any, **kwargs: Any) -> paddle.Tensor:
        """The decoder step; which rows go to the vision experts is worked out once for all layers."""
        object.__setattr__(self, "_step_rows", self._modality_rows(input_ids))
        return super().forward(input_ids, *args, **kwargs)

    # ---- rope ------------------------------------------------------------------------------
    def rope_axes(self) -> np.ndarray:
        s_h, s_w, s_t = self.mrope_section
        hw = np.arange(s_h + s_w)
        return np.concatenate([np.where(hw % 2 == 0, 1, 2), np.zeros(s_t, dtype=np.int64)])

    # ---- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> set[str]:
        """Load Baidu's checkpoint layout (what ``save_pretrained`` writes too) or transformers' in-memory names.

        Baidu's keeps both pools in one list, ``mlp.experts.{0..2E-1}`` (text first), the
        routers transposed as ``mlp.gate.weight`` (text) and ``mlp.gate.weight_1`` (vision), and
        both correction biases in one ``[2, E]`` ``mlp.moe_statics.e_score_correction_bias``.
        """
        return super().load_weights(self._split_pools(weights))

    def _split_pools(self, weights: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        num = self.config.moe_num_experts
        for name, array in weights:
            if name.endswith(".mlp.moe_statics.e_score_correction_bias"):
                stem = name[:-len("moe_statics.e_score_correction_bias")]
                array = np.asarray(array)
                yield f"{stem}text_moe.moe_statics.e_score_correction_bias", array[0:1]
                yield f"{stem}vision_moe.moe_statics.e_score_correction_bias", array[1:2]
                continue
            for suffix, pool in ((".mlp.gate.weight", "text_moe"), (".mlp.gate.weight_1", "vision_moe")):
                if name.endswith(suffix):  # [hidden, experts] -> [experts, hidden]
                    name, array = f"{name[:-len(suffix)]}.mlp.{pool}.gate.weight", np.asarray(array).T
                    break
            head, sep, tail = name.partition(".mlp.experts.")
            if sep and tail.split(".")[0].isdigit():
                e, _, rest = tail.partition(".")
                pool, e = ("text_moe", int(e)) if int(e) < num else ("vision_moe", int(e) - num)
                name = f"{head}.mlp.{pool}.experts.{e}.{rest}"
            yield name, array

    def rename_weight(self, name: str, array: np.ndarray) -> tuple[str, np.ndarray]:
        """Names after :meth:`_split_pools` -> ours (``model.language_model.`` and each pool's
        ``gate.moe_statics.`` are transformers' spellings)."""
        if name.startswith(("model.vision_model.", "model.vision_tower.", "model.resampler_model.")):
            return Ernie4_5_VLVisionTower.hf_to_ours(name[len("model."):], array)
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        return name.replace(".gate.moe_statics.", ".moe_statics."), array
