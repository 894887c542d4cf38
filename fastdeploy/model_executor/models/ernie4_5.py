"""ERNIE 4.5 dense: the Llama decoder with interleaved (GPT-J style) RoPE and optional biases everywhere."""

from __future__ import annotations

from typing import Any

from fastdeploy.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    """ERNIE 4.5 dense models (transformers' ``Ernie4_5ForCausalLM``, Baidu's ``Ernie4_5_ForCausalLM``)."""

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        bias = bool(getattr(hf_config, "use_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bias, is_neox_style=False)
