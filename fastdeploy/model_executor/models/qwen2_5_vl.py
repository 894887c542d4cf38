"""Qwen2.5-VL: the Qwen2 language model with M-RoPE on the paged KV cache, fed by a windowed ViT.

Multimodal interface (read by :mod:`fastdeploy.multimodal.runner`):

- ``supports_multimodal`` / ``uses_mrope``: the runner keeps per-request 3-D positions.
- ``get_mrope_input_positions(token_ids, features)`` -> ``(positions [3, P], delta)``: positions
  of the prompt (text advances all three axes together; an image's tokens take its time, row
  and column index from where the image starts), and ``delta`` = next position - P, so a token
  at index ``i >= P`` sits at ``i + delta`` on every axis (vLLM's ``mrope_position_delta``).
- ``embed_multimodal(pixel_values, grid_thw)`` -> ``[tokens, hidden]``: one row per placeholder.
- ``forward(..., mrope_positions=[3, T], mm_embeds=[M, hidden], mm_token_index=[M])``: the
  embeddings replace the placeholder rows of the step before the decoder runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import paddle

from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig
from fastdeploy.model_executor.models.llama import DecoderOptions, LlamaForCausalLM, get_head_dim, rope_settings
from fastdeploy.model_executor.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer, rotate_half


class StepMRope:
    """M-RoPE of one step in the shape the attention implementations take a rotary embedding.

    The angles of the step's tokens are computed once from their 3-D positions (frequency band
    ``j`` turns with the position on axis ``axes[j]``: 0 time, 1 height, 2 width) into a
    ``[T, rotary_dim]`` cos/sin table; the layers then address it with positions ``0..T-1``, so the
    fused rope + KV-cache-write kernel and the plain Paddle path both apply it unchanged.
    ``is_neox_style`` False rotates interleaved pairs (ERNIE) instead of halves (Qwen).
    """

    def __init__(self, positions: np.ndarray, inv_freq: np.ndarray, axes: np.ndarray,
                 is_neox_style: bool = True) -> None:
        freqs = (positions.astype(np.float32)[axes] * inv_freq[:, None]).T  # [T, rotary_dim / 2]
        self.is_neox_style = is_neox_style
        self._cos, self._sin = np.cos(freqs), np.sin(freqs)
        self.kernel_cos_sin = paddle.to_tensor(np.concatenate([self._cos, self._sin], axis=1))
        self.index = paddle.arange(positions.shape[1], dtype="int64")

    def get_cos_sin(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Full-width ``cos``/``sin`` ``[T, 1, D]`` (both NeoX halves, or both members of a pair, repeat the bands)."""
        if self.is_neox_style:
            cos, sin = (np.concatenate([t, t], axis=-1) for t in (self._cos, self._sin))
        else:
            cos, sin = (np.repeat(t, 2, axis=-1) for t in (self._cos, self._sin))
        return paddle.to_tensor(cos[:, None, :]), paddle.to_tensor(sin[:, None, :])

    def rotate(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        if self.is_neox_style:
            return x * cos + rotate_half(x) * sin
        pairs = x.reshape([*x.shape[:-1], -1, 2])  # interleaved: (x0, x1) -> (-x1, x0)
        rotated = paddle.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
        return x * cos + rotated * sin


def mrope_positions_of(token_ids: Sequence[int], features: Sequence[Any], merge: int) -> tuple[np.ndarray, int]:
    """3-D positions of a prompt whose placeholder runs are ``features`` (``offset``, ``length``,
    ``grid_thw``) and its delta (see the module docstring)."""
    n = len(token_ids)
    out = np.empty((3, n), dtype=np.int64)
    cur = 0  # next position
    idx = 0  # next token index
    for f in sorted(features, key=lambda f: f.offset):
        text = f.offset - idx
        out[:, idx:f.offset] = np.arange(cur, cur + text)[None, :]
        cur += text
        t, h, w = (int(v) for v in f.grid_thw)
        h, w = h // merge, w // merge
        if t * h * w != f.length:
            raise ValueError(f"Image at token {f.offset} has {f.length} placeholder tokens, its grid {t}x{h}x{w}.")
        out[0, f.offset:f.offset + f.length] = cur  # images: one time step
        out[1, f.offset:f.offset + f.length] = cur + np.repeat(np.arange(h), w).reshape(1, -1).repeat(t, 0).ravel()
        out[2, f.offset:f.offset + f.length] = cur + np.tile(np.arange(w), h * t)
        cur += max(h, w)
        idx = f.offset + f.length
    out[:, idx:] = np.arange(cur, cur + n - idx)[None, :]
    cur += n - idx
    return out, cur - n


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): vision tower + Qwen2 decoder with M-RoPE.

    Other vision-language models with a Llama-family decoder under M-RoPE subclass it and
    override :meth:`decoder_options`, :meth:`build_vision_tower` and :meth:`rename_weight`.
    """

    supports_multimodal = True
    uses_mrope = True
    # Dummy weights: each linear layer may be packed as soon as its weights are set (nothing in
    # process_weights_after_loading reads a dense weight back), so a bf16 model never holds a full fp32 copy.
    packs_dummy_weights_per_layer = True

    def __init__(self, hf_config: Any, dtype: str = "float32", quant_config: QuantizationConfig | None = None) -> None:
        text_config = hf_config.get_text_config()
        super().__init__(text_config, dtype, quant_config)
        self.hf_config = hf_config
        self.visual = self.build_vision_tower(hf_config)
        self.image_token_id = int(hf_config.image_token_id)
        self.spatial_merge_size = int(hf_config.vision_config.spatial_merge_size)
        base, _, rotary_dim = rope_settings(text_config)
        params = dict(getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {})
        head_dim = get_head_dim(text_config)
        self.mrope_section = list(params.get("mrope_section") or [head_dim // 2, 0, 0])
        if sum(self.mrope_section) != rotary_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to rotary_dim / 2 = {rotary_dim // 2}.")
        exponent = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
        self._inv_freq = (np.float32(1.0) / (np.float32(base) ** exponent)).astype(np.float32)

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)

    @classmethod
    def build_vision_tower(cls, hf_config: Any) -> paddle.nn.Layer:
        """The vision encoder: ``(pixel_values tensor, grid_thw [I, 3]) -> [tokens, text hidden]``."""
        return Qwen2_5_VisionTransformer(hf_config.vision_config)

    def rename_weight(self, name: str, array: np.ndarray) -> tuple[str, np.ndarray]:
        """A checkpoint tensor under our name: ``model.visual.*`` / ``model.language_model.*``
        (transformers 5) and ``visual.*`` / ``model.*`` (the released checkpoints)."""
        if name.startswith("model.visual."):
            name = name[len("model."):]
        if name.startswith("visual."):
            return self.visual.hf_to_ours(name, array)
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        return name, array

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False))

    def rope_axes(self) -> np.ndarray:
        """Per rotary frequency band, the position axis turning it: ``mrope_section`` bands of
        time, then height, then width."""
        return np.repeat(np.arange(3), self.mrope_section)

    def run_mlp(self, mlp: paddle.nn.Layer, hidden: paddle.Tensor, input_ids: paddle.Tensor) -> paddle.Tensor:
        """A layer's feed-forward on the step; models whose experts depend on the token override it."""
        return mlp(hidden)

    # ---- multimodal ----------------------------------------------------------------------
    def get_mrope_input_positions(self, token_ids: Sequence[int], features: Sequence[Any]) -> tuple[np.ndarray, int]:
        return mrope_positions_of(token_ids, features, self.spatial_merge_size)

    def embed_multimodal(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> paddle.Tensor:
        """The vision tower on one or more images' patches: ``[placeholder tokens, hidden]``."""
        return self.visual(paddle.to_tensor(np.asarray(pixel_values, dtype=np.float32)), grid_thw)

    # ---- forward -------------------------------------------------------------------------
    def forward(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]],
        attn_metadata: AttentionMetadata,
        mrope_positions: np.ndarray | None = None,
        mm_embeds: paddle.Tensor | None = None,
        mm_token_index: np.ndarray | None = None,
    ) -> paddle.Tensor:
        lm = self.model
        hidden = lm.embed_tokens(input_ids)
        if mm_embeds is not None and len(mm_token_index):
            index = paddle.to_tensor(np.asarray(mm_token_index, dtype=np.int64))
            hidden = paddle.scatter(hidden, index, mm_embeds.astype(hidden.dtype), overwrite=True)
        if mrope_positions is None:  # text only: all three axes at the 1-D position
            mrope_positions = np.repeat(positions.numpy()[None, :], 3, axis=0)
        rope = StepMRope(np.asarray(mrope_positions), self._inv_freq, self.rope_axes(), self.options.is_neox_style)
        residual = None
        for layer, kv_cache in zip(lm.layers, kv_caches, strict=True):
            if residual is None:
                residual = hidden
                hidden = layer.input_layernorm(hidden)
            else:
                hidden, residual = layer.input_layernorm(hidden, residual)
            attn = layer.self_attn
            out = attn.attn.forward_qkv(attn.qkv_proj(hidden), rope.index, rope, kv_cache, attn_metadata, None)
            hidden, residual = layer.post_attention_layernorm(attn.o_proj(out), residual)
            hidden = self.run_mlp(layer.mlp, hidden, input_ids)
        hidden, _ = lm.norm(hidden, residual)
        return hidden

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> set[str]:
        """Load Hugging Face tensors, renamed by :meth:`rename_weight`."""
        return super().load_weights(self.rename_weight(name, array) for name, array in weights)
