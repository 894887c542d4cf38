"""Qwen3: the Llama decoder with per-head RMSNorm of queries and keys before RoPE."""

from __future__ import annotations

from typing import Any

from fastdeploy.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models."""

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
