"""Qwen2: the Llama decoder with biases on the Q/K/V projections."""

from __future__ import annotations

from typing import Any

from fastdeploy.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 dense models."""

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)
