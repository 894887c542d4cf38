"""ERNIE 4.5 MoE: the ERNIE 4.5 decoder with sparse blocks of routed and shared experts.

Routing (transformers' ``Ernie4_5_MoeTopKRouter``): softmax over the router's logits in fp32;
the experts are chosen by the top ``moe_k`` of the probabilities *plus*
``moe_statics.e_score_correction_bias``, and weighted by their unbiased probabilities divided
by their sum (at least ``moe_norm_min``). ``moe_num_shared_experts`` shared experts are one
SwiGLU of ``moe_num_shared_experts * moe_intermediate_size``, added unweighted. Layer ``i``
is sparse when ``(i + 1) % moe_layer_interval == 0`` and ``moe_layer_start_index <= i <=
moe_layer_end_index`` (-1: the last layer).
"""

from __future__ import annotations

from typing import Any

from paddle import nn

from fastdeploy.model_executor.layers.fused_moe import FusedMoE
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig
from fastdeploy.model_executor.models.ernie4_5 import Ernie4_5ForCausalLM
from fastdeploy.model_executor.models.moe import (
    COMMON_CHECKS,
    MoEModelMixin,
    MoEStatics,
    SparseMoeBlock,
    refuse_unsupported,
)

_ERNIE_CHECKS = {
    **COMMON_CHECKS,
    # ERNIE-4.5-VL lists one expert count per modality.
    "moe_num_experts": (lambda v: isinstance(v, int), "one routed-expert pool (an int); the multimodal "
                                                      "ERNIE-4.5-VL expert lists are not implemented"),
    "moe_k": (lambda v: isinstance(v, int) and v > 0, "a positive int"),
    "moe_layer_interval": (lambda v: isinstance(v, int) and v > 0, "a positive int"),
}


class Ernie4_5_MoeForCausalLM(MoEModelMixin, Ernie4_5ForCausalLM):
    """ERNIE-4.5-21B-A3B / ERNIE-4.5-300B-A47B (transformers' ``Ernie4_5_MoeForCausalLM``)."""

    def __init__(self, hf_config: Any, dtype: str = "float32", quant_config: QuantizationConfig | None = None) -> None:
        refuse_unsupported(hf_config, _ERNIE_CHECKS)
        super().__init__(hf_config, dtype, quant_config)

    @classmethod
    def lm_head_bias(cls, hf_config: Any) -> bool:
        # transformers' Ernie4_5_MoeForCausalLM gives its head a bias with use_bias (the dense one does not).
        return bool(getattr(hf_config, "use_bias", False))

    def is_moe_layer(self, layer_idx: int) -> bool:
        c = self.config
        end = getattr(c, "moe_layer_end_index", -1)
        end = c.num_hidden_layers - 1 if end is None or end < 0 else end
        return (c.moe_num_experts > 0 and (layer_idx + 1) % c.moe_layer_interval == 0
                and c.moe_layer_start_index <= layer_idx <= end)

    def build_moe_block(self, prefix: str, dtype: str, quant_config: QuantizationConfig | None) -> nn.Layer:
        c = self.config
        statics = MoEStatics(c.moe_num_experts, dtype)
        experts = FusedMoE(
            c.moe_num_experts, c.moe_k, c.hidden_size, c.moe_intermediate_size, renormalize=True, dtype=dtype,
            quant_config=quant_config, prefix=f"{prefix}.experts", e_score_correction_bias=statics.e_score_correction_bias,
            renormalize_min=float(getattr(c, "moe_norm_min", 1e-12)),
        )  # fmt: skip
        num_shared = getattr(c, "moe_num_shared_experts", 0) or 0
        shared = (self.shared_mlp(c.moe_intermediate_size * num_shared, bool(getattr(c, "use_bias", False)), dtype,
                                  quant_config, f"{prefix}.shared_experts") if num_shared > 0 else None)
        return SparseMoeBlock(c.hidden_size, experts, dtype, prefix, shared=shared, shared_name="shared_experts",
                              statics=statics)
